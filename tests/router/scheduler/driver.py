"""The test driver: a scheduler over a tiny pool, the pipeline rhythm, plan protocol checks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcache import KVCacheConfig
from router.scheduler import FinishReason, Scheduler, SchedulerConfig, StepPlan
from tests.router.scheduler.fake_pipeline import FakePipeline

VOCAB = 50
EOS = 7


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **config: object
                   ) -> tuple[Scheduler, FakePipeline]:
    """A scheduler over a tiny pool and the fake pipeline that executes its plans."""
    defaults: dict[str, object] = {"max_num_batched_tokens": 32, "max_num_seqs": 8,
                                   "max_model_len": 64}
    defaults.update(config)
    scheduler = Scheduler(SchedulerConfig(**defaults),  # type: ignore[arg-type]
                          KVCacheConfig(num_blocks=num_blocks, block_size=block_size))
    return scheduler, FakePipeline(num_blocks, block_size, VOCAB)


def check_plan_protocol(plan: StepPlan) -> None:
    """Rules every plan keeps: a sequence is freed or computed in a plan, never both, and is
    named once; every entry computes at least one token."""
    computed = plan.seq_ids
    freed = plan.freed_seq_ids
    assert len(set(computed)) == len(computed) and len(set(freed)) == len(freed), plan
    assert not set(computed) & set(freed), f"step {plan.step_id} frees and computes {computed}"
    assert all(s.num_new_tokens >= 1 for s in plan.new_seqs)
    assert all(s.num_new_tokens >= 1 for s in plan.cached_seqs)


@dataclass
class Driver:
    """Runs the pipeline rhythm: plan while there is room, else answer the oldest step.

    ``max_tokens`` gives each sequence its length limit (the caller's stop rule, with EOS);
    ``outputs`` collects the tokens each sequence produced, in order.
    """

    scheduler: Scheduler
    pipeline: FakePipeline
    max_tokens: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    outstanding: deque[StepPlan] = field(default_factory=deque)
    plans: list[StepPlan] = field(default_factory=list)
    use_eos: bool = True

    def plan(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        if plan is not None:
            check_plan_protocol(plan)
            self.outstanding.append(plan)
            self.plans.append(plan)
        return plan

    def complete(self) -> None:
        plan = self.outstanding.popleft()
        update = self.scheduler.update(plan.step_id, self.pipeline.execute(plan))
        for seq_id, token in update.new_tokens.items():
            out = self.outputs.setdefault(seq_id, [])
            out.append(token)
            if (self.use_eos and token == EOS) or len(out) >= self.max_tokens.get(seq_id, 1 << 30):
                self.scheduler.finish(seq_id, FinishReason.STOP)

    def tick(self) -> bool:
        """One iteration; False when there was nothing to do at all."""
        plan = self.plan() if self.scheduler.has_capacity else None
        if plan is None or not self.scheduler.has_capacity:
            if not self.outstanding:
                return plan is not None
            self.complete()
        return True

    def run(self, max_iterations: int = 100_000) -> None:
        for _ in range(max_iterations):
            if not self.tick() and not self.scheduler.has_unfinished:
                return
        raise AssertionError("the scheduler did not drain")
