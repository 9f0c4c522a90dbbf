"""Latency percentiles against request rate, one line per path, from a W5 run's rows.

`benchmarks.serving` calls it after a run; to draw a run's JSON again (or where the run had
no matplotlib), or the rates of several runs in one plot:

    python -m benchmarks.serving_plot benchmarks/results/w5-cuda-DATE.json [--out PNG]
    python -m benchmarks.serving_plot w5-rate2.json w5-rate8-32.json --out w5.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# (panel title, [(row key, line label suffix, line style)], SLO key in config["goodput_slo"])
PANELS = (
    ("TTFT", [("ttft_ms_p50", "p50", "-"), ("ttft_ms_p99", "p99", "--")], "ttft_ms"),
    ("TPOT", [("tpot_ms_p50", "p50", "-"), ("tpot_ms_p99", "p99", "--")], "tpot_ms"),
    ("ITL", [("itl_ms_p99", "p99", "--")], None),
)


def plot_latency_vs_rate(rows: list[dict[str, Any]], png: Path,
                         config: dict[str, Any] | None = None) -> bool:
    """Write the plot to `png`; False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    config = config or {}
    paths = [p for p in dict.fromkeys(r["path"] for r in rows) if "/" not in p]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2))
    colors = dict(zip(paths, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    rates = sorted({r["rate"] for r in rows})
    for ax, (title, lines, slo_key) in zip(axes, PANELS, strict=True):
        for path in paths:
            mine = sorted((r for r in rows if r["path"] == path), key=lambda r: r["rate"])
            for key, label, style in lines:
                ax.plot([r["rate"] for r in mine], [r[key] for r in mine], style, marker="o",
                        color=colors[path], label=f"{path} {label}")
        slo = (config.get("goodput_slo") or {}).get(slo_key) if slo_key else None
        if slo is not None:
            ax.axhline(slo, color="grey", linestyle=":", label=f"goodput SLO {slo:g} ms")
        if len(rates) > 1 and rates[-1] / rates[0] >= 4:
            ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    shape = config.get("shape") or {}
    name = (config.get("served") or {}).get("model") or Path(str(config.get("model"))).name
    fig.suptitle(
        f"W5 serving latency: {name}"
        f" ({shape.get('num_hidden_layers', '?')} layers, hidden {shape.get('hidden_size', '?')}"
        f"), {config.get('device', '?')}, {config.get('stages', '?')} stage(s), TP "
        f"{config.get('tp', '?')}, {config.get('prompt_len', '?')} prompt / "
        f"{config.get('output_len', '?')} output tokens, rev {config.get('revision', '?')}",
        fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, nargs="+",
                    help="benchmarks.serving JSON files (several: their rates together, "
                         "e.g. one run per rate)")
    ap.add_argument("--out", type=Path, help="PNG (default: next to the first JSON)")
    args = ap.parse_args()
    docs = [json.loads(p.read_text()) for p in args.json]
    rows = [r for d in docs for r in d["results"]]
    png = args.out or args.json[0].with_suffix(".png")
    if not plot_latency_vs_rate(rows, png, docs[0].get("config")):
        raise SystemExit("matplotlib is not installed")
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
