"""Piecewise CUDA graphs for steps the decode graphs do not cover: prefill chunks, and
prefills mixed with decodes, of up to MAX_MIXED_TOKENS tokens.

A step with prompt chunks has an attention layout that changes from step to step (its
kernel's grid follows the chunks), so its attention runs eagerly; everything between two
attentions is captured, per token bucket: piece 0 is the stage's input up to layer 0's
attention (embedding or input, norm, QKV, rope + KV write), piece i the rest of layer i - 1
and layer i up to its attention, and the last piece the rest of the last layer and the
stage's end (final norm, or the residual add). A step of T tokens runs the pieces of the
smallest bucket >= T over its rows padded with zeros: padding rows write their K/V to a
scratch slot no sequence owns, and the eager attention sees only the T real rows. So a
step of L layers makes L + 1 graph replays and L attention launches instead of ~10 L
launches.

Between pieces, values live in static buffers the graphs read and write (q, the residual
stream, the attention output), so graph-private memory holds nothing across replays and
every bucket's graphs share one memory pool. Row results do not depend on the padding:
every captured op is row-wise except the GEMMs, whose kernels may differ with the row count
(a few ulps; tested against eager steps on the GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

import torch

from stage_worker.cuda_graphs import capture_graph
from stage_worker.forward_context import ForwardContext
from stage_worker.models.llama import LlamaStageModel
from stage_worker.step_input import SeqChunk

log = logging.getLogger("stagemesh.runner")

MAX_MIXED_TOKENS = 512  # larger steps are compute-bound: eager launches cost them little
BUCKET_STEP = 32  # buckets every 32 tokens: at most 31 padding rows


def mixed_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token buckets for steps of up to `max_tokens` (capped at MAX_MIXED_TOKENS)."""
    top = min(max_tokens, MAX_MIXED_TOKENS)
    return tuple(range(BUCKET_STEP, top + BUCKET_STEP, BUCKET_STEP)) if top > 0 else ()


class MixedGraphs:
    """Captured pieces of one stage's steps, by token bucket.

    Args:
        model: the stage's layers (at least one).
        kv_layers: the (k, v) cache pair of every local layer (the same tensors replayed).
        scratch_slot: a flat KV slot outside the pool the scheduler hands out.
        input_shape: () for token ids (first stage), (hidden,) for hidden states.
        dtype: the model's dtype.
        max_tokens: the largest step to replay (see `mixed_buckets`).
        head_dim: the rope tables' width.
        capture: False runs the pieces eagerly over the same buffers (the CPU test of the
            padding and the pieces; there is nothing to capture there).
    """

    def __init__(self, model: LlamaStageModel, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 scratch_slot: int, input_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, max_tokens: int, head_dim: int,
                 capture: bool = True) -> None:
        started = time.monotonic()
        self.model = model
        self.layers = model.decoder_layers
        assert self.layers, "a stage without layers has nothing to capture"
        self.kv_layers = kv_layers
        self.scratch_slot = scratch_slot
        self.buckets = mixed_buckets(max_tokens)
        self.capture = capture
        size = self.buckets[-1]
        cfg = model.cfg
        attn = self.layers[0].self_attn
        q_width = attn.qkv_proj.q_size
        self.inputs = (torch.zeros(size, dtype=torch.long, device=device) if not input_shape
                       else torch.zeros(size, *input_shape, dtype=dtype, device=device))
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.cos = torch.zeros(size, head_dim, dtype=torch.float32, device=device)
        self.sin = torch.zeros(size, head_dim, dtype=torch.float32, device=device)
        self.slots = torch.full((size,), scratch_slot, dtype=torch.int64, device=device)
        self.q = torch.zeros(size, q_width // attn.head_dim, attn.head_dim, dtype=dtype,
                             device=device)
        self.attn = torch.zeros(size, q_width, dtype=dtype, device=device)
        self.residual = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        self.out = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.buckets):  # largest first: the smaller reuse its memory
                self.graphs[b] = [capture_graph(partial(self._piece, b, i), pool, device)[0]
                                  for i in range(len(self.layers) + 1)]
            torch.cuda.synchronize(device)
            log.info("captured %d pieces for step sizes up to %d tokens in %.1fs",
                     sum(len(g) for g in self.graphs.values()), size,
                     time.monotonic() - started)

    def _piece(self, b: int, i: int) -> None:
        """Piece i over the first `b` rows of the buffers (module docstring)."""
        ctx = ForwardContext(positions=self.positions[:b], cos=self.cos[:b], sin=self.sin[:b],
                             slot_mapping=self.slots[:b], attn=None)
        if i == 0:
            x, residual = self.model.embed(self.inputs[:b]), None
        else:
            x, residual = self.layers[i - 1].end(self.attn[:b], self.residual[:b])
        if i == len(self.layers):
            self.out[:b].copy_(self.model.finish(x, residual))
            return
        q, residual = self.layers[i].begin(x, residual, self.kv_layers[i], ctx)
        self.q[:b].copy_(q)
        self.residual[:b].copy_(residual)

    def covers(self, chunks: Sequence[SeqChunk]) -> bool:
        """Whether this step can run the pieces: at most the largest bucket's tokens."""
        return 0 < sum(c.num_new for c in chunks) <= self.buckets[-1]

    def run(self, inputs: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The step whose layout is `ctx` (`step_input.build_context`) over `inputs` ([T] or
        [T, H] on the device); returns hidden states [T, H] (a view of the output buffer,
        valid until the next step)."""
        t = inputs.shape[0]
        b = next(size for size in self.buckets if size >= t)
        self.inputs[:t].copy_(inputs)
        self.positions[:t].copy_(ctx.positions)
        self.cos[:t].copy_(ctx.cos)
        self.sin[:t].copy_(ctx.sin)
        self.slots[:t].copy_(ctx.slot_mapping)
        if t < b:  # padding rows: zero inputs at position 0, K/V to the scratch slot
            self.inputs[t:b].zero_()
            self.positions[t:b].zero_()
            self.slots[t:b].fill_(self.scratch_slot)
        for i, layer in enumerate(self.layers):
            self._replay(b, i)
            self.attn[:t].copy_(layer.self_attn.attend(self.q[:t], self.kv_layers[i], ctx))
        self._replay(b, len(self.layers))
        return self.out[:t]

    def _replay(self, b: int, i: int) -> None:
        if self.capture:
            self.graphs[b][i].replay()
        else:
            self._piece(b, i)
