"""The edge between OpenAI JSON and the router: a `GenerationSpec` becomes GenerateRequests
(through `router.client.build_request`), and router `Chunk`s become OpenAI responses.

Choice indices follow OpenAI: prompt p's choice i is index p * n + i. Usage sums all prompts.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.params import Endpoint, GenerationSpec
from gateway.tokens import TokenTexts
from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import Chunk, ToolCallPiece, build_request

LogprobEntry = tuple[int, float, tuple[tuple[int, float], ...]]  # (id, logprob, top)


def router_requests(spec: GenerationSpec, model: str, request_id: str
                    ) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt; ids are `request_id-<prompt index>`."""
    return [build_request(p.text, messages=p.messages, token_ids=p.token_ids, model=model,
                          request_id=f"{request_id}-{i}", **spec.options)
            for i, p in enumerate(spec.prompts)]


@dataclass(frozen=True)
class Delta:
    """New output of one choice, logprobs already in the endpoint's format."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: Any
    finish_reason: str | None
    first: bool
    stop_reason: str | int | None = None
    tool_calls: tuple[ToolCallPiece, ...] = ()  # (index, id, name, arguments)
    prompt_logprobs: list[Any] | None = None  # vLLM's, on a choice's first delta


@dataclass
class _Choice:
    """Everything one choice has produced so far. `chars`: characters of its text;
    `token_chars`: characters its tokens' bytes have completed (for `text_offset`)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id matched
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's, whole
    prompt_logprobs: list[Any] | None = None  # vLLM's format (`_vllm_prompt_logprobs`)
    chars: int = 0
    token_chars: int = 0
    utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class ResponseBuilder:
    """Turns the chunks of one HTTP request's router calls into OpenAI JSON, streamed
    (`stream_chunk` per delta, then `usage_chunk`) or whole (`response`)."""

    def __init__(self, spec: GenerationSpec, response_id: str, model: str, created: int,
                 texts: TokenTexts, echo: Sequence[str] = ()) -> None:
        """`echo`: with `spec.echo`, each prompt's text, put before its choices' text."""
        self.spec = spec
        self.chat = spec.endpoint is Endpoint.CHAT
        self.head = {"id": response_id, "object": "chat.completion.chunk" if self.chat
                     else "text_completion", "created": created, "model": model}
        self.texts = texts
        self.echo = echo
        self.choices: dict[int, _Choice] = {}
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self._prompt_tokens: dict[int, int] = {}  # prompt -> its length, from its first chunk
        # prompt -> (its token ids, their log probabilities), from its first chunk
        self._prompt_scores: dict[int, tuple[tuple[int, ...], tuple[LogprobEntry, ...]]] = {}
        self._usages = 0  # prompts whose usage arrived

    def delta(self, prompt: int, chunk: Chunk) -> Delta | None:
        """Account one chunk of prompt `prompt`'s call; None for the usage chunk."""
        if chunk.usage is not None:
            for key in self.usage:
                src = "cached_prompt_tokens" if key == "cached_tokens" else key
                self.usage[key] += chunk.usage.get(src, 0)
            self._usages += 1
            return None
        if chunk.prompt_tokens:
            self._prompt_tokens[prompt] = chunk.prompt_tokens
        if chunk.prompt_token_ids:
            self._prompt_scores[prompt] = (chunk.prompt_token_ids, chunk.prompt_logprobs)
        index = prompt * self.spec.n + chunk.index
        first = index not in self.choices
        choice = self.choices.setdefault(index, _Choice())
        scores = self._prompt_scores.get(prompt) if first else None
        if scores is not None and self.spec.prompt_logprobs is not None:
            choice.prompt_logprobs = self._vllm_prompt_logprobs(*scores)
        echo = self.echo[prompt] if first and self.echo else ""
        if echo:  # the generated text (and its tokens' offsets) start after the prompt's
            choice.chars = choice.token_chars = len(echo)
        logprobs = None
        if self.spec.logprobs is not None:
            logprobs = (self._chat_logprobs(chunk.logprobs) if self.chat
                        else self._completion_logprobs(choice, chunk))
            if echo and scores is not None:  # the prompt's tokens first
                logprobs = self._echo_logprobs(*scores, logprobs)
            for key, values in logprobs.items():
                choice.logprobs.setdefault(key, []).extend(values)
        choice.chars += len(chunk.text)
        if echo:
            chunk = replace(chunk, text=echo + chunk.text)
        choice.text.append(chunk.text)
        choice.token_ids.extend(chunk.token_ids)
        choice.finish_reason = chunk.finish_reason or choice.finish_reason
        if chunk.stop_reason is not None:
            choice.stop_reason = chunk.stop_reason
        for call_index, call_id, name, arguments in chunk.tool_calls:
            if call_id or name:
                choice.tool_calls.append({"id": call_id, "type": "function",
                                          "function": {"name": name, "arguments": ""}})
            choice.tool_calls[call_index]["function"]["arguments"] += arguments
        return Delta(index, chunk.text, chunk.token_ids, logprobs, chunk.finish_reason, first,
                     chunk.stop_reason, chunk.tool_calls,
                     choice.prompt_logprobs if first else None)

    def _vllm_prompt_logprobs(self, token_ids: tuple[int, ...],
                              entries: tuple[LogprobEntry, ...]) -> list[Any]:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map
        of token id (as a string) -> {logprob, rank, decoded_token} holding the prompt's
        token and the top alternatives asked for (rank: 1 for the most likely; null for the
        prompt's token where it is not among the alternatives), trimmed to what this
        request asked (the router may have computed more for echo)."""
        k = self.spec.prompt_logprobs or 0
        out: list[Any] = [None] if token_ids else []
        for token_id, logprob, top in entries:
            alternatives = top[:k]
            ranks = {t: rank for rank, (t, _) in enumerate(alternatives, start=1)}
            position = {str(token_id): {"logprob": logprob, "rank": ranks.get(token_id),
                                        "decoded_token": self.texts.get(token_id)[0]}}
            for t, value in alternatives:
                position.setdefault(str(t), {"logprob": value, "rank": ranks[t],
                                             "decoded_token": self.texts.get(t)[0]})
            out.append(position)
        return out

    def _echo_logprobs(self, token_ids: tuple[int, ...],
                       entries: tuple[LogprobEntry, ...], generated: dict[str, list[Any]]
                       ) -> dict[str, list[Any]]:
        """OpenAI's legacy logprobs with echo: the prompt's tokens first (the first with no
        log probability), then the generated ones (`generated`, whose text offsets start
        after the prompt's text). The prompt tokens' offsets count their decoded bytes."""
        k = self.spec.logprobs or 0
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        offset, decoder = 0, codecs.getincrementaldecoder("utf-8")("replace")
        scored = [(None, ())] + [(logprob, top) for _, logprob, top in entries]
        for token_id, (logprob, top) in zip(token_ids, scored, strict=False):
            text, raw = self.texts.get(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            if logprob is None:
                out["top_logprobs"].append(None)
            else:
                out["top_logprobs"].append(self._legacy_tops(text, logprob, top[:k]))
            out["text_offset"].append(offset)
            offset += len(decoder.decode(bytes(raw))) if raw is not None else len(text)
        for key in out:
            out[key] += generated.get(key, [])
        return out

    def _chat_logprobs(self, entries: tuple[LogprobEntry, ...]) -> dict[str, list[Any]]:
        content = []
        for token_id, logprob, top in entries:
            text, raw = self.texts.get(token_id)
            content.append({"token": text, "logprob": logprob, "bytes": raw,
                            "top_logprobs": [self._entry(i, v) for i, v in top]})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.texts.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def _completion_logprobs(self, choice: _Choice, chunk: Chunk) -> dict[str, list[Any]]:
        """OpenAI's legacy format. top_logprobs holds the top alternatives plus the sampled
        token (OpenAI: "up to logprobs + 1 elements"). text_offset is where each token's
        text starts in the choice's text, in characters: counted from the token's bytes
        when a tokenizer is known, else the start of the chunk's text."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for token_id, logprob, top in chunk.logprobs:
            text, raw = self.texts.get(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(self._legacy_tops(text, logprob, top))
            out["text_offset"].append(choice.token_chars if raw is not None else choice.chars)
            if raw is not None:
                choice.token_chars += len(choice.utf8.decode(bytes(raw)))
        return out

    def _legacy_tops(self, text: str, logprob: float,
                     top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        """OpenAI's legacy `top_logprobs` entry: the alternatives' texts, plus the token's
        own (OpenAI: "up to logprobs + 1 elements")."""
        tops = {self.texts.get(i)[0]: v for i, v in top}
        tops.setdefault(text, logprob)
        return tops

    def stream_chunks(self, d: Delta) -> list[dict[str, Any]]:
        """The SSE chunks for a delta: `stream_chunk`'s, and with tool calls one more chunk
        per call piece (OpenAI's `delta.tool_calls`: a call's first chunk has its index, id,
        type and name with empty arguments, later ones argument text), the finish on the
        last."""
        if not d.tool_calls:
            chunk = self.stream_chunk(d)
            return [] if chunk is None else [chunk]
        head = self.stream_chunk(replace(d, finish_reason=None, stop_reason=None,
                                         tool_calls=()))
        out = [] if head is None else [head]
        for k, (index, call_id, name, arguments) in enumerate(d.tool_calls):
            call: dict[str, Any] = {"index": index}
            if call_id or name:
                call.update(id=call_id, type="function",
                            function={"name": name, "arguments": arguments})
            else:
                call["function"] = {"arguments": arguments}
            last = k == len(d.tool_calls) - 1
            choice: dict[str, Any] = {"index": d.index, "delta": {"tool_calls": [call]},
                                      "logprobs": None,
                                      "finish_reason": d.finish_reason if last else None}
            if last and d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            out.append(self._chunk_body(choice))
        return out

    def stream_chunk(self, d: Delta) -> dict[str, Any] | None:
        """The SSE chunk for a delta, or None when it carries nothing a client would see."""
        if not (d.text or d.finish_reason or d.logprobs or (self.chat and d.first)
                or (self.spec.return_token_ids and d.token_ids)
                or d.prompt_logprobs is not None):
            return None
        choice: dict[str, Any] = {"index": d.index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if d.first else {}
            if d.text or d.first:
                delta["content"] = d.text
            choice["delta"] = delta
        else:
            choice["text"] = d.text
        choice["logprobs"] = d.logprobs
        choice["finish_reason"] = d.finish_reason
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_reason
        if self.spec.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        if d.prompt_logprobs is not None and not self.chat:
            choice["prompt_logprobs"] = d.prompt_logprobs
        body = self._chunk_body(choice)
        if d.prompt_logprobs is not None and self.chat:  # vLLM's chat: on the response
            body["prompt_logprobs"] = d.prompt_logprobs
        return body

    def _chunk_body(self, choice: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.spec.continuous_usage:  # vLLM's: the counts so far on every chunk
            body["usage"] = self.usage_json(running=True)
        elif self.spec.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def usage_json(self, running: bool = False) -> dict[str, int | dict[str, int]]:
        """The call's usage; `running`: while streaming, from the prompts' lengths and the
        token ids received so far (the routers' usage replaces it at the end)."""
        u = self.usage
        if running and self._usages < len(self.spec.prompts):
            prompt = sum(self._prompt_tokens.values())
            done = sum(len(c.token_ids) for c in self.choices.values())
            return {"prompt_tokens": prompt, "completion_tokens": done,
                    "total_tokens": prompt + done}
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": self.usage_json()}

    def response(self) -> dict[str, Any]:
        """The whole (non-streamed) response from every accumulated delta."""
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            text = "".join(c.text)
            out: dict[str, Any] = {"index": index}
            if self.chat:
                out["message"] = {"role": "assistant", "content": text}
                if c.tool_calls:  # OpenAI: content null when the answer is only calls
                    out["message"] = {"role": "assistant", "content": text or None,
                                      "tool_calls": c.tool_calls}
            else:
                out["text"] = text
            out["logprobs"] = c.logprobs if self.spec.logprobs is not None else None
            out["finish_reason"] = c.finish_reason
            out["stop_reason"] = c.stop_reason
            if self.spec.return_token_ids:
                out["token_ids"] = c.token_ids
            if self.spec.prompt_logprobs is not None and not self.chat:
                out["prompt_logprobs"] = c.prompt_logprobs
            choices.append(out)
        obj = "chat.completion" if self.chat else "text_completion"
        body: dict[str, Any] = {**self.head, "object": obj, "choices": choices,
                                "usage": self.usage_json()}
        if self.spec.prompt_logprobs is not None and self.chat:  # vLLM's: one per response
            body["prompt_logprobs"] = next(
                (c.prompt_logprobs for c in self.choices.values()), None)
        return body
