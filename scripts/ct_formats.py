"""Load time and plain decode speed per checkpoint format, compressed-tensors among them, for one random-weight
Qwen3.5 model small enough to run in minutes (hidden 512, 8 layers, vocabulary 32k: ~45M parameters) - every
number from a fresh process. Formats: bf16; compressed-tensors pack-quantized written by `mtp quantize` (int4
asymmetric g128 = `--quantize int4`'s codes, int4 symmetric, int8 channels); compressed-tensors float-quantized fp8
(128x128 blocks); FP8 and GPTQ-4bit releases (scripts/quantized_load.py's converters) for comparison. Each loads
decoded to bf16 and decodes with the bf16 kernels; `--quantize int4` re-quantizes at load and decodes with the int4
kernel. Used for docs/decisions.md, 2026-12-01 (issue 19, compressed-tensors).

    python scripts/ct_formats.py [--dir /tmp/mtp-ct] [--threads 1] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_load import quantizable, to_fp8, to_gptq  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=64,
             linear_value_head_dim=64, full_attention_interval=4, tie_word_embeddings=True, mtp_num_hidden_layers=1,
             max_position_embeddings=4096, model_type="qwen3_5_text")


def to_ct_fp8(src: Path, dst: Path) -> None:
    """compressed-tensors float-quantized: float8_e4m3fn weights, bf16 scales per 128x128 block (FP8_BLOCK)."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "group_size": None,
         "block_structure": [128, 128], "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                  "quantization_status": "compressed", "ignore": ["lm_head", "re:mtp.*"],
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        if not quantizable(name, t) or name.startswith("mtp."):
            out[name] = t
            continue
        N, K = t.shape
        n0, n1 = -(-N // 128), -(-K // 128)
        padded = torch.zeros(n0 * 128, n1 * 128)
        padded[:N, :K] = t.float()
        s = (padded.reshape(n0, 128, n1, 128).abs().amax((1, 3)) / 448).clamp_min(1e-12).to(torch.bfloat16)
        full = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
        base = name.removesuffix(".weight")
        out[name], out[base + ".weight_scale"] = (t.float() / full).to(torch.float8_e4m3fn), s
    save_file(out, dst / "model.safetensors")


PROBE = """
import sys, time, warnings, torch
torch.set_num_threads(int(sys.argv[2]))
warnings.simplefilter("ignore")
import mtp
t0 = time.perf_counter()
m = mtp.load_model(sys.argv[1], quantize=None if sys.argv[3] == "-" else sys.argv[3])
load = time.perf_counter() - t0
prompt = torch.randint(0, m.config.vocab_size, (16,), generator=torch.Generator().manual_seed(0)).tolist()
mtp.generate(m, prompt, max_new_tokens=8)  # warm-up
r = mtp.generate(m, prompt, max_new_tokens=int(sys.argv[4]))
print(f"{load:.2f} {r.stats.tokens_per_second:.1f}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/mtp-ct"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import mtp
    from mtp.model import config_from_dict
    from mtp.model.families import model_class_for
    from mtp.quantize import quantize_checkpoint

    bf16 = args.dir / "bf16"
    if not (bf16 / "model.safetensors").exists():
        model = model_class_for(config_from_dict(dict(SHAPE)))(config_from_dict(dict(SHAPE)))
        mtp.save_model(model.to(torch.bfloat16), bf16)
    makers = {"ct-w4a16-asym": lambda s, d: quantize_checkpoint(s, d),
              "ct-w4a16-sym": lambda s, d: quantize_checkpoint(s, d, symmetric=True),
              "ct-w8a16": lambda s, d: quantize_checkpoint(s, d, bits=8),
              "ct-fp8-block": to_ct_fp8, "fp8-block": to_fp8, "gptq-4bit": to_gptq}
    for name, make in makers.items():
        if not (args.dir / name / "model.safetensors").exists():
            make(bf16, args.dir / name)
    print(f"Qwen3.5 hidden 512 x 8 layers, vocab 32000; {args.threads} thread(s); load_model and a plain decode of "
          f"{args.tokens} tokens, fresh process each (after one warm-up read of the files)")
    for name in ("bf16", *makers):
        path = args.dir / name
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
        for f in path.glob("*.safetensors"):  # warm the page cache: every load reads from memory
            f.read_bytes()
        cells = []
        for quantize in ("-", "int4"):
            cmd = [sys.executable, "-c", PROBE, str(path), str(args.threads), quantize, str(args.tokens)]
            r = subprocess.run(cmd, capture_output=True, text=True, check=True)
            load, tps = r.stdout.split()
            cells.append(f"load {float(load):5.2f} s, {float(tps):5.1f} tok/s")
        print(f"  {name:14s} {size:6.1f} MB   as loaded: {cells[0]}   --quantize int4: {cells[1]}")


if __name__ == "__main__":
    main()
