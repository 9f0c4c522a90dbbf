"""Steps sent to the stages and not answered yet."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from router.scheduler.errors import InvalidStepResultError
from router.scheduler.sequence import Sequence


class InflightStep:
    """One outstanding step: who samples, who only computes, and who became stale.

    A sequence is stale in a step when it finished, was aborted or was preempted after the
    step was planned: the stages still compute it, and its sampled token is discarded.
    """

    __slots__ = ("prefill", "sampling", "silent", "stale", "step_id")

    def __init__(self, step_id: int, sampling: list[Sequence], silent: list[Sequence],
                 prefill: bool = False) -> None:
        self.step_id = step_id
        self.sampling = sampling  # sample == True in the plan; exactly the result's keys
        self.silent = silent  # non-final prefill chunks
        self.prefill = prefill  # some sequence computes more than one token (prompt work)
        self.stale: set[int] = set()


class InflightSteps:
    """Outstanding steps, oldest first; results must come back in that order."""

    def __init__(self) -> None:
        self._steps: deque[InflightStep] = deque()
        self.num_prefill = 0  # outstanding steps that carry prompt work

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[InflightStep]:
        return iter(self._steps)

    @property
    def oldest_step_id(self) -> int | None:
        """The id of the oldest outstanding step, None if none is."""
        return self._steps[0].step_id if self._steps else None

    def push(self, step: InflightStep) -> None:
        """Record a step just planned (its id is above every outstanding one)."""
        self._steps.append(step)
        self.num_prefill += step.prefill

    def oldest(self, step_id: int) -> InflightStep:
        """The oldest outstanding step, which must be ``step_id``.

        Raises:
            InvalidStepResultError: no step is outstanding, or ``step_id`` is not the oldest
                (results come back in step order; a forgotten step after ``forget_all`` too).
        """
        if not self._steps or self._steps[0].step_id != step_id:
            expected = self._steps[0].step_id if self._steps else None
            raise InvalidStepResultError(
                f"result for step {step_id}, but the oldest outstanding step is {expected}")
        return self._steps[0]

    def pop_oldest(self) -> None:
        """Drop the oldest step (its result was applied)."""
        self.num_prefill -= self._steps.popleft().prefill

    def mark_stale(self, seq_id: int) -> None:
        """Discard ``seq_id``'s tokens in every outstanding step."""
        for step in self._steps:
            step.stale.add(seq_id)

    def forget_all(self) -> None:
        """Forget every outstanding step (their results will be refused)."""
        self._steps.clear()
        self.num_prefill = 0
