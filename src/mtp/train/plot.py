"""The training metrics plot (`loss.png` beside the run's metrics)."""

from __future__ import annotations

import math
import os
from pathlib import Path


def plot_metrics(out: Path, rows: list[dict]) -> None:
    """Write out/loss.png (train and validation losses per depth against tokens) atomically; no-op without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tr = [r for r in rows if r.get("split") == "train"]
    va = [r for r in rows if r.get("split") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        x = [r["tokens"] for r in tr]
        ax.plot(x, [r["main"] for r in tr], lw=0.8, label="train L_main")
        for d in range(len(tr[-1]["mtp"])):
            ax.plot(x, [r["mtp"][d] if d < len(r["mtp"]) else math.nan for r in tr], lw=0.8, label=f"train L_{d + 1}")
    if va:
        x = [r["tokens"] for r in va]
        ax.plot(x, [r["loss"] for r in va], "o-", label="val L_main")
        for d in range(1, 9):
            if f"loss_{d}" in va[-1]:
                ax.plot(x, [r.get(f"loss_{d}", math.nan) for r in va], "s--", label=f"val L_{d}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out / ".loss.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out / "loss.png")
