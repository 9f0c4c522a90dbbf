"""Which kernel variants compile after start-up in test_warm_up's graphs=True scenario (the
head-dim-8 model), with each launch's arguments (shape, strides, pointer % 16) and the
frames that launched it. Run on the GPU machine from the repository root."""

import random
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import triton.runtime.jit as jit

from foundation.model_config import ModelConfig
from stage_worker.partition import LayerRange
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

OURS = ("stage_worker", "kernels", "models")


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    write_tiny_checkpoint("llama_gqa_untied", tmp)
    cfg = ModelConfig.from_dir(tmp)
    runner = StageRunner(StageRunnerConfig(
        tmp, LayerRange(0, cfg.num_layers, True, True), torch.bfloat16, torch.device("cuda"),
        block_size=16, num_blocks=64, max_num_batched_tokens=512, max_num_seqs=32,
        cuda_graphs=True), cfg)
    launched: dict[str, Any] = {}
    original_run, original_compile = jit.JITFunction.run, jit.JITFunction._do_compile

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        launched["sig"] = (self.__name__, [
            (tuple(a.shape), a.stride(), a.data_ptr() % 16) if isinstance(a, torch.Tensor)
            else a for a in args])
        return original_run(self, *args, **kwargs)

    def compile_(self: Any, *args: Any, **kwargs: Any) -> Any:
        print("COMPILE", launched.get("sig"), flush=True)
        frames = traceback.format_stack(limit=14)[:-2]
        print("".join(f for f in frames if any(o in f for o in OURS)))
        return original_compile(self, *args, **kwargs)

    jit.JITFunction.run = run  # type: ignore[method-assign]
    jit.JITFunction._do_compile = compile_  # type: ignore[method-assign]
    rng = random.Random(0)  # the test's steps
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
        runner.execute(chunks, torch.randint(0, cfg.vocab_size, (tokens,)))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
