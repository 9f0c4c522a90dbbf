"""The runtime on CUDA (marker `gpu`): against HF transformers on CUDA, decode graphs
against eager steps, a decode step that waits on the GPU only for its sampled ids, and
one-stage run-ahead inputs gathered on the device."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from foundation.model_config import ModelConfig
from stage_worker.build import build_stage_rank
from stage_worker.config import StageConfig
from stage_worker.host_transfer import HostCopy, to_device
from stage_worker.leader import StageLeader
from stage_worker.offline import LocalPipeline, LocalPipelineConfig
from stage_worker.parallel import TPGroup
from stage_worker.partition import LayerRange
from stage_worker.plan import StageCachedSeq, StageNewSeq, StagePlan
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "tol"), [
    (torch.float32, 2e-3),  # TF32 is off by default for matmul in torch; SDPA kernels differ
    (torch.bfloat16, 5e-2),  # bf16 has 8 mantissa bits: relative error ~4e-3 per op
])
@pytest.mark.parametrize("variant", ["llama_gqa_untied", "qwen2_qkv_bias", "llama3_rope_scaling",
                                     "llama_head_dim_32"])
def test_cuda_logits_match_hf(variant: str, dtype: torch.dtype, tol: float,
                              tmp_path: Path) -> None:
    model = write_tiny_checkpoint(variant, tmp_path).to("cuda", dtype)
    ids = torch.randint(0, 160, (48,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None].cuda()).logits[0].float()
    pipe = LocalPipeline(LocalPipelineConfig(tmp_path, 2, dtype, torch.device("cuda"),
                                             block_size=16, num_blocks=8))
    table = [3, 1, 6, 0]
    got = [pipe.step([SeqChunk(0, 0, 40, table)], ids[:40])[0]]
    for pos in range(40, 48):
        got.append(pipe.step([SeqChunk(0, pos, 1, table)], ids[pos:pos + 1])[0])
    diff = (torch.stack(got) - ref[39:]).abs().max().item()
    assert diff < tol * ref.abs().max().item(), diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_graphs_match_eager_steps(dtype: torch.dtype, tmp_path: Path) -> None:
    """Three sequences of different lengths decode through the batch-4 graph (one padding
    row) and eagerly, from the same prefill: the same logits and greedy tokens."""
    write_tiny_checkpoint("llama_head_dim_32", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    layers = LayerRange(0, cfg.num_layers, True, True)
    runners = [StageRunner(StageRunnerConfig(tmp_path, layers, dtype, torch.device("cuda"),
                                             block_size=16, num_blocks=32, cuda_graphs=g), cfg)
               for g in (True, False)]
    assert runners[0].graphs is not None and runners[1].graphs is None
    assert runners[0].num_blocks == runners[1].num_blocks == 32
    gen = torch.Generator().manual_seed(0)
    lens = [5, 23, 40]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    tokens: list[list[list[int]]] = []
    logits: list[list[torch.Tensor]] = []
    for runner in runners:
        first = runner.execute([SeqChunk(i, 0, n, tables[i]) for i, n in enumerate(lens)],
                               torch.cat(prompts))
        nxt = first.argmax(-1)
        seq_tokens, seq_logits = [nxt.tolist()], [first]
        for step in range(12):
            out = runner.execute([SeqChunk(i, n + step, 1, tables[i])
                                  for i, n in enumerate(lens)], nxt)
            nxt = out.argmax(-1)
            seq_tokens.append(nxt.tolist())
            seq_logits.append(out)
        tokens.append(seq_tokens)
        logits.append(seq_logits)
    assert tokens[0] == tokens[1]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for got, want in zip(logits[0], logits[1], strict=True):
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()


def test_profiled_pool_with_graphs_stays_within_its_share(tmp_path: Path) -> None:
    """The serving configuration: no fixed pool size, so the runner profiles a step and its
    graphs first, sizes the pool from what is left, then captures its graphs and warms up.
    What PyTorch then reserves for it fits its `gpu_memory_utilization` (stages sharing a
    card each take a share; what one takes beyond it, the others lack)."""
    write_tiny_checkpoint("llama_head_dim_32", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    gc.collect()
    torch.cuda.empty_cache()  # earlier tests' cached blocks are not this runner's
    share = 0.05
    runner = StageRunner(StageRunnerConfig(tmp_path, LayerRange(0, cfg.num_layers, True, True),
                                           torch.bfloat16, torch.device("cuda"), block_size=16,
                                           gpu_memory_utilization=share), cfg)
    assert runner.graphs is not None and runner.mixed_graphs is not None
    assert runner.num_blocks > 0
    first = runner.execute([SeqChunk(0, 0, 20, [5, 9])], torch.arange(20))
    out = runner.execute([SeqChunk(0, 20, 1, [5, 9])], first.argmax(-1))
    assert out.shape == (1, cfg.vocab_size) and torch.isfinite(out).all()
    total = torch.cuda.mem_get_info()[1]
    assert torch.cuda.memory_reserved() <= share * total, (torch.cuda.memory_reserved(), total)


def _cuda_leader(ckpt: Path, graphs: bool) -> StageLeader:
    cfg = StageConfig(ckpt, device="cuda", dtype="float32", block_size=16, num_blocks=32,
                      max_num_batched_tokens=256, max_num_seqs=4, enforce_eager=not graphs)
    return StageLeader(build_stage_rank(cfg, TPGroup()), step_timeout_s=30.0)


def _prefill(lens: dict[int, int]) -> StagePlan:
    """Step 0: sequence s prefills `lens[s]` tokens into blocks 4s..4s+3 (64 slots)."""
    return StagePlan(0, tuple(StageNewSeq(s, tuple(range(n)), n, tuple(range(4 * s, 4 * s + 4)),
                                          0, n, True, None) for s, n in lens.items()), (), ())


def _decodes(step: int, tokens: dict[int, int], lens: dict[int, int],
             ahead: bool) -> StagePlan:
    """Step `step` decodes every sequence: its input from step - 1 (run-ahead) or appended."""
    return StagePlan(step, (), tuple(
        StageCachedSeq(s, (), lens[s] + step - 1, 1, () if ahead else (tokens[s],), True,
                       step - 1 if ahead else None) for s in sorted(lens)), ())


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_decode_step_waits_on_the_gpu_only_for_the_sampled_ids(graphs: bool,
                                                                  tmp_path: Path) -> None:
    """Everything up to the sampled ids' host copy is queued without a synchronising call
    (torch's sync debug mode raises on one); the one wait is `StepSample.resolve`."""
    write_tiny_checkpoint("llama_head_dim_32", tmp_path)
    leader = _cuda_leader(tmp_path, graphs)
    lens = {1: 5, 2: 23, 3: 40}
    tokens = leader.run_step(_prefill(lens)).sampled
    tokens = leader.run_step(_decodes(1, tokens, lens, ahead=False)).sampled  # warm-up
    rank, plan = leader.rank, _decodes(2, tokens, lens, ahead=True)
    fed = {s: rank.held.seqs[s].output_ids[-1] for s in lens}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        chunks, scores = rank.step(plan, None, fed, leader.feedback)
        assert scores is not None
        sample = rank.sample(chunks, scores)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids, _ = sample.resolve()
    assert len(ids) == 3 and sample.token_ids.device.type == "cuda"


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_one_stage_run_ahead_on_cuda_gives_the_appended_inputs_tokens(graphs: bool,
                                                                      tmp_path: Path) -> None:
    """Run-ahead inputs gathered on the device (and copied into the graphs' buffers) give
    the tokens of the same steps with the inputs appended."""
    write_tiny_checkpoint("llama_head_dim_32", tmp_path)
    lens = {1: 5, 2: 23, 3: 40}
    runs = []
    for ahead in (True, False):
        leader = _cuda_leader(tmp_path, graphs)
        tokens = leader.run_step(_prefill(lens)).sampled
        seen = [tokens]
        for step in range(1, 10):
            tokens = leader.run_step(_decodes(step, tokens, lens, ahead)).sampled
            seen.append(tokens)
        runs.append(seen)
        leader.shutdown()
    assert runs[0] == runs[1]


def test_host_transfers_on_cuda_keep_their_values() -> None:
    values = [3, -1, 2**40]
    dev = to_device(values, torch.int64, torch.device("cuda"))
    assert dev.device.type == "cuda"
    copy = HostCopy([dev * 2, torch.tensor([1.5])])
    host = copy.wait()
    assert host[0].is_pinned() and host[0].tolist() == [6, -2, 2**41]
    assert host[1].tolist() == [1.5]
