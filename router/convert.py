"""Public protos <-> the router's domain objects. The only router module (with the
servicer) that imports `stagemesh.v1` protos."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from foundation.sampling_params import SamplingParams
from foundation.structured_output import ConstraintKind, StructuredOutput
from protos.stagemesh.v1 import inference_pb2 as pb
from router.outputs import ChoiceDelta, RequestTiming, TokenLogprob, Usage
from router.requests import (
    BeamSearchParams,
    ChatMessage,
    ChatPrompt,
    EarlyStopping,
    PromptInput,
    RawGenerateRequest,
    TextPrompt,
    TokenPrompt,
)
from router.scheduler import FinishReason
from router.tool_calls.types import ToolCall, ToolChoice, ToolChoiceMode, ToolSpec
from router.validation import ValidationError

_EARLY_STOPPING = {pb.BEAM_EARLY_STOPPING_UNSPECIFIED: EarlyStopping.HEURISTIC,
                   pb.BEAM_EARLY_STOPPING_FINISHED: EarlyStopping.FINISHED,
                   pb.BEAM_EARLY_STOPPING_NEVER: EarlyStopping.NEVER}
_TOOL_CHOICE = {pb.TOOL_CHOICE_MODE_NONE: ToolChoiceMode.NONE,
                pb.TOOL_CHOICE_MODE_AUTO: ToolChoiceMode.AUTO,
                pb.TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode.REQUIRED}
# The one table between the router's finish reasons and the public API's.
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, FinishReason.STOP: pb.FINISH_REASON_STOP,
           FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.ABORT: pb.FINISH_REASON_ABORT}


def _opt(msg: object, name: str, default: object) -> object:
    return getattr(msg, name) if msg.HasField(name) else default  # type: ignore[attr-defined]


def sampling_from_proto(msg: pb.SamplingParams, logprobs: int | None) -> SamplingParams:
    seed = msg.seed if msg.HasField("seed") else None
    return SamplingParams(
        temperature=float(_opt(msg, "temperature", 1.0)),  # type: ignore[arg-type]
        top_p=float(_opt(msg, "top_p", 1.0)),  # type: ignore[arg-type]
        top_k=int(_opt(msg, "top_k", -1)),  # type: ignore[call-overload]
        min_p=float(_opt(msg, "min_p", 0.0)),  # type: ignore[arg-type]
        repetition_penalty=float(_opt(msg, "repetition_penalty", 1.0)),  # type: ignore[arg-type]
        presence_penalty=float(_opt(msg, "presence_penalty", 0.0)),  # type: ignore[arg-type]
        frequency_penalty=float(_opt(msg, "frequency_penalty", 0.0)),  # type: ignore[arg-type]
        seed=seed, logprobs=logprobs,
        min_tokens=msg.min_tokens if msg.HasField("min_tokens") else 0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        structured=structured_from_proto(msg.structured_output)
        if msg.HasField("structured_output") else None,
    )


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValidationError("structured_output", "structured_output must set one constraint "
                              "(json_object, json_schema, regex, choice or grammar)")
    if kind == "json_object":
        if not msg.json_object:
            raise ValidationError("structured_output.json_object",
                                  "structured_output.json_object must be true when set")
        return StructuredOutput(ConstraintKind.JSON_OBJECT)
    if kind == "choice":
        return StructuredOutput.choice(list(msg.choice.options))
    return StructuredOutput(ConstraintKind(kind), getattr(msg, kind))


def prompt_from_proto(msg: pb.GenerateRequest | pb.TokenizeRequest) -> PromptInput:
    kind = msg.WhichOneof("input")
    if kind == "text":
        return TextPrompt(msg.text)
    if kind == "token_ids":
        assert isinstance(msg, pb.GenerateRequest)
        return TokenPrompt(tuple(msg.token_ids.ids))
    if kind == "chat":
        return ChatPrompt(tuple(_message_from_proto(m) for m in msg.chat.messages),
                          tuple(ToolSpec(t.name, t.description, t.parameters)
                                for t in msg.chat.tools))
    raise ValidationError("input", "input must be one of text, token_ids or chat; none was given")


def _message_from_proto(m: pb.ChatMessage) -> ChatMessage:
    return ChatMessage(m.role, m.content,
                       tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                       m.tool_call_id, m.name)


def tool_choice_from_proto(msg: pb.ToolChoice) -> ToolChoice | None:
    """None: unset (auto with tools, none without)."""
    if msg.WhichOneof("choice") == "function":
        return ToolChoice(ToolChoiceMode.REQUIRED, msg.function)
    if msg.mode == pb.TOOL_CHOICE_MODE_UNSPECIFIED:
        return None
    if msg.mode not in _TOOL_CHOICE:
        raise ValidationError("tool_choice.mode", f"tool_choice.mode is not a ToolChoiceMode "
                                                  f"value: {msg.mode}")
    return ToolChoice(_TOOL_CHOICE[msg.mode])


def add_tool_call_deltas(calls: Any, deltas: Sequence[pb.ToolCallDelta]) -> None:
    """Append streamed tool-call pieces to `calls` (a repeated ToolCall field): a piece with
    an id or name starts call `index`, later pieces extend its arguments."""
    for d in deltas:
        while len(calls) <= d.index:
            calls.add()
        call = calls[d.index]
        if d.id or d.name:
            call.id, call.name = d.id, d.name
        call.arguments += d.arguments


def beam_from_proto(msg: pb.BeamSearch) -> BeamSearchParams:
    if msg.early_stopping not in _EARLY_STOPPING:
        raise ValidationError("beam_search.early_stopping", "beam_search.early_stopping is "
                              f"not a BeamEarlyStopping value: {msg.early_stopping}")
    return BeamSearchParams(
        width=msg.beam_width if msg.HasField("beam_width") else None,
        length_penalty=msg.length_penalty if msg.HasField("length_penalty") else 1.0,
        early_stopping=_EARLY_STOPPING[msg.early_stopping])


def generate_from_proto(msg: pb.GenerateRequest) -> RawGenerateRequest:
    logprobs = msg.logprobs if msg.HasField("logprobs") else None
    if logprobs is not None and logprobs < 0:
        raise ValidationError("logprobs", f"logprobs must be >= 0, got {logprobs}")
    sampling = sampling_from_proto(msg.sampling, logprobs)
    if msg.HasField("prompt_logprobs"):  # its range is checked with the other settings
        sampling = replace(sampling, prompt_logprobs=msg.prompt_logprobs)
    beam = beam_from_proto(msg.beam_search) if msg.HasField("beam_search") else None
    if beam is not None and not msg.sampling.HasField("temperature"):
        sampling = replace(sampling, temperature=0.0)  # unset means 0 with beam search
    return RawGenerateRequest(
        request_id=msg.request_id or f"req-{uuid.uuid4().hex[:16]}",
        prompt=prompt_from_proto(msg),
        sampling=sampling,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        n=msg.n if msg.HasField("n") else 1,
        priority=msg.priority,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=(msg.skip_special_tokens if msg.HasField("skip_special_tokens")
                             else True),
        truncate_prompt_tokens=(msg.truncate_prompt_tokens
                                if msg.HasField("truncate_prompt_tokens") else None),
        beam=beam,
        tool_choice=(tool_choice_from_proto(msg.tool_choice)
                     if msg.HasField("tool_choice") else None),
        parallel_tool_calls=(msg.parallel_tool_calls if msg.HasField("parallel_tool_calls")
                             else True),
    )


def delta_to_proto(request_id: str, delta: ChoiceDelta) -> pb.GenerateResponse:
    if delta.tool_calls or delta.called_tools:  # rare: off the per-token path
        out = delta_to_proto(request_id, replace(delta, tool_calls=(), called_tools=False))
        out.tool_calls.extend(pb.ToolCallDelta(index=d.index, id=d.id, name=d.name,
                                               arguments=d.arguments)
                              for d in delta.tool_calls)
        if delta.called_tools:
            out.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        return out
    if delta.beam_score is not None:  # a beam search's hypothesis, whole
        out = _delta_to_proto(request_id, delta)
        out.beam_score = delta.beam_score
        return out
    if delta.stop_reason is not None:  # a choice's last update: the stop string or id
        out = _delta_to_proto(request_id, delta)
        if isinstance(delta.stop_reason, str):
            out.stop_string = delta.stop_reason
        else:
            out.stop_token_id = delta.stop_reason
        return out
    return _delta_to_proto(request_id, delta)


def logprobs_to_proto(entries: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in entries]


def _delta_to_proto(request_id: str, delta: ChoiceDelta) -> pb.GenerateResponse:
    if not delta.logprobs:  # the common case, once per token per stream
        return pb.GenerateResponse(request_id=request_id, index=delta.index, text=delta.text,
                                   token_ids=delta.token_ids,
                                   finish_reason=_FINISH[delta.finish_reason])
    logprobs = [
        pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
        for lp in delta.logprobs
    ]
    return pb.GenerateResponse(request_id=request_id, index=delta.index, text=delta.text,
                               token_ids=delta.token_ids, logprobs=logprobs,
                               finish_reason=_FINISH[delta.finish_reason])


def usage_to_proto(request_id: str, usage: Usage,
                   timing: RequestTiming | None = None) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=request_id, usage=pb.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens))
    if timing is not None:
        out.timing.queue_ms = timing.queue_s * 1e3
        out.timing.prefill_ms = timing.prefill_s * 1e3
        out.timing.decode_ms = timing.decode_s * 1e3
    return out
