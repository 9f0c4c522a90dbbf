"""Request validation off the front's event loop for long prompts.

Tokenizing a prompt is the one part of a request's validation whose cost grows with it: a
1,024-token text prompt takes a few milliseconds, during which an event loop that ran it
would stream nothing to any other client. A request whose prompt text (or chat messages'
content) is at least `inline_chars` long is validated on a small thread pool instead;
`ModelTokenizer.encode` releases the interpreter lock while the tokenizer runs, so the
loop keeps serving meanwhile. Shorter prompts, and prompts of token ids, are validated
inline: a hop to a thread costs more than they do.

The pool pays only where its threads find a free core. On a machine of 2 cores shared by
the mesh's processes (the CI machine: W5-shaped text prompts of 1,024 tokens at 16 req/s
on the null model, six pairs), it cut the streams' ITL p99 from 10.1 to 8.2 ms but added
2 ms to the mean TTFT and 14 ms to its p99: the hand-off waited for a core. So a process
that may use fewer than `MIN_POOL_CORES` cores (a container's CPU limit counts)
validates everything inline.

The outcome is the same either way: the `GenerateRequest` of `validate_request`, or its
`ValidationError`. The router's Tokenize call tokenizes the same way (`offload`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from foundation.cpus import usable_cores
from router.requests import (
    ChatPrompt,
    GenerateRequest,
    PromptInput,
    RawGenerateRequest,
    RequestLimits,
    TextPrompt,
)
from router.tool_calls.parsers import ToolCallFormat
from router.validation import PromptEncoder, validate_request

# About 250 tokens of text: under it a thread's hand-off and wake-ups cost more than the
# tokenization they would take off the loop.
INLINE_PROMPT_CHARS = 1024
MIN_POOL_CORES = 4  # fewer usable cores: no pool (see the module)

T = TypeVar("T")


def default_workers() -> int:
    """The pool's threads for this process: none under `MIN_POOL_CORES` usable cores (its
    affinity mask, at most its cgroup's CPU quota: `foundation.cpus`), else one per four
    cores, at most 4."""
    cores = usable_cores()
    return 0 if cores < MIN_POOL_CORES else min(4, cores // 4)


def prompt_chars(prompt: PromptInput) -> int:
    """The characters a prompt's tokenization reads (0 for token ids)."""
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    if isinstance(prompt, ChatPrompt):
        return sum(len(m.content) for m in prompt.messages)
    return 0


class RequestValidator:
    """`validate_request` with the front's tokenizer and tool-call format, inline or on
    its pool by the prompt's length (see the module).

    Args:
        tokenizer: what encodes prompts (thread-safe: `ModelTokenizer`).
        tool_parser: the format tool calls are parsed in; None: tool_choice none only.
        inline_chars: prompts shorter than this are validated on the calling loop.
        workers: the pool's threads; 0: no pool, every prompt inline; None:
            `default_workers()`.
    """

    def __init__(self, tokenizer: PromptEncoder, tool_parser: ToolCallFormat | None,
                 inline_chars: int = INLINE_PROMPT_CHARS, workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.inline_chars = inline_chars
        workers = default_workers() if workers is None else workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="validate") \
            if workers > 0 else None

    async def __call__(self, raw: RawGenerateRequest, limits: RequestLimits
                       ) -> GenerateRequest:
        """The validated request. Raises ValidationError as `validate_request`."""
        return await self.offload(prompt_chars(raw.prompt), validate_request, raw, limits,
                                  self.tokenizer, self.tool_parser)

    async def offload(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, work that tokenizes `chars` characters of prompt: on the pool from
        `inline_chars` up (when there is a pool), else on the calling loop. Its result, or
        its exception. For work whose cost is the tokenizer's encode (which releases the
        interpreter lock), such as the Tokenize call's."""
        if self._pool is None or chars < self.inline_chars:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Stop the pool; validations under way finish, queued ones are dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
