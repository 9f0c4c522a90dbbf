"""The runtime's logits against HF transformers on the same tiny random checkpoints (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from stage_worker.step_input import SeqChunk

# fp32 on both sides, same op order except matmul blocking and SDPA: differences are
# rounding noise, ~1e-6 on these tiny models. 1e-4 leaves room without hiding a real bug
# (a wrong head mapping or rope shows up as O(1e-1)).
ATOL = 1e-4


def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_prefill_then_decode_logits_match_hf(
    tiny_checkpoint: tuple[Path, PreTrainedModel], stages: int
) -> None:
    path, model = tiny_checkpoint
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 160, (37,), generator=gen).tolist()
    ref = hf_logits(model, ids)
    pipe = LocalPipeline(LocalPipelineConfig(path, stages, block_size=8, num_blocks=8))
    table = [5, 2, 7, 0, 3]  # deliberately scattered blocks
    prompt = 29
    got = pipe.step([SeqChunk(0, 0, prompt, table)], torch.tensor(ids[:prompt]))
    diffs = [(got[0] - ref[prompt - 1]).abs().max().item()]
    for pos in range(prompt, len(ids)):  # teacher-forced decode steps
        got = pipe.step([SeqChunk(0, pos, 1, table)], torch.tensor([ids[pos]]))
        diffs.append((got[0] - ref[pos]).abs().max().item())
    assert max(diffs) < ATOL, diffs


def test_mixed_batch_of_prefills_and_decodes(
    tiny_checkpoint: tuple[Path, PreTrainedModel]
) -> None:
    """Two prefills of different lengths, then a step mixing a decode with a prefill chunk."""
    path, model = tiny_checkpoint
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, 160, (21,), generator=gen).tolist()
    b = torch.randint(0, 160, (9,), generator=gen).tolist()
    c = torch.randint(0, 160, (14,), generator=gen).tolist()
    pipe = LocalPipeline(LocalPipelineConfig(path, 2, block_size=4, num_blocks=32))
    ta, tb, tc = list(range(0, 8)), list(range(8, 12)), list(range(12, 20))
    got = pipe.step([SeqChunk(1, 0, 20, ta), SeqChunk(2, 0, 9, tb)],
                    torch.tensor(a[:20] + b))
    assert (got[0] - hf_logits(model, a[:20])[-1]).abs().max() < ATOL
    assert (got[1] - hf_logits(model, b)[-1]).abs().max() < ATOL
    # Sequence 1 decodes its 21st token while sequence 3 prefills its first 10 tokens and
    # does not sample (a non-final chunk); then sequence 3 finishes its prompt.
    got = pipe.step([SeqChunk(1, 20, 1, ta), SeqChunk(3, 0, 10, tc, sample=False)],
                    torch.tensor(a[20:] + c[:10]))
    assert got.shape[0] == 1
    assert (got[0] - hf_logits(model, a)[-1]).abs().max() < ATOL
    got = pipe.step([SeqChunk(3, 10, 4, tc)], torch.tensor(c[10:]))
    assert (got[0] - hf_logits(model, c)[-1]).abs().max() < ATOL


def test_chunked_prefill_equals_one_shot(tiny_checkpoint: tuple[Path, PreTrainedModel]) -> None:
    """A prompt prefilled in 3 chunks, then decoded, gives the one-shot logits."""
    path, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 160, (40,), generator=gen).tolist()
    table = list(range(10))
    one = LocalPipeline(LocalPipelineConfig(path, 1, block_size=4, num_blocks=10))
    ref = one.step([SeqChunk(0, 0, 39, table)], torch.tensor(ids[:39]))
    ref_decode = one.step([SeqChunk(0, 39, 1, table)], torch.tensor(ids[39:]))
    chunked = LocalPipeline(LocalPipelineConfig(path, 1, block_size=4, num_blocks=10))
    for start, end in [(0, 13), (13, 26)]:
        out = chunked.step([SeqChunk(0, start, end - start, table, sample=False)],
                           torch.tensor(ids[start:end]))
        assert out.shape[0] == 0
    got = chunked.step([SeqChunk(0, 26, 13, table)], torch.tensor(ids[26:39]))
    got_decode = chunked.step([SeqChunk(0, 39, 1, table)], torch.tensor(ids[39:]))
    assert (got - ref).abs().max() < 1e-5
    assert (got_decode - ref_decode).abs().max() < 1e-5


def test_greedy_tokens_match_hf_generate(tiny_checkpoint: tuple[Path, PreTrainedModel]) -> None:
    path, model = tiny_checkpoint
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (5, 17, 30)]
    pipe = LocalPipeline(LocalPipelineConfig(path, 2, block_size=8, num_blocks=64))
    ours = greedy_generate(pipe, prompts, max_new_tokens=24)
    for prompt, tokens in zip(prompts, ours, strict=True):
        ref = list(prompt)  # HF forward over the whole sequence each step, no EOS handling
        for _ in range(24):
            ref.append(int(hf_logits(model, ref)[-1].argmax()))
        assert tokens == ref[len(prompt):]
