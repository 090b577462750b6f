#!/usr/bin/env python3
"""Plot tokens/s against concurrency, service vs engine ceiling, from gpu_bench.py's JSON lines.

    python scripts/plot_bench.py docs/results/h200-1gpu.jsonl docs/bench-h200.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(src: str, dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # gpu_bench.py's rows: older runs (one workload, several C) and newer ones (per workload; only
    # llamapool's 'short' rows and ceilings are plotted)
    rows = [r for r in (json.loads(line) for line in open(src)) if r.get("workload", "short") == "short"
            and r.get("service", "llamapool") == "llamapool"]
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r.get("mode") == "service" and r.get("gpus", 1) == 1 and "variant" not in r and "sweep_key" not in r:
            series["llamapool service (SDK, streaming)"][r["concurrency"]] = r["tok_s"]
        elif r.get("mode") == "ceiling":
            kind = "GPU" if r["gpu_sampling"] else "CPU"
            series[f"ceiling: llama.cpp alone, {kind} sampling"][r["concurrency"]] = r["e2e_tok_s"]
            if r["gpu_sampling"]:
                series["ceiling, decode steps only, GPU sampling"][r["concurrency"]] = r["decode_tok_s"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = {"llamapool": ("o-", 2.5), "ceiling: llama.cpp alone, GPU": ("s--", 1.5),
              "ceiling: llama.cpp alone, CPU": ("^--", 1.2), "ceiling, decode": (":", 1.2)}
    for name, pts in series.items():
        xs = sorted(pts)
        style, width = next(v for k, v in styles.items() if name.startswith(k))
        ax.plot(xs, [pts[x] for x in xs], style, linewidth=width, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for pts in series.values() for c in pts}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent streams (C)")
    ax.set_ylabel("generated tokens/s (prefill included)")
    ax.set_title("One H200, 1B-shape Q8_0 model, 128-token prompts, 128 generated")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
