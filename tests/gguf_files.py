"""Small GGUF files written with the `gguf` package: a real architecture's tensor names and
hyper-parameters, a byte-level BPE tokenizer of a few hundred ids and a chat template, so
transformers' own GGUF reader loads them (the reference the imports are checked against)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_tiny_gguf(path: Path, arch: str = "qwen2", seed: int = 0,
                    quantization: str = "F32") -> Path:
    """A 2-layer model of `arch` (qwen2 has q/k/v biases) at `path`: fp32 tensors, or the
    2-D weights (the projections, embedding and head) stored as `quantization`, a
    GGMLQuantizationType name (Q8_0, ...: quantized with the `gguf` package; a type it
    does not dequantize, such as Q8_1, as zero bytes of the right size)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[quantization]

    tokens = [*_byte_symbols(), "Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>",
              "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3] * 3
    hidden, layers, heads, kv_heads, ffn = 64, 2, 4, 2, 128
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if len(shape) == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qtype in gguf.quants._type_traits:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)

    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        tensor(p + "attn_q.weight", heads * head_dim, hidden)
        tensor(p + "attn_k.weight", kv_heads * head_dim, hidden)
        tensor(p + "attn_v.weight", kv_heads * head_dim, hidden)
        if arch == "qwen2":
            tensor(p + "attn_q.bias", heads * head_dim)
            tensor(p + "attn_k.bias", kv_heads * head_dim)
            tensor(p + "attn_v.bias", kv_heads * head_dim)
        tensor(p + "attn_output.weight", hidden, heads * head_dim)
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        tensor(p + "ffn_gate.weight", ffn, hidden)
        tensor(p + "ffn_up.weight", ffn, hidden)
        tensor(p + "ffn_down.weight", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    tensor("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
