"""How deep the engine core runs ahead, from how fast the pipeline answers.

Running further ahead lets the core plan, and send, more steps at a time: fewer wake-ups of
its loop and fewer `Run` messages a step, which is what bounds a pipeline whose steps are
short (small models, CPU stages: the control plane, W6). Its price is paid by a request
that arrives during steady decode: its first step runs behind every step already planned,
`micro_batches * depth` of them. `RunAheadPace` keeps the configured depth at any pace and
goes deeper, up to the most allowed, only while that many steps run within a time budget:
a large model's steps on a GPU, several milliseconds each, never move it from the configured
depth. The mean of the intervals is the pipeline's pace even where answers come several to a
message (intervals near 0 between them, and one as long as all of them before).
"""

from __future__ import annotations

from router.scheduler import Scheduler

SMOOTHING = 0.1  # weight of the newest interval in the running mean
MIN_INTERVALS = 8  # intervals measured before the depth leaves its base


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
        self._measured = 0
        self._last: float | None = None  # when the last answer came, if others were out
        if config.run_ahead:
            scheduler.run_ahead_depth = base

    def room(self) -> bool:
        """Whether to plan now: with nothing outstanding, or room for half the outstanding
        steps allowed now (with run-ahead deeper than 2, steps go out several to a message;
        a gRPC message costs far more than a plan in it)."""
        limit = self.scheduler.outstanding_limit
        outstanding = self.scheduler.num_outstanding_steps
        return outstanding == 0 or limit - outstanding >= max(1, limit // 2)

    def answered(self, now: float, still_outstanding: bool) -> None:
        """Note an answer that came at `now` (monotonic seconds); `still_outstanding`: other
        steps were out after it, so the time to the next answer is a step of the pipeline's,
        not a wait for work."""
        last, self._last = self._last, (now if still_outstanding else None)
        if last is None or not self.active:
            return
        self.interval_s += (now - last - self.interval_s) * (SMOOTHING if self._measured
                                                              else 1.0)
        self._measured += 1
        if self._measured < MIN_INTERVALS:
            return
        fits = (int(self.budget_s / (self.micro_batches * self.interval_s))
                if self.interval_s > 0 else self.most)
        depth = min(self.most, max(self.base, fits))
        if depth != self.scheduler.run_ahead_depth:
            self.scheduler.run_ahead_depth = depth

    def reset(self) -> None:
        """Forget the pace (the pipeline is re-linked): back to `base`."""
        self.interval_s = 0.0
        self._measured = 0
        self._last = None
        if self.scheduler.config.run_ahead:
            self.scheduler.run_ahead_depth = self.base
