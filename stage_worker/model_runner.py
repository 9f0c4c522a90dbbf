"""The contract between a stage and the model implementation it runs.

`build.build_runner` picks the implementation once (`StageConfig.model_impl`); nothing else
branches on it. Two implement it: `runner.StageRunner` (the torch Llama-family model over a
paged KV pool) and `null_runner.NullRunner` (no model compute, for the control plane).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stage_worker.held_seqs import HeldSeq
from stage_worker.partition import LayerRange
from stage_worker.step_input import SeqChunk
from stage_worker.step_sampling import StepSample

# Writes late inputs into a step's token ids on the device ([T] int64), see `execute`.
InputFill = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class StageShape:
    """What a stage computes on: its layers, the activations it exchanges ([T, hidden_size]
    in `dtype`), the vocabulary, and this rank's device."""

    layers: LayerRange
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class StageCapacity:
    """What a runner sized itself for; the stage refuses plans beyond it.

    num_blocks: KV blocks this rank's pool holds for the scheduler (ids [0, num_blocks)).
    block_size: tokens per KV block.
    max_num_batched_tokens: the largest step (tokens computed) its activations fit.
    max_num_seqs: the most sequences one step computes.
    """

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int


class ModelRunner(ABC):
    """One TP rank's slice of the model, its KV pool, and (last stage) its sampling.

    Contract, per step, in this order:
    - `copy_blocks(pairs)` copies KV blocks src -> dst before the step writes any KV.
    - `execute(chunks, inputs)` runs the step; every TP rank calls it with the same chunks
      (collectives inside). `inputs`: token ids [T] int64 on the first stage, hidden states
      [T, H] (`shape.dtype`) elsewhere, T = sum of the chunks' num_new, in chunk order.
      Returns hidden states [T, H] on a non-last stage. On the last stage it returns the
      step's scores for the chunks with `sample` set, [S, *] in chunk order, which only this
      runner's `sample` reads (the torch model: fp32 logits [S, V]; no compute: [S, 0]).
      `fill` (first stage only): called once with the step's token ids as the device will
      read them ([T] int64), after the step's host work and before its first kernel, to
      write inputs that were not known when the step began (run-ahead tokens fed back from
      the last stage; see `InputFill`).
    - `sample(seqs, scores)` (last stage, TP rank 0 only) picks one token per sampling
      chunk from `execute`'s scores and each sequence's sampling state (its params, prompt,
      outputs and output count), in the same order; it records nothing. The tokens stay on
      the device, their host copy is under way (`StepSample.resolve` waits for it).
    """

    impl: str  # the name Describe reports: "llama" or "null"

    @property
    @abstractmethod
    def shape(self) -> StageShape: ...

    @property
    @abstractmethod
    def capacity(self) -> StageCapacity: ...

    @abstractmethod
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None: ...

    @abstractmethod
    def execute(self, chunks: Sequence[SeqChunk], inputs: torch.Tensor,
                fill: InputFill | None = None) -> torch.Tensor: ...

    @abstractmethod
    def sample(self, seqs: Sequence[HeldSeq], scores: torch.Tensor) -> StepSample: ...
