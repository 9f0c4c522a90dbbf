"""Profile a running mesh under a throughput load: py-spy samples of the router's front, its
engine core and stage 0 while `benchmarks.throughput`-style requests run, each written raw
and summarized (the functions that hold the most samples, on their own and with what they
call). Diagnostic, not a benchmark.

    python -m benchmarks.profile_mesh --model DIR --device cuda --out-dir OUT
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
from collections import Counter
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
        pids = {"front": mesh.pids["router"], "core": core_pid(mesh.pids["router"]),
                "stage0": mesh.pids["stage 0"]}
        cmds = [[spy, "record", "-p", str(pid), "-d", str(args.duration), "-r", "100",
                 "-f", "raw", "-o", str(args.out_dir / f"{name}.txt"), "--nonblocking"]
                for name, pid in pids.items()]
        sleeper = ["sleep", str(args.delay)]
        procs = [subprocess.Popen(" ".join(sleeper) + " && " + " ".join(c), shell=True)
                 for c in cmds]
        print(run(mesh.address, prompts, args.output_len), flush=True)
        for p in procs:
            p.wait()
    for name in pids:
        raw = args.out_dir / f"{name}.txt"
        if raw.exists():
            summary = summarize(raw.read_text())
            (args.out_dir / f"{name}-summary.txt").write_text(summary)
            print(f"== {name}\n{summary}")


def core_pid(router_pid: int) -> int:
    """The router's engine core process (its child running router.core.process)."""
    out = subprocess.run(["pgrep", "-P", str(router_pid), "-f", "router.core.process"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def summarize(raw: str, top: int = 25) -> str:
    """py-spy's raw (collapsed) stacks -> the busiest functions: self share, then share with
    callees, of all samples."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    n = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        k = int(count)
        n += k
        frames = [f.split(":")[0] + ")" if " (" in f else f for f in stack.split(";")]
        own[frames[-1]] += k
        for frame in set(frames):
            total[frame] += k
    lines = [f"{n} samples", "-- self"]
    lines += [f"{100 * k / n:5.1f}% {f}" for f, k in own.most_common(top)]
    lines += ["-- with callees"]
    lines += [f"{100 * k / n:5.1f}% {f}" for f, k in total.most_common(top)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
