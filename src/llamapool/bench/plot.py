"""``llamapool bench --plot FILE``: the rows of a run drawn as a PNG, where matplotlib is installed (it is
no dependency of llamapool: without it the plot is skipped, and said so).

- workload rows (``mode`` "service"): tok/s against concurrency, a line per workload and transport;
- ``speculation-summary`` rows: tok/s with speculation on and off, a pair of bars per case and C;
- ``pool-churn`` rows: the busy model's tok/s and inter-token p99 alone and beside the churn.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def plot(rows: list[dict[str, Any]], path: str) -> str:
    """Draw ``rows`` to ``path``; returns what was done (or why not)."""
    try:
        import matplotlib
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib), {path} not written"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    kinds = {r.get("mode") for r in rows}
    if "pool-churn" in kinds:
        _churn(ax, [r for r in rows if r.get("mode") == "pool-churn"])
    elif "speculation-summary" in kinds:
        _bars(ax, [r for r in rows if r.get("mode") == "speculation-summary"])
    else:
        series: dict[str, dict[int, float]] = defaultdict(dict)
        for r in rows:
            if r.get("mode") == "service" and r.get("concurrency"):
                series[f"{r['workload']} ({r['transport']})"][r["concurrency"]] = r["tok_s"]
        if not series:
            plt.close(fig)
            return f"no plot: no rows to draw, {path} not written"
        for label, pts in series.items():
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("tokens/s")
        ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def _bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    labels = [f"{r['case']}\nC={r['concurrency']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["on_tok_s"] for r in rows], 0.4, label="speculation on")
    ax.bar([x + 0.2 for x in xs], [r["off_tok_s"] for r in rows], 0.4, label="off")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("tokens/s")
    ax.legend()


def _churn(ax: Any, rows: list[dict[str, Any]]) -> None:
    labels = [f"C={r['concurrency']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["alone_tok_s"] for r in rows], 0.4, label="busy alone")
    ax.bar([x + 0.2 for x in xs], [r["churn_tok_s"] for r in rows], 0.4, label="busy beside the churn")
    for x, r in zip(xs, rows, strict=True):
        note = f"{r['tok_s_vs_alone']:.3f}x, ITL p99 {r['alone_itl_p99_ms']:.0f} -> {r['churn_itl_p99_ms']:.0f} ms"
        ax.annotate(note, (x, r["churn_tok_s"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("busy model's tokens/s")
    ax.legend()


def main(argv: list[str]) -> int:
    """``python -m llamapool.bench.plot ROWS.jsonl OUT.png``: a plot of rows written earlier (``--out``)."""
    if len(argv) != 2:
        print("usage: python -m llamapool.bench.plot ROWS.jsonl OUT.png", file=sys.stderr)
        return 2
    rows = [json.loads(x) for x in Path(argv[0]).read_text().splitlines() if x.strip()]
    print(plot(rows, argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
