"""The waiting queue: by priority, then arrival; O(log n) push and pop, O(1) removal."""

from __future__ import annotations

import heapq

from router.scheduler.sequence import SeqState, Sequence


class WaitingQueue:
    """Sequences in state WAITING, best ``order_key`` first.

    Removal (abort while waiting) is lazy: the entry stays in the heap and is skipped when it
    reaches the top, but the counts drop at once. A preempted sequence re-enters with its
    original key, so it goes ahead of everything that arrived after it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], Sequence]] = []
        self.num_seqs = 0
        self.num_tokens = 0  # known tokens of waiting sequences, for admission limits

    def __len__(self) -> int:
        return self.num_seqs

    def push(self, seq: Sequence) -> None:
        """Queue ``seq`` (already set to WAITING). Mutates the counts."""
        heapq.heappush(self._heap, (seq.order_key, seq))
        self.num_seqs += 1
        self.num_tokens += len(seq.token_ids)

    def peek(self) -> Sequence | None:
        """The best waiting sequence, or None. Drops removed entries from the top."""
        heap = self._heap
        while heap and heap[0][1].state is not SeqState.WAITING:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def pop(self, seq: Sequence) -> None:
        """Take ``seq``, the sequence ``peek`` just returned, off the queue."""
        entry = heapq.heappop(self._heap)
        assert entry[1] is seq, "pop() must follow peek()"
        self._forget(seq)

    def discard(self, seq: Sequence) -> None:
        """Count ``seq`` out now; its entry is skipped later (the caller changes its state)."""
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self.num_seqs -= 1
        self.num_tokens -= len(seq.token_ids)

    def live(self) -> list[Sequence]:
        """Waiting sequences in queue order (for integrity checks and stats; O(n log n))."""
        return [s for _, s in sorted(self._heap, key=lambda e: e[0]) if s.state is SeqState.WAITING]
