"""Run-ahead inputs: the tokens the last stage sampled, as the first stage keeps them.

A plan may give a sequence's one input as "the token the last stage sampled for it at step
k" (`StageCachedSeq.input_from_step`), so the router need not wait for step k's result
before sending the plan that continues the sequence. The first stage takes that token from
the data plane, never from the router:

- one stage (first == last): from its own step k, which it puts here as soon as the sampling
  is queued on the device, the ids still there (`StepTokens.device_ids`; the host values
  may not exist yet);
- P > 1 stages: over the feedback link. After every step it runs, sampling or not, the last
  stage sends one data-plane message on it: header step id = the step, two int64 tensors
  `seq_ids [S]` and `token_ids [S]` (the sampling sequences in batch order; S may be 0). The
  first stage's step thread reads the link itself (`FeedbackInbox`), with no thread of its
  own: a take whose step is missing reads messages until it comes, and a step that took
  nothing takes in what has arrived without waiting (`FeedbackStore.settle`), so a link no
  plan reads from never fills and the last stage never blocks on it. On a machine of few
  cores a thread that wakes for each message and wakes the step thread in turn costs a
  step more than the read (docs/BENCHMARKS.md, W6).

The store keeps the newest `FEEDBACK_STEPS_KEPT` steps. Steps arrive in step order, so a
step that is missing while a later one is here never will arrive. A plan naming a step whose
tokens do not come within the step timeout fails, naming both steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from stage_worker.dataplane import LinkClosedError, Transport, TransportError, TransportTimeout
from stage_worker.host_transfer import host_tensor, to_device, upload

log = logging.getLogger("stagemesh.stage")

FEEDBACK_STEPS_KEPT = 1024  # >> the 2P steps a router with run-ahead keeps outstanding


class FeedbackMissingError(RuntimeError):
    """A run-ahead input whose tokens did not come (in time, or at all)."""


@dataclass(frozen=True)
class StepTokens:
    """The tokens the last stage sampled at one step.

    seq_ids / token_ids: aligned, batch order of the step's sampling sequences; token_ids is
        None while the tokens are only on the device (one-stage pipeline).
    device_ids: [S] int64, the same tokens on the sampling device (one-stage pipeline), or
        None (they came over the feedback link).
    """

    step_id: int
    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...] | None
    device_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.token_ids is None:
            if self.device_ids is None:
                raise ValueError(f"step {self.step_id}: tokens neither on the host nor on "
                                 "the device")
        elif len(self.seq_ids) != len(self.token_ids):
            raise ValueError(f"step {self.step_id}: {len(self.seq_ids)} sequences, "
                             f"{len(self.token_ids)} tokens")

    # Built on first use: a step whose sequences are the ones sampled, in order (the usual
    # decode step, `FeedbackStore.take_aligned`), reads the tokens as they came.
    @cached_property
    def rows(self) -> dict[int, int]:
        """seq_id -> its row."""
        return dict(zip(self.seq_ids, range(len(self.seq_ids)), strict=True))

    @cached_property
    def by_seq(self) -> dict[int, int] | None:
        """seq_id -> its token; None while the tokens are only on the device."""
        if self.token_ids is None:
            return None
        return dict(zip(self.seq_ids, self.token_ids, strict=True))

    @classmethod
    def from_message(cls, step_id: int, columns: Sequence[Sequence[int]]) -> StepTokens:
        """A feedback-link message (`Transport.recv_ints`). Raises ValueError unless it is
        two vectors of one length."""
        if len(columns) != 2 or len(columns[0]) != len(columns[1]):
            raise ValueError(f"feedback of step {step_id} must be seq_ids [S] and token_ids "
                             f"[S]; got {len(columns)} vector(s) of length(s) "
                             f"{[len(c) for c in columns]}")
        return cls(step_id, tuple(columns[0]), tuple(columns[1]))


class FeedbackStore:
    """Tokens of recent steps by step id. The step thread puts (one stage) or receives them
    from the feedback link (`attach`: the first stage of several) and takes them; any thread
    may break a wait, clear or attach."""

    def __init__(self, keep: int = FEEDBACK_STEPS_KEPT) -> None:
        self._keep = keep
        self._steps: OrderedDict[int, StepTokens] = OrderedDict()
        self._newest = -1
        self._broken: str | None = None
        self._cond = threading.Condition()
        self._inbox: FeedbackInbox | None = None  # the feedback link's end, once linked
        self._generation = 0  # bumped by `attach` and `clear`: what was read before is void
        self._took = False  # a take since the last `settle`

    def put(self, tokens: StepTokens) -> None:
        """Keep `tokens` (dropping the oldest step beyond the limit) and wake waiters."""
        with self._cond:
            self._keep_locked(tokens)
            self._cond.notify_all()

    def _keep_locked(self, tokens: StepTokens) -> None:
        self._steps[tokens.step_id] = tokens
        self._newest = max(self._newest, tokens.step_id)
        while len(self._steps) > self._keep:
            self._steps.popitem(last=False)

    def attach(self, inbox: FeedbackInbox) -> None:
        """Receive from `inbox` from now on (a new link): the store starts empty, and a
        take waiting without a link reads this one."""
        with self._cond:
            self._inbox = inbox
            self._forget()
            self._cond.notify_all()

    def settle(self, timeout_s: float) -> None:
        """The first stage, after each step: if no take since the last call read the link,
        take in the messages that have arrived, without waiting for more (`timeout_s`
        bounds the rest of one that has begun to arrive). No plan may read the link for a
        while (run-ahead off, prefills), and the last stage must never block on it."""
        if self._took:
            self._took = False
            return
        inbox, generation = self._inbox, self._generation
        while inbox is not None and inbox.ready():
            if not self._take_in(inbox, generation, timeout_s):
                return

    def _take_in(self, inbox: FeedbackInbox, generation: int, timeout_s: float) -> bool:
        """The lock not held: `inbox`'s next message, waited for up to `timeout_s`, kept;
        False when none came, the link failed, or a re-link since `generation` (read with
        `inbox`) voided it (the old link's steps are gone)."""
        tokens = inbox.receive(timeout_s)
        if tokens is None:
            return False
        with self._cond:
            if generation != self._generation:
                return False
            self._keep_locked(tokens)
        return True

    def break_with(self, reason: str) -> None:
        """The feedback link failed: waiters fail now with `reason`."""
        with self._cond:
            self._broken = reason
            self._cond.notify_all()

    def clear(self) -> None:
        """Forget every step (a new Run stream or a new link)."""
        with self._cond:
            self._forget()

    def _forget(self) -> None:
        self._steps.clear()
        self._newest = -1
        self._broken = None
        self._generation += 1

    def get(self, step_id: int) -> StepTokens | None:
        with self._cond:
            return self._steps.get(step_id)

    def take(self, step_id: int, wants: Iterable[tuple[int, int]],
             timeout_s: float) -> dict[int, int]:
        """seq_id -> token for every (seq_id, sampled at step) that step `step_id` names,
        waiting up to `timeout_s` for steps not here yet.

        Raises:
            FeedbackMissingError: a named step did not come in time, was skipped (a later
                one came), was dropped as too old, or lacks the sequence; or the link broke.
        """
        deadline = time.monotonic() + timeout_s
        fed: dict[int, int] = {}
        taken_from = -1  # the step looked up last (most wants share one), and its tokens
        sampled: dict[int, int] | None = None
        with self._cond:
            for seq_id, k in wants:
                if k != taken_from:
                    sampled = self._wait(step_id, k, deadline, timeout_s).by_seq
                    taken_from = k
                token = None if sampled is None else sampled.get(seq_id)
                if token is None:
                    raise FeedbackMissingError(
                        f"step {step_id}: sequence {seq_id} takes its input from step {k}, "
                        f"which sampled no token for it")
                fed[seq_id] = token
        return fed

    def take_aligned(self, step_id: int, seq_ids: tuple[int, ...], steps: tuple[int, ...],
                     timeout_s: float) -> tuple[int, ...]:
        """`take`'s tokens in `seq_ids` order (`steps[i]` sampled `seq_ids[i]`). When one
        step sampled exactly these sequences in this order (a micro-batch's decodes, the
        usual step), its tokens as they came, without a look-up per sequence.

        Raises:
            FeedbackMissingError: as `take`.
        """
        if seq_ids and steps.count(steps[0]) == len(steps):
            with self._cond:
                tokens = self._wait(step_id, steps[0], time.monotonic() + timeout_s, timeout_s)
            if tokens.seq_ids == seq_ids and tokens.token_ids is not None:
                return tokens.token_ids
        fed = self.take(step_id, zip(seq_ids, steps, strict=True), timeout_s)
        return tuple(map(fed.__getitem__, seq_ids))

    def _wait(self, step_id: int, k: int, deadline: float, timeout_s: float) -> StepTokens:
        """Step k's tokens (the lock held), reading the feedback link while they are not
        here."""
        self._took = True
        while (tokens := self._steps.get(k)) is None:
            where = f"step {step_id}: the tokens sampled at step {k}"
            if self._broken is not None:
                raise FeedbackMissingError(f"{where} cannot come: {self._broken}")
            if self._newest > k:
                raise FeedbackMissingError(f"{where} never came or were dropped (the "
                                           f"newest step received is {self._newest})")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FeedbackMissingError(f"{where} did not arrive from the last stage "
                                           f"within {timeout_s:g}s")
            inbox, generation = self._inbox, self._generation  # one link's, read locked
            if inbox is None:  # not linked yet: `attach` wakes this wait
                self._cond.wait(remaining)
                continue
            self._cond.release()  # the link is read unlocked: `break_with` stays prompt
            try:
                self._take_in(inbox, generation, remaining)
            finally:
                self._cond.acquire()
        return tokens


def device_inputs(input_ids: Sequence[int], ahead: Sequence[tuple[int, int, int]],
                  store: FeedbackStore, device: torch.device) -> torch.Tensor:
    """A one-stage pipeline's input ids [T] on `device`: `input_ids` with every run-ahead
    row (`ahead`: (row, seq_id, step) from `HeldSeqs.apply` or a lane) the token its step
    left on the device. A step whose every row is one, sampled at one step in the order
    it sampled them (steady decode), is a copy of that step's ids, with no upload; any
    other is uploaded and its run-ahead rows gathered (`gather_device_inputs`).
    Raises FeedbackMissingError as `gather_device_inputs`."""
    if ahead and len(ahead) == len(input_ids):
        rows, seq_ids, steps = zip(*ahead, strict=True)
        tokens = store.get(steps[0])
        if (tokens is not None and tokens.device_ids is not None
                and tokens.seq_ids == seq_ids and steps.count(steps[0]) == len(steps)
                and rows == tuple(range(len(rows)))):
            return tokens.device_ids.clone()
    inputs = upload(host_tensor(input_ids), device)
    if ahead:
        gather_device_inputs(inputs, ahead, store)
    return inputs


def gather_device_inputs(inputs: torch.Tensor, ahead: Sequence[tuple[int, int, int]],
                         store: FeedbackStore) -> None:
    """Overwrite the run-ahead rows of `inputs` [T] (int64, on the device) with the tokens
    their steps left on the device (a one-stage pipeline's own samples), without a host
    round trip for the values. `ahead`: (row, seq_id, step) from `HeldSeqs.apply`.
    Raises FeedbackMissingError for a step that left no ids on the device."""
    by_step: dict[int, list[tuple[int, int]]] = {}
    for row, seq_id, k in ahead:
        by_step.setdefault(k, []).append((row, seq_id))
    for k, items in by_step.items():
        tokens = store.get(k)
        if tokens is None or tokens.device_ids is None:
            raise FeedbackMissingError(f"the tokens sampled at step {k} are not on the device")
        device = tokens.device_ids.device
        rows = to_device([row for row, _ in items], torch.int64, device)
        src = to_device([tokens.rows[seq_id] for _, seq_id in items], torch.int64, device)
        inputs.index_copy_(0, rows, tokens.device_ids.index_select(0, src))


class FeedbackInbox:
    """The first stage's end of the feedback link. No thread reads it: the store's taker
    does (`FeedbackStore.take`, `settle`), on the step thread."""

    def __init__(self, store: FeedbackStore) -> None:
        self.store = store
        self._link: Transport | None = None

    def attach(self, link: Transport) -> None:
        """Read `link` from now on (a new epoch's link replaces the old one, which the
        links close); the store starts empty."""
        self._link = link
        self.store.attach(self)

    def ready(self) -> bool:
        """Whether a message has begun to arrive (no wait)."""
        link = self._link
        return link is not None and link.readable()

    def receive(self, timeout_s: float) -> StepTokens | None:
        """The link's next message, waiting up to `timeout_s`; None when none came in time
        or the link failed (then the store is broken with the reason, so waiting takes
        fail, and the link is closed)."""
        link = self._link
        if link is None:
            return None
        try:
            step_id, columns = link.recv_ints(timeout_s=timeout_s)
            return StepTokens.from_message(step_id, columns)
        except TransportTimeout as e:
            if not e.link_closed:
                return None
            error: Exception = e
        except (TransportError, ValueError) as e:
            error = e
        if link is self._link:  # not replaced by a re-link: steps that wait must hear of it
            self.store.break_with(f"feedback link failed: {error}")
            if not isinstance(error, LinkClosedError):
                log.warning("feedback link failed: %s", error)
        link.close()
        return None
