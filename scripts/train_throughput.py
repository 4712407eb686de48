"""Training throughput of the code-small preset, before (fp32, 1 thread, eager: the first release's recipe) and
after (bf16 autocast, compiled objective, 2 threads), measured in alternating processes (A B A B) on one data folder.

    python scripts/train_throughput.py --data DATA [--steps 12] [--repeats 2] [--shape old|new]

Each measurement is a fresh `mtp train` run (so compile time is visible separately) whose metrics.jsonl gives the
per-step tokens/s; the first steps (warm-up, compilation) are dropped and the median of the rest is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The first release's code-small shape (9.4M parameters) and the current preset's (20.2M).
OLD_MODEL = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=8, full_attention_interval=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=64,
                 linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096, rope_theta=10000.0,
                 partial_rotary_factor=0.25, tie_word_embeddings=True, mtp_num_hidden_layers=1)
RECIPES = {
    "before (fp32, 1 thread, eager)": ["bf16=false", "compile=false", "threads=1"],
    "after (bf16 autocast, compiled, 2 threads)": ["bf16=true", "compile=true", "threads=2"],
}


def run(data: Path, overrides: list[str], steps: int, shape: str) -> tuple[float, float]:
    """One training run: (median tokens/s after the warm-up steps, seconds to the first step)."""
    out = Path(tempfile.mkdtemp(prefix="mtp-tput-"))
    try:
        model = [f"model={json.dumps(OLD_MODEL)}", "seq_len=256", "micro_batch=8"] if shape == "old" else []
        cmd = [sys.executable, "-m", "mtp.cli", "train", "--preset", "code-small", f"data={data}", f"out={out}",
               f"max_steps={steps}", f"eval_every={steps * 10}", f"save_every={steps * 10}", "progress=false", *model, *overrides]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["split"] == "train"]
        first = sum(2048 / r["tok_s"] for r in train[:2])  # steps 1-2: warm-up and compilation
        return statistics.median(r["tok_s"] for r in train[2:]), first
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a data folder built by `mtp data`")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shape", choices=["old", "new"], default="old", help="old: the first release's 9.4M shape; new: the preset's")
    args = ap.parse_args()
    results: dict[str, list[float]] = {name: [] for name in RECIPES}
    for _ in range(args.repeats):
        for name, overrides in RECIPES.items():
            tok_s, warm = run(args.data, overrides, args.steps, args.shape)
            results[name].append(tok_s)
            print(f"{name}: {tok_s:,.0f} tokens/s (first two steps {warm:.0f} s)", flush=True)
    med = {name: statistics.median(v) for name, v in results.items()}
    before, after = med.values()
    print(f"\n| recipe | tokens/s (median of {args.repeats}) |\n|---|---:|")
    for name, v in med.items():
        print(f"| {name} | {v:,.0f} |")
    print(f"\nafter / before = {after / before:.2f}x ({args.shape} shape, {args.steps} steps per run)")


if __name__ == "__main__":
    main()
