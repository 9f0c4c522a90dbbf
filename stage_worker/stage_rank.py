"""One TP rank's part of a stage, and the one step routine every rank runs.

The leader (TP rank 0, `leader.py`) checks a plan, receives the step's activations from
upstream, fans the plan out to the other ranks (`tp_fanout.py`), then calls `StageRank.step`;
ranks 1..T-1 (`tp_rank.py`) call the same `step` with each plan they receive. Only rank 0
then sends the output downstream or samples (`StageRank.sample`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from stage_worker.feedback import FeedbackStore, device_inputs
from stage_worker.held_seqs import HeldSeqs, LaneAhead
from stage_worker.host_transfer import host_tensor, upload, write_ints
from stage_worker.lanes import Lane, Lanes
from stage_worker.model_runner import InputFill, ModelRunner
from stage_worker.parallel import TPGroup
from stage_worker.plan import PlanError, PromptLogprobs, StagePlan
from stage_worker.plan_check import StepLimits, check_plan
from stage_worker.step_input import SeqChunk
from stage_worker.step_sampling import StepSample, score_prompts

# A step's run-ahead tokens, taken late (see `StageRank.step`): called with the seq_ids of
# the run-ahead inputs and the steps that sampled them (aligned), returns their tokens in
# that order.
LateInputs = Callable[[tuple[int, ...], tuple[int, ...]], Sequence[int]]


class StageRank:
    """The sequences this rank holds, its model runner and its TP group.

    `num_blocks`: the stage's pool size, agreed by its ranks (the smallest any rank fits);
    block ids in plans are checked against it.
    """

    def __init__(self, runner: ModelRunner, tp: TPGroup, num_blocks: int) -> None:
        self.runner = runner
        self.tp = tp
        self.shape = runner.shape
        layers = self.shape.layers
        self.is_first, self.is_last = layers.is_first, layers.is_last
        self.held = HeldSeqs(keep_tokens=self.is_first or self.is_last,
                             builds_inputs=self.is_first)
        cap = runner.capacity
        self.last_step_id = -1  # the last plan checked on this Run stream
        self.limits = StepLimits(cap.max_num_batched_tokens, cap.max_num_seqs, num_blocks,
                                 cap.block_size)
        # Steady decode continued in columns (see `lanes`): where a plan is checked and
        # applied in one place (TP size 1). A one-stage pipeline's run-ahead inputs are
        # on the device.
        self.lanes = Lanes(self.held, cap.block_size, num_blocks, knows_samples=self.is_last,
                           enabled=tp.size == 1, on_device=self.is_first and self.is_last)
        self._continued: tuple[StagePlan, Lane, bool] | None = None  # checked, not applied
        self._lane_ids: dict[int, torch.Tensor] = {}  # a CPU stage's kept input ids, by size

    def check(self, plan: StagePlan) -> None:
        """Raise PlanError unless the stage can run `plan` (see `plan_check.check_plan`), or
        when its step id does not follow the previous plan's (ids increase along a Run
        stream: a repeated or older id is a confused or replaying peer). The leader calls it
        before any rank sees the plan."""
        if plan.step_id <= self.last_step_id:
            raise PlanError(f"step {plan.step_id} after step {self.last_step_id}: the step "
                            "ids of a Run stream must increase")
        lane = self.lanes.match(plan)
        if lane is None:
            check_plan(plan, self.held.seqs, self.limits, needs_tokens=self.is_first,
                       knows_samples=self.is_last)
        # A one-stage pipeline leaves only the step before this one unresolved (`step`'s
        # `deferred`): a lane of an older step has its tokens recorded.
        self._continued = (None if lane is None
                           else (plan, lane, lane.step_id == self.last_step_id))
        self.last_step_id = plan.step_id

    def continues_lane(self, plan: StagePlan) -> bool:
        """Whether `check` found that `plan` continues a lane (`step` applies it so)."""
        return self._continued is not None and self._continued[0] is plan

    def step(self, plan: StagePlan, upstream: torch.Tensor | None,
             fed: Mapping[int, int] | None = None, on_device: FeedbackStore | None = None,
             deferred: bool = False, late: LateInputs | None = None
             ) -> tuple[list[SeqChunk], torch.Tensor | None]:
        """Apply a checked plan and compute it: the same call on every TP rank.

        Frees, new sequences and diffs are applied, KV blocks copied, then the runner
        executes. `upstream`: on rank 0 of a non-first stage, the step's activations
        [T, H] received from the upstream stage; None elsewhere (the first stage embeds its
        token ids; other ranks get rank 0's activations through the TP group here).
        `fed`: the run-ahead inputs the leader resolved (seq_id -> token), appended to the
        histories. `on_device`: rank 0 of a one-stage pipeline, where the run-ahead inputs
        are read from the sampled ids its earlier steps left on the device; with `deferred`,
        the ones missing from `fed` were sampled by a step not resolved yet (see
        `HeldSeqs.apply`).
        `late`: rank 0 of the first stage of several at TP size 1, whose run-ahead inputs
        come from the last stage: they are left out of the histories (placeholders, as with
        `deferred`) and asked of `late` once the step's host work is done, then written
        into the step's token ids and the histories just before its first kernel
        (`ModelRunner.execute`'s `fill`), so the wait for the last stage's
        tokens is the only host work between that stage's step and this one on the GPU.
        Returns the step's chunks (batch order) and the runner's output (hidden states
        [T, H], or the last stage's scores), None when the plan computes nothing.
        """
        continued, self._continued = self._continued, None
        if continued is not None and continued[0] is plan:
            step = self.lanes.apply(continued[1], plan,
                                    (deferred and continued[2]) or late is not None)
        else:
            step = self.held.apply(plan, fed, deferred or late is not None)
            self.lanes.note(plan, step)
        if plan.block_copies:
            self.runner.copy_blocks(plan.block_copies)
        if not step.chunks:
            return step.chunks, None
        fill: InputFill | None = None
        if step.lane_ahead is not None:  # every row is written by the late fill
            assert late is not None, "a lane's run-ahead step takes its tokens late"
            inputs = self._lane_inputs(len(step.input_ids))
            fill = _lane_fill(step.lane_ahead, late)
        elif on_device is not None:  # a one-stage pipeline: run-ahead inputs on the device
            inputs = device_inputs(step.input_ids, step.ahead, on_device, self.shape.device)
        elif self.is_first:
            inputs = upload(host_tensor(step.input_ids), self.shape.device)
        else:
            inputs = self._share_activations(plan.num_tokens, upstream)
        if late is not None and step.ahead:
            ahead = step.ahead

            def fill(ids: torch.Tensor) -> None:
                rows, seq_ids, steps = zip(*ahead, strict=True)
                tokens = late(seq_ids, steps)
                if len(rows) == ids.shape[0]:  # every row (rows ascend from 0): a decode step
                    write_ints(ids, tokens)
                else:
                    packed = upload(host_tensor([*rows, *tokens]), ids.device)
                    ids.index_copy_(0, packed[:len(rows)], packed[len(rows):])
                self.held.fill_inputs(seq_ids, tokens)
        return step.chunks, self.runner.execute(step.chunks, inputs, fill)

    def _share_activations(self, num_tokens: int, upstream: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's `upstream` [T, H] on every rank (no collective at TP size 1)."""
        if self.tp.size == 1:
            assert upstream is not None, "rank 0 of a non-first stage needs its activations"
            return upstream
        shape = self.shape
        if self.tp.rank == 0:
            assert upstream is not None, "rank 0 of a non-first stage needs its activations"
            buf = upload(upstream, shape.device)
        else:
            buf = torch.empty(num_tokens, shape.hidden_size, dtype=shape.dtype,
                              device=shape.device)
        return self.tp.broadcast(buf)

    def _lane_inputs(self, n: int) -> torch.Tensor:
        """The input ids [n] of a lane's run-ahead step, every row written by the late fill.
        On a CPU stage, one kept tensor per size, written again every step: the runner reads
        it within the step, and nothing on a CPU holds it past that (a torch allocation after
        the stage's wait costs as much as the rest of the fill). On a GPU, a new one: the
        step's kernels read it after the host moved on."""
        device = self.shape.device
        if device.type != "cpu":
            return torch.empty(n, dtype=torch.int64, device=device)
        ids = self._lane_ids.get(n)
        if ids is None:
            ids = self._lane_ids[n] = torch.empty(n, dtype=torch.int64)
        return ids

    def sample(self, chunks: Sequence[SeqChunk], scores: torch.Tensor) -> StepSample:
        """Last stage, rank 0: pick a token for every sampling chunk (chunk order) from the
        scores `step` returned. The tokens' host copy is under way; the caller resolves it
        and records the tokens (`held.record_sampled`)."""
        held = self.held.seqs
        seqs = [held[c.seq_id] for c in chunks if c.sample]
        return self.runner.sample(seqs, scores[:len(seqs)])

    def prompt_logprobs(self, chunks: Sequence[SeqChunk], scores: torch.Tensor,
                        num_sampled: int) -> tuple[PromptLogprobs, ...]:
        """Last stage, rank 0: the prompt log probabilities of the step's chunks with
        `prompt_rows` (none asked: empty), from the rows of `scores` after its
        `num_sampled` sampling ones. Waits for the device when there are some."""
        if scores.shape[0] == num_sampled:
            return ()
        return score_prompts(scores[num_sampled:], chunks, self.held.seqs)

    def reset(self) -> int:
        """Forget every sequence and the last step id (the Run stream ended); returns how
        many sequences there were."""
        self.last_step_id = -1
        self._continued = None
        self.lanes.clear()
        return self.held.clear()


def _lane_fill(ahead: LaneAhead, late: LateInputs) -> InputFill:
    """The late fill of a lane's run-ahead step (`StepInputs.lane_ahead`): its tokens into
    every row of the step's input ids [S] and over each history's placeholder (a plain
    loop: Python 3.11 runs it three times faster than `map` over `list.__setitem__`)."""
    seq_ids, histories = ahead.seq_ids, ahead.histories
    steps = (ahead.step_id,) * len(seq_ids)

    def fill(ids: torch.Tensor) -> None:
        tokens = late(seq_ids, steps)
        write_ints(ids, tokens)
        for history, token in zip(histories, tokens, strict=True):
            history[-1] = token
    return fill
