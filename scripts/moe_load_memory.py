"""Peak resident memory of loading a ~1 GB synthetic Qwen3.5-MoE checkpoint, relative to its weights' size.

    python scripts/moe_load_memory.py --out /tmp/moe-mem    # writes the checkpoints once, then measures

Each case loads in a fresh process (so the peak is that load's own) and runs one forward afterwards, which
touches every weight. Reported: (peak RSS - RSS before loading) / bytes of weights, after loading and after the
forward. Layouts: per expert (stacked into the fused form at load) and fused (memory-mapped as is).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIG = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=5, full_attention_interval=5, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
              linear_value_head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False, mtp_num_hidden_layers=1,
              num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
              model_type="qwen3_5_moe_text")


def status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def build(out: Path) -> None:
    import torch

    import mtp
    from mtp.model import config_from_dict
    from mtp.model.families import model_class_for

    config = config_from_dict(dict(CONFIG))
    with torch.device("meta"):
        model = model_class_for(config)(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for layout in ("per_expert", "fused"):
        prefixes = [n[: -len(".gate_up_proj")] for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
        model.checkpoint_layout = {p: layout for p in prefixes}
        mtp.save_model(model, out / layout, max_shard_size=400 * 2**20)


def measure(path: Path, dtype: str) -> dict:
    import torch

    import mtp

    torch.set_num_threads(1)
    before = status_mb("VmRSS")
    model = mtp.load_model(path, dtype=dtype)
    loaded = status_mb("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]))
        list(model.mtp_hidden_states(torch.tensor([[1, 2, 3, 4]]), 1))
    after = status_mb("VmHWM")
    return {"weights_mb": round(weights, 1), "rss_before_mb": round(before, 1), "peak_after_load_mb": round(loaded, 1),
            "peak_after_forward_mb": round(after, 1), "load_ratio": round((loaded - before) / weights, 3),
            "forward_ratio": round((after - before) / weights, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe-mem"))
    ap.add_argument("--measure", nargs=2, metavar=("PATH", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1])))
        return
    if not (args.out / "fused" / "config.json").exists():
        build(args.out)
    rows = {}
    for layout in ("per_expert", "fused"):
        for dtype in ("auto", "float32"):
            r = subprocess.run([sys.executable, __file__, "--measure", str(args.out / layout), dtype],
                               capture_output=True, text=True, check=True)
            rows[f"{layout}, dtype {dtype}"] = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{layout:>10}, dtype {dtype:>7}: {rows[f'{layout}, dtype {dtype}']}", flush=True)
    (args.out / "memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
