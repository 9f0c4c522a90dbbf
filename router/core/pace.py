"""How deep the engine core runs ahead, from how fast the pipeline answers.

Running further ahead lets the core plan, and send, more steps at a time: fewer wake-ups of
its loop and fewer `Run` messages a step, which is what bounds a pipeline whose steps are
short (small models, CPU stages: the control plane, W6). For the same reason, while steps
are short the last stage answers several steps in one message (`RunAheadPace.holds`).

The depth's price is paid by a request that arrives during steady decode: its first step
runs behind every step already planned, `micro_batches * depth` of them. `RunAheadPace`
keeps the configured depth at any pace and goes deeper, up to the most allowed, only while
that many steps run within a time budget: a large model's steps on a GPU, several
milliseconds each, never move it from the configured depth. The pace is measured per
message of answers: the time since the one before, divided by the steps it answers.
"""

from __future__ import annotations

from router.scheduler import Scheduler

SMOOTHING = 0.1  # weight of the newest interval in the running mean
MIN_INTERVALS = 8  # intervals measured before the depth leaves its base
# The last stage may hold a step's answer for the next steps' (`hold_answer`), so that one
# message answers several steps: for at most this share of the run-ahead budget.
ANSWER_SHARE = 1 / 8


class RunAheadPace:
    """Sets `scheduler.run_ahead_depth` for the next steps from the intervals between
    answers (inert without run-ahead).

    base: the depth at any pace (`--run-ahead-depth`); the deepest is the scheduler's
        config's (`CoreConfig.max_run_ahead_depth`).
    budget_s: the longest a request that arrives during steady decode should wait behind
        steps planned before it came: the depth is the largest whose `P * depth` steps the
        pipeline answers in that time, P the micro-batches in flight (0: always `base`).
    """

    def __init__(self, scheduler: Scheduler, base: int, budget_s: float) -> None:
        config = scheduler.config
        self.scheduler = scheduler
        self.active = config.run_ahead and budget_s > 0
        self.base = base
        self.most = config.max_steps_per_seq
        self.budget_s = budget_s
        self.micro_batches = config.max_inflight_steps
        self.interval_s = 0.0  # running mean of the time between answers while busy
        self.answer_group = 1  # steps answered in one message (see `holds`)
        self._measured = 0
        self._last: float | None = None  # when the last answer came, if others were out
        if config.run_ahead:
            scheduler.run_ahead_depth = base

    def holds(self, num_plans: int) -> list[bool]:
        """Which of `num_plans` plans sent together let the last stage hold their answer
        (`hold_answer`): answers go in groups of `answer_group` steps, each group's last
        answer and the last plan's never held."""
        group = self.answer_group
        return [(i + 1) % group != 0 and i + 1 < num_plans for i in range(num_plans)]

    def room(self) -> bool:
        """Whether to plan now: with nothing outstanding, or room for half the outstanding
        steps allowed now (with run-ahead deeper than 2, steps go out several to a message;
        a gRPC message costs far more than a plan in it), or, while answers come in groups,
        for a group's steps: the stages learn of the next steps as soon as the core learns
        that a group is done (a group's first steps were done before the core heard)."""
        limit = self.scheduler.outstanding_limit
        outstanding = self.scheduler.num_outstanding_steps
        need = max(1, limit // 2)
        if self.answer_group > 1:
            need = min(need, self.answer_group)
        return outstanding == 0 or limit - outstanding >= need

    def answered(self, now: float, still_outstanding: bool, count: int = 1) -> None:
        """Note a message of `count` answers that came at `now` (monotonic seconds);
        `still_outstanding`: other steps were out after it, so the time to the next message
        is the pipeline's steps, not a wait for work. The time since the last message is
        `count` steps' (a message answers the steps done since the one before)."""
        last, self._last = self._last, (now if still_outstanding else None)
        if last is None or not self.active:
            return
        step_s = (now - last) / max(1, count)
        self.interval_s += (step_s - self.interval_s) * (SMOOTHING if self._measured else 1.0)
        self._measured += 1
        if self._measured < MIN_INTERVALS:
            return
        fits = (int(self.budget_s / (self.micro_batches * self.interval_s))
                if self.interval_s > 0 else self.most)
        depth = min(self.most, max(self.base, fits))
        if depth != self.scheduler.run_ahead_depth:
            self.scheduler.run_ahead_depth = depth
        # Steps whose answers may wait for a later one's: as many as the pipeline answers
        # within ANSWER_SHARE of the budget (1, none held, where a step takes longer: a
        # large model's step on a GPU is answered as soon as it is done).
        self.answer_group = (int(self.budget_s * ANSWER_SHARE / self.interval_s) + 1
                             if self.interval_s > 0 else 1)

    def reset(self) -> None:
        """Forget the pace (the pipeline is re-linked): back to `base`."""
        self.interval_s = 0.0
        self.answer_group = 1
        self._measured = 0
        self._last = None
        if self.scheduler.config.run_ahead:
            self.scheduler.run_ahead_depth = self.base
