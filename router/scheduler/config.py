"""Configuration of the router's scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of the queue. Composed at the top with a ``KVCacheConfig``.

    Attributes:
        max_num_batched_tokens: tokens one step computes, decodes and prefill chunks together.
        max_num_seqs: sequences in one step. Running sequences are capped at
            ``max_num_seqs * max_inflight_steps``, so every decode fits in some step.
        max_model_len: prompt plus generated tokens of one sequence; the scheduler finishes a
            sequence (reason LENGTH) when it gets there.
        max_inflight_steps: P, the pipeline stages kept busy: up to P steps in flight, over
            disjoint sets of sequences.
        run_ahead: let a step name "the token sampled at step k" as a sequence's input, so a
            sequence can be scheduled again before step k's result reached the router (its
            previous step must be at least P steps older).
        run_ahead_depth: with run_ahead, the steps of one sequence that may be outstanding
            at once (2: one whose token is coming and the one planned on it); up to
            ``P * run_ahead_depth`` steps may be outstanding. Deeper lets the caller send
            several steps' plans at a time; a finish learned late costs up to
            ``run_ahead_depth - 1`` discarded tokens of that sequence.
        max_queued_requests: waiting sequences (never started or preempted) beyond which a new
            request is refused.
        max_queued_tokens: tokens of waiting sequences beyond which a new request is refused.

    Raises:
        ValueError: from construction, when a limit is out of range.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_inflight_steps: int = 1
    run_ahead: bool = False
    run_ahead_depth: int = 2
    max_queued_requests: int = 4096
    max_queued_tokens: int = 1 << 22

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "max_inflight_steps", "max_queued_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.run_ahead_depth < 2:
            raise ValueError(f"run_ahead_depth must be >= 2 (one step planned on another), "
                             f"got {self.run_ahead_depth}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must leave room for a prompt and a token, got "
                             f"{self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise decodes late in the running order could wait for ever behind early ones.
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs})")

    @property
    def max_outstanding_steps(self) -> int:
        """Steps sent and not yet answered: P, or P * run_ahead_depth with run-ahead."""
        return self.max_inflight_steps * (self.run_ahead_depth if self.run_ahead else 1)

    @property
    def max_steps_per_seq(self) -> int:
        """Steps of one sequence outstanding at once."""
        return self.run_ahead_depth if self.run_ahead else 1

    @property
    def max_running_seqs(self) -> int:
        """Sequences holding blocks at once: one full step per pipeline slot."""
        return self.max_num_seqs * self.max_inflight_steps
