"""What loading a quantized release costs next to the bf16 one of the same model: wall time and peak RSS of
`mtp.load_model` in a fresh process, for a random-weight model of a named shape saved as bf16, as an FP8 release
(128x128 block scales), as GPTQ 4-bit and 8-bit releases (groups of 128, asymmetric / symmetric, v1 zero points) and as an AWQ GEMM
one (groups of 128, zero points), and as compressed-tensors int8 (W8A8: a scale per channel) and int4 (W4A16: symmetric
groups of 128) ones; each variant
CHECKPOINT[:QUANTIZE] loads that checkpoint with `release=True`, and `quantize=QUANTIZE` when given (what `mtp
generate [--quantize]` loads). Used for docs/decisions.md, 2026-12-01 and 2026-12-02 ("quantized loads") (issue 19).

    python scripts/quantized_load.py [--shape qwen3.5-0.8b] [--dir /tmp/mtp-qload] [--threads 1]
        [--variants bf16,fp8,gptq4,awq4,ct8,bf16:int8,bf16:int4,gptq4:int4,awq4:int4,ct8:int8] [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KEEP = ("embed_tokens", "lm_head", "mlp.gate.weight", "shared_expert_gate", "conv1d", "in_proj_a", "in_proj_b")


def quantizable(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in KEEP) and t.shape[0] % 8 == 0 \
        and t.shape[1] % 128 == 0


def release(src: Path, dst: Path, quantization_config: dict, encode) -> None:
    """The bf16 checkpoint `src` as a quantized release in `dst`: each quantizable weight (`quantizable`) replaced by
    the tensors `encode(name, weight)` gives, config.json with `quantization_config`."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        out.update(encode(name, t) if quantizable(name, t) else {name: t})
    save_file(out, dst / "model.safetensors")


def fp8_blocks(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    N, K = t.shape
    n0, n1 = -(-N // 128), -(-K // 128)
    padded = torch.zeros(n0 * 128, n1 * 128)
    padded[:N, :K] = t.float()
    s = (padded.reshape(n0, 128, n1, 128).abs().amax((1, 3)) / 448).clamp_min(1e-12)
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    return {name: (t.float() / full).to(torch.float8_e4m3fn), name + "_scale_inv": s}


def asym4(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of 128 of t [N, K]: codes int32 [N, K], scales (fp16-exact) and zero points [N, K/128]."""
    N, K = t.shape
    g = t.float().reshape(N, K // 128, 128)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp_min(1e-8).half().float()
    z = (-lo / s).round().clamp(0, 15)
    return (g / s[..., None] + z[..., None]).round().clamp(0, 15).to(torch.int32).reshape(N, K), s, z


def gptq4(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    from mtp.model.packed import pack_cols, pack_rows

    q, s, z = asym4(t)
    base = name[: -len(".weight")]
    return {base + ".qweight": pack_rows(q.t().contiguous(), 4),
            base + ".qzeros": pack_cols(((z.to(torch.int32) - 1) & 15).t().contiguous(), 4),  # v1: zero - 1
            base + ".scales": s.t().contiguous().half()}


def gptq8(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    from mtp.model.packed import pack_cols, pack_rows

    N, K = t.shape
    g = t.float().reshape(N, K // 128, 128)
    s = (g.abs().amax(-1) / 127).clamp_min(1e-8).half().float()
    q = (g / s[..., None] + 128).round().clamp(0, 255).to(torch.int32).reshape(N, K)
    base = name[: -len(".weight")]
    return {base + ".qweight": pack_rows(q.t().contiguous(), 8),
            base + ".qzeros": pack_cols(torch.full((K // 128, N), 127, dtype=torch.int32), 8),  # v1: zero - 1
            base + ".scales": s.t().contiguous().half()}


def awq4(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    from mtp.model.packed import awq_pack

    q, s, z = asym4(t)
    base = name[: -len(".weight")]
    return {base + ".qweight": awq_pack(q.t().contiguous()), base + ".qzeros": awq_pack(z.to(torch.int32).t().contiguous()),
            base + ".scales": s.t().contiguous().half()}


def int8_channels(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    s = (t.float().abs().amax(1, keepdim=True) / 127).clamp_min(1e-12).to(torch.bfloat16)
    return {name: (t.float() / s.float()).round().clamp(-127, 127).to(torch.int8),
            name[: -len(".weight")] + ".weight_scale": s}


def int4_groups(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    from mtp.model.compressed_tensors import pack

    N, K = t.shape
    g = t.float().reshape(N, K // 128, 128)
    s = (g.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = (g / s.float()[..., None]).round().clamp(-8, 7).to(torch.int32).reshape(N, K)
    base = name[: -len(".weight")]
    return {base + ".weight_packed": pack(q + 8, 4), base + ".weight_scale": s, base + ".weight_shape": torch.tensor([N, K])}


INT4_SCHEME = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
               "block_structure": None, "dynamic": False, "actorder": None}
INT8_SCHEME = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
               "block_structure": None, "dynamic": False, "actorder": None}
RELEASES = {  # checkpoint name -> (its quantization_config, the encoder of its weights)
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            fp8_blocks),
    "gptq4": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False,
               "checkpoint_format": "gptq"}, gptq4),
    "gptq8": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True, "desc_act": False,
               "checkpoint_format": "gptq"}, gptq8),
    "awq4": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, awq4),
    "ct8": ({"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": INT8_SCHEME}}, "ignore": ["lm_head"]},
            int8_channels),  # compressed-tensors W8A8: symmetric int8 codes, one bf16 scale per output channel
    "ct4": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": INT4_SCHEME}}, "ignore": ["lm_head"]},
            int4_groups),  # compressed-tensors W4A16: symmetric int4 codes in groups of 128, packed 8 a word
}


PROBE = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
import mtp
q = sys.argv[3] or None
t0 = time.perf_counter()
m = mtp.load_model(sys.argv[1], release=True, **({} if q is None else dict(dtype="bfloat16", quantize=q)))
t = time.perf_counter() - t0
# the high-water mark of this process's own memory (ru_maxrss carries the parent's peak across fork and exec), and
# what it holds after the load
status = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("Vm")}
print(f"{t:.2f} {status['VmHWM'] / 1024:.0f} {status['VmRSS'] / 1024:.0f} {m.dtype}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.5-0.8b")
    p.add_argument("--dir", type=Path, default=Path("/tmp/mtp-qload"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default="bf16,fp8,gptq4")
    p.add_argument("--runs", type=int, default=1, help="loads per variant, interleaved (each a fresh process)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import mtp
    from mtp.bench.costmodel import build_shape_model

    bf16 = args.dir / "bf16"
    if not (bf16 / "model.safetensors").exists():
        mtp.save_model(build_shape_model(args.shape, torch.bfloat16), bf16)
    for name, (qc, encode) in RELEASES.items():
        if not (args.dir / name / "model.safetensors").exists():
            release(bf16, args.dir / name, qc, encode)
    print(f"{args.shape}, {args.threads} thread(s): load_model in a fresh process (after one warm-up read of the files)")
    variants = args.variants.split(",")
    for name in {v.split(":")[0] for v in variants}:  # warm the page cache
        subprocess.run([sys.executable, "-c", PROBE, str(args.dir / name), str(args.threads), ""], capture_output=True,
                       check=True)
    for _ in range(args.runs):
        for v in variants:
            name, _, quantize = v.partition(":")
            path = args.dir / name
            size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
            r = subprocess.run([sys.executable, "-c", PROBE, str(path), str(args.threads), quantize], capture_output=True,
                               text=True, check=True)
            t, rss, after, dtype = r.stdout.split()
            print(f"  {v:11s} files {size:5.2f} GB   load {float(t):6.2f} s   peak RSS {float(rss) / 1024:5.2f} GB   "
                  f"after {float(after) / 1024:5.2f} GB   ({dtype})", flush=True)


if __name__ == "__main__":
    main()
