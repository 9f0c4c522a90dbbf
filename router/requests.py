"""Domain objects of one generation request, independent of protos and HTTP.

The edges (gRPC servicer, HTTP gateway) parse their wire format into a `RawGenerateRequest`
(types already checked, values not), `router.validation.validate_request` turns it into a
`GenerateRequest` (every value in range, prompt tokenized) or raises `ValidationError`.
Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from foundation.sampling_params import SamplingParams
from router.tool_calls.parsers import ToolCallFormat
from router.tool_calls.types import ToolCall, ToolChoice, ToolSpec

DEFAULT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class TextPrompt:
    """A plain text prompt; tokenized with the model's BOS rule."""

    text: str


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt already tokenized by the client."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatMessage:
    """`tool_calls`: an assistant turn's calls; `tool_call_id` / `name`: a tool turn's call
    and function (both "" when unset)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages, rendered through the model's chat template with the generation
    prompt (the assistant's turn header) appended."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()  # given to the chat template as `tools`


PromptInput = TextPrompt | TokenPrompt | ChatPrompt


@dataclass(frozen=True)
class RequestLimits:
    """What the server accepts. One per served model, built at start-up.

    max_model_len: the model's context in tokens; prompt + max_tokens must fit in it.
    max_tokens_cap: the most tokens one request may ask to generate.
    max_n: the most choices (`n`) per request.
    max_logprobs: the most alternatives per token in `logprobs`.
    max_stop_sequences / max_stop_len: how many stop strings, and how many characters each;
        a long stop string makes the stop checker hold back that much streamed text.
    max_stop_token_ids: how many stop token ids.
    max_prompt_chars: characters of prompt text (or of all message contents), checked before
        tokenizing so a giant prompt is refused without tokenizer work.
    vocab_size: token ids must lie in [0, vocab_size).
    allowed_roles: chat message roles the chat template understands.
    """

    max_model_len: int
    vocab_size: int
    max_tokens_cap: int = 4096
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_len: int = 256
    max_stop_token_ids: int = 64
    max_prompt_chars: int = 1 << 20
    allowed_roles: tuple[str, ...] = DEFAULT_ROLES

    def __post_init__(self) -> None:
        for name in ("max_model_len", "vocab_size", "max_tokens_cap", "max_n",
                     "max_stop_len", "max_prompt_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"RequestLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_logprobs", "max_stop_sequences", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"RequestLimits.{name} must be >= 0, got {getattr(self, name)}")
        if not self.allowed_roles:
            raise ValueError("RequestLimits.allowed_roles must not be empty")

    @property
    def max_beam_width(self) -> int:
        """The widest beam search: each step asks for 2 x width log probabilities."""
        return min(self.max_n, self.max_logprobs // 2)


class EarlyStopping(Enum):
    """When a beam search stops before max_tokens (HF generate's `early_stopping`)."""

    HEURISTIC = "heuristic"  # HF's False: the best running beam, at its length, cannot win
    FINISHED = "finished"  # HF's True: as soon as beam_width hypotheses are finished
    NEVER = "never"  # HF's "never": no running beam could win even at max_tokens


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search instead of sampling (`router.beam_search`).

    width: beams kept per step; None (in a raw request) means the request's n.
    length_penalty: a finished hypothesis scores sum_logprobs / generated**length_penalty.
    """

    width: int | None = None
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = EarlyStopping.HEURISTIC


@dataclass(frozen=True)
class RawGenerateRequest:
    """A request as an edge parsed it: field types are right, values are unchecked.

    max_tokens None means "as many as fit": the remaining context, capped by
    `RequestLimits.max_tokens_cap` (vLLM's default).
    """

    request_id: str
    prompt: PromptInput
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens
    beam: BeamSearchParams | None = None  # beam search instead of sampling
    tool_choice: ToolChoice | None = None  # None: auto with tools, none without
    parallel_tool_calls: bool = True  # tool_choice required may force several calls


@dataclass(frozen=True)
class GenerateRequest:
    """A validated request: every value is in range for the `RequestLimits` it was checked
    against, and `len(prompt_token_ids) + max_tokens <= max_model_len`.

    stop: stop strings, matched on the detokenized output (`router.stop.StopChecker`).
    stop_token_ids: extra token ids that end the output (the token itself is not output);
        the model's EOS ids also do, unless `ignore_eos`.
    priority: lower runs first (vLLM's convention).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int
    priority: int
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    beam: BeamSearchParams | None = None  # with a width; n of its hypotheses are returned
    tool_format: ToolCallFormat | None = None  # tool calls are parsed out of the output
