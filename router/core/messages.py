"""The messages between the router's fronts and its engine core (msgpack, via msgspec).

Fronts send requests, finishes and aborts in; the core sends, once per step and per front,
one `StepOutputs` holding every token of that front's sequences as packed int64 arrays (no
per-token Python object crosses the channel). Everything else (refusals, failures, the
core's state, stats) is rare and small.

Sequence ids are allocated by the fronts (`front_id << SEQ_ID_FRONT_SHIFT | counter`), so a
front needs no round trip to name the sequences of a request, and the core routes a
sequence's tokens to the front that owns it by its id alone.
"""

from __future__ import annotations

from array import array
from collections import deque

import msgspec

from foundation.sampling_params import SamplingParams
from router.outputs import TokenLogprob
from router.requests import RequestLimits
from router.scheduler import FinishReason

SEQ_ID_FRONT_SHIFT = 40

# StepOutputs.finish codes: why the core ended a sequence with this token (0: it did not).
FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
NOT_LIVE = -1  # the core's own code for a token of a sequence no longer live (never sent)
FINISH_REASONS = {FINISH_STOP: FinishReason.STOP, FINISH_LENGTH: FinishReason.LENGTH}


def front_of(seq_id: int) -> int:
    """The front that allocated `seq_id`."""
    return seq_id >> SEQ_ID_FRONT_SHIFT


# --- front -> core ---------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True, array_like=True):
    """A front introduces itself: the first message on its stream to the core, which sends
    that front's messages back on the same stream."""

    front: int


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """One request: a sequence per choice (n > 1 shares the prompt's blocks).

    request_id: the client's id; the core refuses one that a live request of any front
    already has (`Refused` with status "already_exists"). stop_token_ids: tokens that end a
    choice (EOS included unless the request ignores it); max_tokens: tokens a choice may
    generate. The core applies both, so no token is planned past them; stop strings are the
    front's (it reports them with `FinishSeqs`). traceparent: the W3C trace context of the
    request's span when it is traced ("" otherwise): the step of its first prefill chunk is
    recorded by the stages under it.
    """

    request_id: str
    seq_ids: list[int]
    prompt: list[int]
    sampling: list[SamplingParams]
    priority: int
    max_tokens: int
    stop_token_ids: list[int]
    traceparent: str = ""


class FinishSeqs(msgspec.Struct, tag=True, array_like=True):
    """End sequences the front decided on: a stop string ("stop") or a cancel ("abort")."""

    seq_ids: list[int]
    reason: str


class StatsRequest(msgspec.Struct, tag=True, array_like=True):
    """`stage_timeout_s`: how long the core may wait for each stage's live Describe (the
    caller's remaining time, less the way back)."""

    front: int
    request_id: int
    stage_timeout_s: float = 2.0


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Drain the stages and exit (the router is stopping)."""


class FrontGone(msgspec.Struct, tag=True, array_like=True):
    """A front process ended (sent by the router, which supervises them): the core aborts
    that front's sequences, frees their blocks, and sends it nothing more. Front ids are never
    reused, so anything that front sent and that arrives later is dropped."""

    front: int


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    """Abort the live request `request_id`, whichever front runs it (the public Abort RPC):
    the core ends its sequences, tells the front that owns it (`Aborted`) and answers the
    asking one (`AbortResult`, by `reply_id`)."""

    front: int
    reply_id: int
    request_id: str


FrontMessage = (Hello | AddRequest | FinishSeqs | StatsRequest | Shutdown | FrontGone
                | AbortRequest)


def duplicate_request_message(request_id: str) -> str:
    """The refusal of a request whose id a live request already has (ALREADY_EXISTS)."""
    return (f"request_id {request_id!r} is already running; request ids must be unique "
            "among live requests")


# --- core -> front ---------------------------------------------------------------------------


class LogprobEntry(msgspec.Struct, array_like=True):
    seq_id: int
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class PromptLogprobEntry(msgspec.Struct, array_like=True):
    """Prompt log probabilities of one sequence from one step: entries[i] = (token id,
    logprob, top alternatives) of the prompt token at position start + i (>= 1)."""

    seq_id: int
    start: int
    entries: list[tuple[int, float, list[tuple[int, float]]]]


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """The tokens of one or more consecutive steps for one front's sequences, in step order
    (a sequence appears once per step: several times where the core sends the steps of one
    message of answers together).

    seq_ids / token_ids: packed int64 (`array("q")`), aligned; finish: packed int8, aligned,
    a FINISH_* code. logprobs: only for sequences that asked for them. cached: (seq_id,
    prompt tokens found in the prefix cache, when its first prefill chunk was planned, as
    time.time()) of sequences whose first prefill was planned. prompt_logprobs: the
    step's prompt log probabilities, for sequences that asked; a front applies them before
    the step's tokens.
    """

    seq_ids: bytes
    token_ids: bytes
    finish: bytes
    logprobs: list[LogprobEntry] = []
    cached: list[tuple[int, int, float]] = []
    prompt_logprobs: list[PromptLogprobEntry] = []

    def unpack(self) -> tuple[list[int], list[int], list[int]]:
        """(seq_ids, token_ids, finish codes) as Python lists."""
        seqs, tokens, finish = array("q"), array("q"), array("b")
        seqs.frombytes(self.seq_ids)
        tokens.frombytes(self.token_ids)
        finish.frombytes(self.finish)
        return seqs.tolist(), tokens.tolist(), finish.tolist()

    def logprob_queues(self) -> dict[int, deque[TokenLogprob]]:
        """seq_id -> its log probability records, in the order of its tokens here (see
        `next_logprob`)."""
        queues: dict[int, deque[TokenLogprob]] = {}
        for e in self.logprobs:
            queues.setdefault(e.seq_id, deque()).append(
                TokenLogprob(e.token_id, e.logprob, tuple(e.top)))
        return queues


def next_logprob(queues: dict[int, deque[TokenLogprob]], seq_id: int,
                 token: int) -> TokenLogprob | None:
    """The record of `seq_id`'s next token in `StepOutputs.logprob_queues`, if it is the
    one for `token` (None for a sequence that asked for none)."""
    queue = queues.get(seq_id)
    if not queue or queue[0].token_id != token:
        return None
    return queue.popleft()


class Refused(msgspec.Struct, tag=True, array_like=True):
    """A request the core did not admit. status: "resource_exhausted" (queue full; retry),
    "invalid_argument" (can never run) or "already_exists" (its request_id is live, on this
    front or another)."""

    seq_ids: list[int]
    status: str
    message: str


class Failed(msgspec.Struct, tag=True, array_like=True):
    """Sequences the core gave up on (a stage down past the recovery budget)."""

    seq_ids: list[int]
    message: str


class ServedInfo(msgspec.Struct, array_like=True):
    """What the stages' capacity implies for the public API."""

    limits: RequestLimits
    dtype: str
    tp_size: int
    num_stages: int
    block_size: int
    micro_batches: int = 1


class CoreState(msgspec.Struct, tag=True, array_like=True):
    """The core's state, sent at every change. `served` is set once the pipeline was up once;
    `error` is set when the core could not start (it exits after sending it), with `kind`
    "capacity" (a flag exceeds a stage) or "pipeline" (the stages never came up).
    `hop_transports`: the data-plane transport of each hop between stages ("tcp",
    "cuda_ipc"; P - 1, pipeline order) of the pipeline's latest linking (it may change when
    the pipeline comes back)."""

    ready: bool
    served: ServedInfo | None = None
    error: str = ""
    kind: str = ""
    hop_transports: list[str] = []


class StageStat(msgspec.Struct, array_like=True):
    """One stage's figures; `transport`: that of the hop to the next stage ("" for the
    last)."""

    stage: int
    ready: bool
    layer_start: int = 0
    layer_end: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_sequences: int = 0
    transport: str = ""
    device: str = ""
    steps: int = 0
    step_time_ms: float = 0.0
    bubble_fraction: float = 0.0


class CoreStats(msgspec.Struct, tag=True, array_like=True):
    """The core's counters, answered to the front that asked. requests_finished: requests
    of every front whose choices all ended with a stop or a length (not aborted or failed);
    finished_by_front: the same by front id (fronts that are gone included); fronts: the ids
    of the fronts the core serves now."""

    request_id: int
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    steps: int
    stages: list[StageStat]
    requests_finished: int = 0
    finished_by_front: dict[int, int] = {}
    fronts: list[int] = []


class Aborted(msgspec.Struct, tag=True, array_like=True):
    """Sequences the core aborted for an `AbortRequest`: their front ends them (finish
    abort, no FinishSeqs back) and, once none of its request is left, the request's stream."""

    seq_ids: list[int]


class AbortResult(msgspec.Struct, tag=True, array_like=True):
    """Whether the request of an `AbortRequest` was live (and is now aborted)."""

    reply_id: int
    found: bool


CoreMessage = StepOutputs | Refused | Failed | CoreState | CoreStats | Aborted | AbortResult


class FrontBatch:
    """One front's share of a step's outcome, being filled; `pack` makes its message."""

    __slots__ = ("finish", "logprobs", "prompt_logprobs", "seq_ids", "token_ids")

    def __init__(self) -> None:
        self.seq_ids: list[int] = []
        self.token_ids: list[int] = []
        self.finish: list[int] = []
        self.logprobs: list[LogprobEntry] = []
        self.prompt_logprobs: list[PromptLogprobEntry] = []

    def pack(self, cached: list[tuple[int, int, float]]) -> StepOutputs:
        return StepOutputs(array("q", self.seq_ids).tobytes(),
                           array("q", self.token_ids).tobytes(),
                           array("b", self.finish).tobytes(), self.logprobs, cached,
                           self.prompt_logprobs)


class FrontOutbox:
    """The core's outputs on their way to the fronts: each front's share of the steps
    answered since the last message of answers, and the prefix-cache hits not reported
    yet; `take` packs one `StepOutputs` per front."""

    def __init__(self) -> None:
        self._batches: dict[int, FrontBatch] = {}
        self._cached: dict[int, list[tuple[int, int, float]]] = {}  # front -> hits

    def batch(self, front: int) -> FrontBatch:
        batch = self._batches.get(front)
        if batch is None:
            batch = self._batches[front] = FrontBatch()
        return batch

    def add_tokens(self, seq_ids: list[int], tokens: list[int], codes: list[int]) -> None:
        """A step's new tokens (`tokens[i]` is `seq_ids[i]`'s) with their FINISH_* codes,
        each to its front's batch; a token coded NOT_LIVE is dropped. The usual step (one
        front's sequences, none ended) goes in three list extensions."""
        if (seq_ids and codes.count(FINISH_NONE) == len(codes)
                and front_of(min(seq_ids)) == front_of(max(seq_ids))):
            batch = self.batch(front_of(seq_ids[0]))
            batch.seq_ids += seq_ids
            batch.token_ids += tokens
            batch.finish += codes
            return
        for seq_id, token, code in zip(seq_ids, tokens, codes, strict=True):
            if code != NOT_LIVE:
                batch = self.batch(front_of(seq_id))
                batch.seq_ids.append(seq_id)
                batch.token_ids.append(token)
                batch.finish.append(code)

    def note_cached(self, front: int, hit: tuple[int, int, float]) -> None:
        """(seq_id, prompt tokens found cached, when its first prefill was planned), sent
        with the front's next tokens."""
        self._cached.setdefault(front, []).append(hit)

    def forget(self, front: int) -> None:
        self._batches.pop(front, None)
        self._cached.pop(front, None)

    def take(self) -> list[tuple[int, StepOutputs]]:
        batches, self._batches = self._batches, {}
        return [(front, batch.pack(self._cached.pop(front, [])))
                for front, batch in batches.items()]


class Codec:
    """Encoders and decoders for both directions (reuse one per socket: msgspec caches)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.front_decoder = msgspec.msgpack.Decoder(FrontMessage)
        self.core_decoder = msgspec.msgpack.Decoder(CoreMessage)
