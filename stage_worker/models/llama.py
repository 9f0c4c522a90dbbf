"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) for one pipeline stage.

The stage builds only its layers: the embedding on the first stage, the final norm and the
LM head on the last. Module names follow the HF checkpoint (`model.layers.<global index>`)
so the loader maps tensors by name.
"""

from __future__ import annotations

import torch
from torch import nn

from foundation.model_config import ModelConfig
from stage_worker.forward_context import ForwardContext
from stage_worker.layers.attention import PagedSelfAttention
from stage_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from stage_worker.layers.linear import (
    LinearLayer,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from stage_worker.layers.norm import RMSNorm
from stage_worker.parallel import TPGroup
from stage_worker.partition import LayerRange


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], tp, dtype)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = PagedSelfAttention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.attention_bias, tp, dtype,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, tp, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]: the previous layer's MLP output, or the stage's input when `residual` is
        None (the stage's first layer); residual [T, H]: the residual stream before x is
        added to it. Returns (this layer's MLP output, the residual stream before it is
        added): the residual add at a layer's end is done by the next layer's input norm
        (one fused add + norm) or by the stage's end. The sums are rounded to the model's
        dtype exactly as `x + residual` rounds them, so the values are those of the layer
        computed as HF writes it. The same as `end(attend(begin(...)))`."""
        normed, residual = self._input_norm(x, residual)
        return self.end(self.self_attn.project_and_attend(normed, kv_cache, ctx), residual)

    def _input_norm(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input norm of x + residual, x + residual); x itself for the first layer."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.add_and_norm(x, residual)

    def begin(self, x: torch.Tensor, residual: torch.Tensor | None,
              kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention: (q [T, heads, head_dim], the residual stream);
        this step's K/V are written. Reads ctx's cos, sin and slots only."""
        normed, residual = self._input_norm(x, residual)
        return self.self_attn.project(normed, kv_cache, ctx), residual

    def end(self, attn: torch.Tensor, residual: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention: attn [T, heads * head_dim] -> (MLP output, the
        residual stream before it is added)."""
        normed, residual = self.post_attention_layernorm.add_and_norm(
            self.self_attn.o_proj(attn), residual)
        return self.mlp(normed), residual


class LlamaInner(nn.Module):
    """HF's `model.*`: embedding (first stage), this stage's layers, final norm (last)."""

    def __init__(self, cfg: ModelConfig, layers: LayerRange, tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
                             if layers.is_first else None)
        # Keyed by global layer index so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({
            str(i): LlamaDecoderLayer(cfg, tp, dtype) for i in range(layers.start, layers.end)
        })
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if layers.is_last else None


class LlamaStageModel(nn.Module):
    """One stage of the model.

    forward(input, kv_caches, ctx):
        input: token ids [T] on the first stage, hidden states [T, H] on the others
        kv_caches: one (k, v) pair per local layer, in layer order
    returns hidden states [T, H] (final-normed on the last stage); `compute_logits` turns the
    rows that sample into logits [S, V].
    """

    def __init__(self, cfg: ModelConfig, layers: LayerRange, tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_range = layers
        self.model = LlamaInner(cfg, layers, tp, dtype)
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
                        if layers.is_last else None)
        if self.lm_head is not None and self.model.embed_tokens is not None \
                and cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one copy when both are here

    def forward(self, inputs: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(inputs)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.model.layers.values(), kv_caches, strict=True):
            x, residual = layer(x, residual, kv, ctx)
        return self.finish(x, residual)

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's decoder layers in order."""
        return [layer for layer in self.model.layers.values()
                if isinstance(layer, LlamaDecoderLayer)]

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """The stage's input as hidden states [T, H]: token ids embedded on the first stage,
        the previous stage's hidden states as they are elsewhere."""
        return self.model.embed_tokens(inputs) if self.model.embed_tokens is not None else inputs

    def finish(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (MLP output, residual stream) -> the stage's output [T, H]: their
        sum, final-normed on the last stage (residual None: a stage without layers)."""
        norm = self.model.norm
        if residual is None:
            return norm(x) if norm is not None else x
        return norm.add_and_norm(x, residual)[0] if norm is not None else x + residual

    def quantize_fp8(self) -> None:
        """Every decoder layer's projections to e4m3 weights with per-output-feature scales
        (`kernels.fp8_linear`); the embedding, the norms and the LM head keep their dtype."""
        for module in self.model.modules():
            if isinstance(module, LinearLayer):
                module.quantize_fp8()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "logits are computed on the last stage only"
        return self.lm_head(hidden).float()
