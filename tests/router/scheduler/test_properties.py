"""Property tests: random add / step / finish / abort / preempt / fork (n > 1) sequences.

After every rule ``check_integrity()`` passes (blocks, queues, counts, in-flight records).
The fake pipeline asserts every KV slot it reads; at the end the scheduler drains, no block is
held, sequences that ran to their own end produced exactly the reference tokens, and the ones
cut short (finish or abort from outside) produced a prefix of them.
"""

from __future__ import annotations

from collections import deque

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.scheduler import AdmissionRefusedError, ChoiceSpec, FinishReason, StepPlan
from tests.router.scheduler.driver import EOS, VOCAB, check_plan_protocol, make_scheduler
from tests.router.scheduler.fake_pipeline import reference_tokens

MAX_TOKENS = 6


class SchedulerMachine(RuleBasedStateMachine):
    pipeline_depth = 1
    run_ahead = False

    def __init__(self) -> None:
        super().__init__()
        self.scheduler, self.pipeline = make_scheduler(
            num_blocks=16, block_size=2, max_num_batched_tokens=8, max_num_seqs=4,
            max_model_len=24, max_inflight_steps=self.pipeline_depth, run_ahead=self.run_ahead,
            max_queued_requests=5)
        self.outstanding: deque[StepPlan] = deque()
        self.prompts: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {}
        self.cut_short: set[int] = set()
        self.next_id = 0

    def _live(self) -> list[int]:
        return [i for i in self.prompts if self.scheduler.get_state(i) is not None]

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12),
          choices=st.integers(0, 2), priority=st.integers(0, 1))
    def add(self, prompt: list[int], choices: int, priority: int) -> None:
        ids = list(range(self.next_id, self.next_id + 1 + choices))
        self.next_id += len(ids)
        waiting = self.scheduler.num_waiting
        try:
            self.scheduler.add_request(ids[0], prompt, ids[0], priority=priority,
                                       extra_choices=[ChoiceSpec(i, i) for i in ids[1:]])
        except AdmissionRefusedError:
            assert waiting >= 5
            return
        for seq_id in ids:
            self.prompts[seq_id] = prompt
            self.outputs[seq_id] = []

    @rule()
    def plan(self) -> None:
        plan = self.scheduler.schedule()
        if plan is not None:
            check_plan_protocol(plan)
            self.outstanding.append(plan)
            if plan.preempted_seq_ids:
                event("preemption")
            if plan.block_copies:
                event("fork with a block copy")
            if any(s.input_from_step is not None for s in plan.cached_seqs):
                event("run-ahead input")

    @precondition(lambda self: bool(self.outstanding))
    @rule()
    def complete(self) -> None:
        plan = self.outstanding.popleft()
        update = self.scheduler.update(plan.step_id, self.pipeline.execute(plan))
        if update.discarded_seq_ids:
            event("token discarded")
        for seq_id, token in update.new_tokens.items():
            out = self.outputs[seq_id]
            out.append(token)
            if (token == EOS or len(out) >= MAX_TOKENS) and (
                    seq_id not in update.length_capped_seq_ids):
                self.scheduler.finish(seq_id, FinishReason.STOP)

    @rule(data=st.data(), abort=st.booleans())
    def end_from_outside(self, data: st.DataObject, abort: bool) -> None:
        live = self._live()
        seq_id = data.draw(st.sampled_from(live)) if live else 12345
        ended = self.scheduler.abort(seq_id) if abort else self.scheduler.finish(
            seq_id, FinishReason.STOP)
        assert ended is (seq_id in live)
        if ended:
            self.cut_short.add(seq_id)
            self.cut_short.update(i for i in self.prompts if i not in self._live())

    @rule()
    def stage_failure(self) -> None:
        self.scheduler.preempt_all()
        self.outstanding.clear()
        self.pipeline.restart(self.scheduler.stats().num_steps)

    @invariant()
    def consistent(self) -> None:
        self.scheduler.check_integrity()

    def teardown(self) -> None:
        for _ in range(5_000):
            if not self.scheduler.has_unfinished and not self.outstanding:
                break
            if self.scheduler.has_capacity:
                self.plan()
            if self.outstanding:
                self.complete()
        else:
            raise AssertionError("did not drain")
        while (plan := self.scheduler.schedule()) is not None:  # pending notices
            self.scheduler.update(plan.step_id, self.pipeline.execute(plan))
        self.scheduler.check_integrity()
        assert self.scheduler.kv_cache.usage().num_used_blocks == 0
        assert not self.pipeline.seqs, "the stages were not told to drop every sequence"
        for seq_id, prompt in self.prompts.items():
            expected = reference_tokens(prompt, seq_id, VOCAB, MAX_TOKENS, EOS)
            out = self.outputs[seq_id]
            if seq_id in self.cut_short:
                assert out == expected[: len(out)]
            else:
                assert out == expected, f"sequence {seq_id} diverged"


class PipelinedRunAheadMachine(SchedulerMachine):
    pipeline_depth = 2
    run_ahead = True


_SETTINGS = settings(max_examples=120, stateful_step_count=50, deadline=None)
SchedulerMachine.TestCase.settings = _SETTINGS
PipelinedRunAheadMachine.TestCase.settings = _SETTINGS
TestSchedulerProperties = SchedulerMachine.TestCase
TestPipelinedRunAheadProperties = PipelinedRunAheadMachine.TestCase
