"""Executes step plans on one TP rank of a stage: state, inputs, model, sampling.

The leader (TP rank 0) also talks to the neighbours over the data plane and answers the
router; other ranks receive the plan and the activations from the leader over the TP group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from foundation.model_config import ModelConfig
from foundation.sampling_params import SamplingParams
from stage_worker.partition import LayerRange
from stage_worker.plan import SampledToken, StagePlan
from stage_worker.runner import StageRunner
from stage_worker.sampling import Sampler, SamplerOutput, SamplingBatch
from stage_worker.seq_state import PlanError, StageState
from stage_worker.step_input import SeqChunk

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class ComputeShape:
    """What a stage computes on, for stages that skip the model (fake compute)."""

    layers: LayerRange
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device


class StepExecutor:
    """Turns plans into model steps.

    `runner` None means fake compute: the stage moves activations of the right shape but
    does no model work, and the last stage "samples" token (seq_id + output index) mod V.
    This measures the control plane alone (benchmark W6).
    """

    def __init__(self, shape: ComputeShape, runner: StageRunner | None) -> None:
        self.shape = shape
        self.runner = runner
        self.state = StageState()
        self.sampler = Sampler()

    @classmethod
    def for_runner(cls, runner: StageRunner, model_cfg: ModelConfig) -> StepExecutor:
        shape = ComputeShape(runner.cfg.layers, model_cfg.hidden_size, model_cfg.vocab_size,
                             runner.cfg.dtype, runner.cfg.device)
        return cls(shape, runner)

    @property
    def is_first(self) -> bool:
        return self.shape.layers.is_first

    @property
    def is_last(self) -> bool:
        return self.shape.layers.is_last

    def prepare(self, plan: StagePlan) -> tuple[list[SeqChunk], torch.Tensor | None]:
        """Apply the plan to the state and make its KV block copies (before any KV of the
        step is written). Returns the chunks and, on the first stage, the input ids [T].
        Raises PlanError on a plan that contradicts the state."""
        chunks, ids = self.state.apply(plan)
        if self.runner is not None and plan.block_copies:
            self.runner.copy_blocks(plan.block_copies)
        if not self.is_first:
            return chunks, None
        if len(ids) != plan.num_tokens:
            raise PlanError(f"step {plan.step_id}: first stage knows {len(ids)} input tokens, "
                            f"the plan computes {plan.num_tokens}")
        return chunks, torch.tensor(ids, dtype=torch.long)

    def hidden_shape(self, num_tokens: int) -> tuple[int, int]:
        return (num_tokens, self.shape.hidden_size)

    def forward(self, chunks: Sequence[SeqChunk], inputs: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] (non-last) or logits [S, V] (last) for the step."""
        if self.runner is not None:
            return self.runner.execute(chunks, inputs)
        if not self.is_last:
            if self.is_first:
                return torch.zeros(len(inputs), self.shape.hidden_size, dtype=self.shape.dtype)
            return inputs
        return torch.empty(0)

    def sample(self, chunks: Sequence[SeqChunk], logits: torch.Tensor) -> list[SampledToken]:
        """Last stage: pick a token for every sampling chunk and record it."""
        sampling = [c for c in chunks if c.sample]
        if not sampling:
            return []
        states = [self.state.seqs[c.seq_id] for c in sampling]
        if self.runner is None:
            picks = [(c.seq_id + s.num_outputs) % self.shape.vocab_size
                     for c, s in zip(sampling, states, strict=True)]
            tokens = [SampledToken(c.seq_id, t) for c, t in zip(sampling, picks, strict=True)]
        else:
            params = [s.sampling or GREEDY for s in states]
            batch = SamplingBatch.build(
                params, [s.token_ids[:s.prompt_len] for s in states],
                [s.output_ids for s in states], [s.num_outputs for s in states],
                self.shape.vocab_size, logits.device,
            )
            out = self.sampler(logits, batch)
            tokens = _to_tokens(sampling, params, out.token_ids.tolist(), out)
        for t in tokens:
            self.state.record_sampled(t.seq_id, t.token_id)
        return tokens


def _to_tokens(chunks: Sequence[SeqChunk], params: Sequence[SamplingParams], ids: list[int],
               out: SamplerOutput) -> list[SampledToken]:
    if out.logprobs is None:
        return [SampledToken(c.seq_id, t) for c, t in zip(chunks, ids, strict=True)]
    lps = out.logprobs.tolist()
    top_ids, top_lps = out.top_token_ids.tolist(), out.top_logprobs.tolist()
    tokens = []
    for row, (c, p, t) in enumerate(zip(chunks, params, ids, strict=True)):
        k = p.logprobs or 0
        tokens.append(SampledToken(c.seq_id, t, lps[row], tuple(top_ids[row][:k]),
                                   tuple(top_lps[row][:k])))
    return tokens
