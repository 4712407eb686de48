"""`mtp quantize MODEL OUT`: write a model with int4 (or int8) weights as a compressed-tensors checkpoint
(pack-quantized: the format llm-compressor writes and vLLM and transformers read), which `mtp` loads again.

The weights are the ones `--quantize int4` runs in memory (model/linear.py): every linear layer and routed expert
in int4 with asymmetric groups (round to nearest, `Int4Weight.quantize`; groups of 128, else 64 / 32 by the input
width, or `--group-size`), int8 with symmetric per-channel scales (`quantize_int8`) where the int4 kernel cannot run
a shape; `--bits 8` writes every layer in int8; `--symmetric` writes int4 with symmetric groups (no zero points),
which transformers 5.24 with compressed-tensors 0.20.1 loads (it cannot load asymmetric pack-quantized checkpoints;
vLLM reads both). Kept in bf16 and listed in the config's `ignore`: the output heads (as llm-compressor keeps
`lm_head`), each family's `precise_layers` (the MTP's input projection, routers) and - unless
`--quantize-mtp` - the MTP layers, which quantizers usually leave unquantized (their acceptance is what speculative
decoding is worth). Routed experts are written per expert (`experts.{e}.gate_proj`...), the layout vLLM's
compressed-tensors MoE reads. Config groups: the most common scheme targets "Linear", the others name their modules
(an exact name wins over a class name in compressed-tensors' matching, config/compressed_tensors.py). The write is
atomic (`save_model`): a failed write leaves OUT as it was.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from .model.compressed_tensors import encode_int4, encode_int8
from .model.linear import INT4_KERNEL_GROUPS, Int4Weight, int4_group_for, int4_supported, quantize_int8
from .model.moe import split_experts

EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj$")  # a routed expert's projection, per-expert names
HEADS = ("lm_head", "shared_head.head")  # output heads: kept in bf16, as quantizers keep lm_head
VERSION = "0.20.1"  # the compressed-tensors version whose layout is written (and tested against)


def plan_layer(model, name: str, t: torch.Tensor, bits: int, group: int | None, quantize_mtp: bool,
               symmetric: bool = False) -> tuple | None:
    """How tensor `name` (our name, experts per expert) is written: None (not a matrix, or an embedding: as it is),
    ("keep",) (a linear layer, or another module's matrix, kept in bf16: in `ignore`), ("int4", group, symmetric) or
    ("int8",)."""
    if t.dim() != 2 or not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight")
    if not EXPERT.search(module):
        try:
            linear = isinstance(model.get_submodule(module), nn.Linear)
        except AttributeError:
            linear = False
        if not linear:  # a matrix of another module (a router with a bias, say): readers may hold it in a Linear
            return None if "embed" in module else ("keep",)
    mtp_layer = model.is_mtp_tensor(model.checkpoint_name(name, model.config), model.config)
    if module.endswith(HEADS) or any(module.endswith(s) for s in model.precise_layers()) or (mtp_layer and not quantize_mtp):
        return ("keep",)
    N, K = t.shape
    g = group or int4_group_for(K)
    if bits == 4 and g is not None and int4_supported(N, K, g):
        return ("int4", g, symmetric)
    return ("int8",)


def weights_config(kind: tuple) -> dict:
    """A scheme's `weights` object, as compressed-tensors writes it."""
    int4 = kind[0] == "int4"
    return {"num_bits": 4 if int4 else 8, "type": "int", "symmetric": kind[2] if int4 else True,
            "strategy": "group" if int4 else "channel", "group_size": kind[1] if int4 else None, "block_structure": None,
            "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


@torch.no_grad()
def quantized_state(model, bits: int = 4, group: int | None = None, quantize_mtp: bool = False,
                    symmetric: bool = False) -> tuple[dict[str, torch.Tensor], dict, Counter]:
    """The model's tensors as a pack-quantized checkpoint: (checkpoint name -> tensor, quantization_config,
    counts of the layers per kind)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    modules: dict[tuple, list[str]] = {}
    for name, t in split_experts(state, {}).items():
        ck = model.checkpoint_name(name, model.config)
        kind = plan_layer(model, name, t, bits, group, quantize_mtp, symmetric)
        if kind is not None:
            modules.setdefault(kind, []).append(ck.removesuffix(".weight"))
        if kind is None or kind == ("keep",):
            out[ck] = t
            continue
        base = ck.removesuffix(".weight")
        if kind[0] == "int4":
            enc = encode_int4(Int4Weight.quantize(t, kind[1], kind[2]), kind[2])
        else:
            enc = encode_int8(*quantize_int8(t))
        out.update({f"{base}.{k}": v for k, v in enc.items()})
    ignore = modules.pop(("keep",), [])
    if model.config.tie_word_embeddings and "lm_head" not in ignore:
        ignore.insert(0, "lm_head")  # not stored (tied), but a Linear in the model that reads the checkpoint
    if not modules:
        raise ValueError("no linear layer to quantize (every one is kept in bf16)")
    kinds = sorted(modules, key=lambda k: -len(modules[k]))
    groups = {f"group_{i}": {"targets": ["Linear"] if i == 0 else modules[k], "weights": weights_config(k),
                             "input_activations": None, "output_activations": None, "format": "pack-quantized"}
              for i, k in enumerate(kinds)}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
          "sparsity_config": {}, "transform_config": {}, "version": VERSION}
    counts = Counter({(f"int4 g{k[1]}{' sym' * k[2]}" if k[0] == "int4" else "int8"): len(v) for k, v in modules.items()})
    counts["bf16 (ignore)"] = len(ignore)
    return out, qc, counts


def quantize_checkpoint(src: str | Path, out: str | Path, bits: int = 4, group: int | None = None,
                        quantize_mtp: bool = False, symmetric: bool = False, max_shard_size: int | None = 5 << 30) -> Counter:
    """Load `src` (bf16), write its quantized checkpoint to `out` (atomic); returns the layer counts per kind."""
    from .model.checkpoint import load_model, save_model

    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group is not None and (bits != 4 or group <= 0 or group % INT4_KERNEL_GROUPS[0]):
        raise ValueError(f"group size {group}: give a multiple of {INT4_KERNEL_GROUPS[0]} (the int4 kernel's groups), "
                         "with bits 4")
    model = load_model(src, dtype="bfloat16")
    state, qc, counts = quantized_state(model, bits, group, quantize_mtp, symmetric)
    save_model(model, out, max_shard_size=max_shard_size, state=state, quantization_config=qc)
    return counts


def cmd_quantize(args) -> int:
    try:
        counts = quantize_checkpoint(args.model, args.out, args.bits, args.group_size, args.quantize_mtp, args.symmetric)
    except (OSError, ValueError) as e:  # ConfigError, CheckpointError, a missing file: one line
        raise SystemExit(f"mtp quantize: error: {e}") from None
    print(f"mtp quantize: {args.model} -> {args.out} (compressed-tensors pack-quantized): "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + " linear layers")
    return 0


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write a model's weights in int4 (or int8) as a compressed-tensors checkpoint "
                       "(vLLM / transformers / mtp read it)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="the checkpoint folder (or hub id) to quantize")
    p.add_argument("out", help="the folder to write (config.json with quantization_config, model.safetensors, tokenizer)")
    p.add_argument("--bits", type=int, choices=[4, 8], default=4,
                   help="4: int4 groups (int8 where the int4 kernel cannot run a shape); 8: int8 per channel")
    p.add_argument("--group-size", type=int, default=None,
                   help="inputs per int4 scale, a multiple of 32 (default: 128, else 64 / 32 by the layer's width, as "
                        "--quantize int4)")
    p.add_argument("--symmetric", action="store_true",
                   help="int4 with symmetric groups (no zero points): what transformers 5.24 with compressed-tensors "
                        "0.20.1 loads; the default asymmetric groups are exactly --quantize int4's (vLLM reads both)")
    p.add_argument("--quantize-mtp", action="store_true",
                   help="quantize the MTP layers too (default: kept in bf16 and listed in `ignore`)")
    p.set_defaults(func=cmd_quantize)
