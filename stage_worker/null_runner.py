"""A runner that does no model compute: the control plane alone (benchmark W6).

No weights are loaded and no KV pool exists. Activations have the right shape and dtype
(zeros out of the first stage, rows of one kept buffer: a step neither allocates nor
fills them, which at a hundred rows would run on torch's intra-op threads; passed through
by the others), and the last stage "samples" token (seq_id + tokens already output) mod
vocab_size for every sampling sequence, so a client can check which step produced which
token (log probability 0.0 where asked; its top alternatives the ids after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import torch

from stage_worker.held_seqs import HeldSeq
from stage_worker.host_transfer import host_tensor
from stage_worker.model_runner import InputFill, ModelRunner, StageCapacity, StageShape
from stage_worker.step_input import SeqChunk
from stage_worker.step_sampling import StepSample

_SAMPLE, _PROMPT_ROWS = attrgetter("sample"), attrgetter("prompt_rows")  # of a SeqChunk

# Pool size a null stage announces when none is configured: blocks cost it nothing.
NULL_NUM_BLOCKS = 1 << 16


class NullRunner(ModelRunner):
    """`ModelRunner` without a model; `capacity.num_blocks` is whatever it was given."""

    impl = "null"

    def __init__(self, shape: StageShape, capacity: StageCapacity) -> None:
        self._shape = shape
        self._capacity = capacity
        self._zeros = torch.zeros(0, shape.hidden_size, dtype=shape.dtype)  # grown on demand

    @property
    def shape(self) -> StageShape:
        return self._shape

    @property
    def capacity(self) -> StageCapacity:
        return self._capacity

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Nothing to copy: there is no KV."""

    def execute(self, chunks: Sequence[SeqChunk], inputs: torch.Tensor,
                fill: InputFill | None = None) -> torch.Tensor:
        """Zeros [T, H] (first stage), `inputs` (middle), or [S + P, 0] scores (last stage;
        see `StageRunner.execute`). `fill` runs as on a real stage (it waits for the
        run-ahead tokens), though no kernel reads what it writes."""
        if fill is not None:
            fill(inputs)
        layers = self._shape.layers
        if layers.is_last:
            return torch.empty(sum(map(_SAMPLE, chunks)) + sum(map(_PROMPT_ROWS, chunks)), 0)
        if layers.is_first:
            return self._zero_rows(inputs.shape[0])
        return inputs

    def _zero_rows(self, n: int) -> torch.Tensor:
        """[n, H] zeros: a read-only view of the kept buffer (nothing writes activations a
        stage sends)."""
        kept = self._zeros.shape[0]
        if kept < n:
            self._zeros = torch.zeros(max(n, 2 * kept), self._shape.hidden_size,
                                      dtype=self._shape.dtype)
        return self._zeros[:n]

    def sample(self, seqs: Sequence[HeldSeq], scores: torch.Tensor) -> StepSample:
        vocab = self._shape.vocab_size
        seq_ids = [s.seq_id for s in seqs]
        ids = host_tensor([(s.seq_id + s.num_outputs) % vocab for s in seqs])
        wants = [s.sampling.logprobs if s.sampling else None for s in seqs]
        n = len(seqs)
        if wants.count(None) == n:
            return StepSample.of(seq_ids, ids, wants)
        # The sampled id is the most likely (log probability 0.0); its k alternatives are
        # it and the ids after it, at 0.0, -1.0, -2.0, ... (beam search reads them).
        k = max(w for w in wants if w is not None)
        offsets = torch.arange(k)
        top_ids = (ids.unsqueeze(1) + offsets) % vocab
        top_lps = (-offsets.to(torch.float32)).expand(n, k)
        return StepSample.of(seq_ids, ids, wants, (torch.zeros(n), top_ids, top_lps))
