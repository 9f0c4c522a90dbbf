"""Profile a running mesh under a throughput load: py-spy samples of the router and of
stage 0 while `benchmarks.throughput`-style requests run. Diagnostic, not a benchmark.

    python -m benchmarks.profile_mesh --model DIR --device cuda --out-dir OUT
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
from pathlib import Path

from benchmarks.throughput import run
from stagemesh.local_mesh import Mesh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--delay", type=float, default=20.0, help="seconds before sampling")
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    args = ap.parse_args()
    spy = shutil.which("py-spy") or "py-spy"
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    with Mesh("--model", args.model, "--stages", "1", "--device", args.device,
              "--max-num-batched-tokens", "4096", timeout=900) as mesh:
        cmds = [[spy, "record", "-p", str(mesh.pids[role]), "-d", str(args.duration), "-r", "100",
                 "-f", "raw", "-o", str(args.out_dir / f"{role.replace(' ', '')}.txt"),
                 "--nonblocking"] for role in ("router", "stage 0")]
        sleeper = ["sleep", str(args.delay)]
        procs = [subprocess.Popen(" ".join(sleeper) + " && " + " ".join(c), shell=True)
                 for c in cmds]
        print(asyncio.run(run(mesh.address, prompts, args.output_len)), flush=True)
        for p in procs:
            p.wait()


if __name__ == "__main__":
    main()
