"""Which kernel variants compile after warm-up in test_warm_up's graphs=True scenario, with
each launch's argument signature and the Python frames that launched it."""
import random, sys, traceback, tempfile
from pathlib import Path
import torch
import triton.runtime.jit as jit
from foundation.model_config import ModelConfig
from stage_worker.partition import LayerRange
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

tmp = Path(tempfile.mkdtemp())
write_tiny_checkpoint("llama_gqa_untied", tmp)
cfg = ModelConfig.from_dir(tmp)
print("hidden", cfg.hidden_size, "inter", getattr(cfg, "intermediate_size", None))
runner = StageRunner(StageRunnerConfig(tmp, LayerRange(0, cfg.num_layers, True, True), torch.bfloat16,
                                       torch.device("cuda"), block_size=16, num_blocks=64,
                                       max_num_batched_tokens=512, max_num_seqs=32, cuda_graphs=True), cfg)
original_run = jit.JITFunction.run
current = {}
def run(self, *args, **kwargs):
    current["sig"] = (self.__name__, [(tuple(a.shape), a.stride(), a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a for a in args])
    return original_run(self, *args, **kwargs)
jit.JITFunction.run = run
original = jit.JITFunction._do_compile
def counting(self, *args, **kwargs):
    print("COMPILE", current.get("sig"), flush=True)
    print("".join(l for l in traceback.format_stack(limit=14)[:-2] if "stagemesh" in l or "stage_worker" in l or "kernels" in l or "models" in l))
    return original(self, *args, **kwargs)
jit.JITFunction._do_compile = counting
rng = random.Random(0)
for n in range(60):
    decodes = rng.randint(0, 31)
    prefills = rng.randint(0 if decodes else 1, 32 - decodes)
    chunks = [SeqChunk(i, rng.randint(0, 400), 1, range(26)) for i in range(decodes)]
    budget = 512 - decodes
    for j in range(prefills):
        q = rng.randint(1, max(1, min(312, budget // (prefills - j))))
        budget -= q
        chunks.append(SeqChunk(decodes + j, rng.randint(0, 200), q, range(32)))
    tokens = sum(c.num_new for c in chunks)
    print(f"step {n}: {decodes} decodes, {prefills} prefills, {tokens} tokens", flush=True)
    out = runner.execute(chunks, torch.randint(0, cfg.vocab_size, (tokens,)))
torch.cuda.synchronize()
