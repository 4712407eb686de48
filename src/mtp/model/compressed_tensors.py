"""compressed-tensors checkpoints (llm-compressor / vLLM's format): their stored tensors, checked on the headers and
decoded once at load into the float weight they stand for, as model/quantized.py decodes FP8, GPTQ and AWQ (which
wraps the checkpoint index with the entries built here); and the packing, for `mtp quantize` (quantize.py), which
writes such checkpoints.

What a module X (a linear layer, weight [N out, K in]) stores, by its scheme's format (config/compressed_tensors.py):
- "pack-quantized" (int, 4 or 8 bits): `X.weight_packed` int32 [N, ceil(K * bits / 32)], 32 / bits codes per word
  along the inputs (input k in word k // per at bits (k % per) * bits), each stored as q + 2^(bits-1) (q signed, in
  -2^(bits-1)..2^(bits-1)-1); `X.weight_shape` int [2] = [N, K]; `X.weight_scale`; asymmetric: `X.weight_zero_point`
  (strategy group / channel: signed zero points packed the same way along the outputs, int32 [ceil(N * bits / 32), G];
  tensor: int [1]); activation order "group" (GPTQ): `X.weight_g_idx` int [K], the group of each input.
- "int-quantized" / "naive-quantized" (int): `X.weight` int8 [N, K] (q itself), `X.weight_scale`, asymmetric
  `X.weight_zero_point` (int, the scale's shape).
- "float-quantized" (or "naive-quantized" with float weights): `X.weight` float8_e4m3fn [N, K], `X.weight_scale`.
Scale shapes by strategy: tensor [1], channel [N, 1], group [N, K / group], block [ceil(N / b0), ceil(K / b1)].
The weight is w = (q - z) * s, computed in fp32 into the model's dtype (tests/test_compressed_tensors.py checks it
equals the compressed-tensors package's own decompression). Static activation scales (`input_scale`, W8A8) and KV
cache scales (`k_scale`, `v_scale`) are dropped: activations and the cache stay in the model's dtype.

Every rule is checked before anything is allocated, one line naming the tensor and the rule: a quantized tensor in
an `ignore`d module or in one no config group targets, a missing scale / shape / zero point, a zero point on a
symmetric scheme, a float and a quantized copy of one module, dtypes and shapes that do not fit the scheme (the
expected shape in the message), inputs not a multiple of the group size, a g_idx outside the groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config.compressed_tensors import CompressedTensors, Scheme
from ..io.safetensors_mmap import CheckpointError
from . import dequant, qmatmul
from .linear import Int4Codes, Int4Weight, Int8Codes
from .packed import SCALE_DTYPES, act_order, dequantize_codes, dequantize_scaled, int4_nibbles, pack_cols, unpack_cols

PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# Static activation / KV-cache quantization parameters: not applied (activations and the cache stay float).
DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale", "q_scale")
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
FP8 = torch.float8_e4m3fn


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [R, C] in 0..2^bits - 1 -> int32 [R, ceil(C * bits / 32)], packed along dim 1 as
    compressed-tensors packs (the last word padded with zeros)."""
    per = 32 // bits
    pad = -codes.shape[1] % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(codes.shape[0], pad)], dim=1)
    return pack_cols(codes.to(torch.int32), bits)


def unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The inverse of `pack`: int32 [R, W] -> signed codes q int32 [R, cols] (stored value - 2^(bits-1))."""
    return unpack_cols(packed, bits)[:, :cols] - (1 << (bits - 1))


def encode_int4(wq: Int4Weight, symmetric: bool = False, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """An int4 weight (groups, `linear.Int4Weight`, no act order) -> its pack-quantized tensors, relative names
    (weight_packed, weight_scale, weight_shape, and asymmetric: weight_zero_point). The stored codes and zero points
    are Int4Weight's own (its 0..15 are q + 8 and z + 8 of the signed convention): w = (codes - zero) * scale,
    unchanged. `symmetric`: wq's zero points are all 8 (`Int4Weight.quantize(symmetric=True)`) and are not stored."""
    N, K = wq.shape
    out = {"weight_packed": pack(wq.codes, 4), "weight_scale": wq.scale.to(scale_dtype), "weight_shape": torch.tensor([N, K])}
    if symmetric:
        if bool((wq.zero != 8).any()):
            raise ValueError("a symmetric int4 weight has zero points 8 (Int4Weight.quantize(symmetric=True))")
    else:
        out["weight_zero_point"] = pack(wq.zero.t().contiguous(), 4).t().contiguous()
    return out


def encode_int8(q: torch.Tensor, scale: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Symmetric per-channel int8 codes q [N, K] and scale [N] (`linear.quantize_int8`) -> pack-quantized tensors."""
    N, K = q.shape
    return {"weight_packed": pack(q.to(torch.int32) + 128, 8), "weight_scale": scale.reshape(N, 1).to(scale_dtype),
            "weight_shape": torch.tensor([N, K])}


def scale_shape(s: Scheme, N: int, K: int) -> tuple[int, ...]:
    """The weight_scale (and unpacked zero point) shape of scheme `s` for a weight [N, K]."""
    if s.strategy == "tensor":
        return (1,)
    if s.strategy == "channel":
        return (N, 1)
    if s.strategy == "group":
        return (N, K // s.group)
    return (-(-N // s.block[0]), -(-K // s.block[1]))


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, s: Scheme, dtype: torch.dtype,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Signed codes q [N, K] (int, or float8), scale and zero point (`scale_shape`; None: symmetric) and the act-order
    g_idx [K] -> the weight (q - z) * s [N, K] in `dtype`, computed in fp32."""
    N, K = q.shape
    if zero is None and s.strategy != "group":  # one scale per tensor, row or tile: the fp8 decoder's case
        return dequantize_scaled(q, scale, s.block, dtype)
    group = s.group if s.strategy == "group" else K
    # [N, groups] each (a per-tensor scale / zero point repeated over the rows)
    scale, zero = (None if t is None else t.reshape(N, -1) if t.numel() > 1 or N == 1 else t.reshape(1, 1).expand(N, 1)
                   for t in (scale, zero))
    if g_idx is None:
        return dequantize_codes(q, scale, zero, group, dtype)
    perm = torch.argsort(g_idx.long(), stable=True)  # inputs grouped: group g's inputs contiguous, in order
    return dequantize_codes(q[:, perm], scale, zero, group, dtype, perm)


def ct_entries(raw, ct: CompressedTensors) -> tuple[dict, set[str]]:
    """The decoded entries (weight name -> (parts, shape, decode, then `DecodedTensor`'s int4, pack, into and int8,
    each None where the scheme has none)) and
    the stored names they hide, for `quantized.QuantizedIndex`; every rule of the module docstring checked from the
    headers (and the small weight_shape / g_idx tensors)."""
    modules: dict[str, dict[str, str]] = {}
    hidden: set[str] = set()
    for name, (st, key) in raw.items():
        base, _, role = name.rpartition(".")
        if role in DROPPED:
            hidden.add(name)
        elif role in PARTS or (role == "weight" and (st.dtype(key) in INT_DTYPES or st.dtype(key).itemsize == 1)):
            modules.setdefault(base, {})[role] = name
    decoded: dict = {}
    for base, parts in modules.items():
        decoded[base + ".weight"] = _entry(raw, ct, base, parts)
        hidden |= set(parts.values())
    return decoded, hidden


def _entry(raw, ct: CompressedTensors, base: str, parts: dict[str, str]):
    first = next(iter(parts.values()))
    path = raw[first][0].path
    dtype = lambda role: raw[parts[role]][0].dtype(parts[role])  # noqa: E731
    shape = lambda role: tuple(raw[parts[role]][0].shape(parts[role]))  # noqa: E731
    pattern = ct.ignored_by(base)
    if pattern is not None:
        raise CheckpointError(f"{path}: tensor '{first}' is quantized but module '{base}' is in quantization_config.ignore "
                              f"('{pattern}')")
    s = ct.scheme_for(base)
    if s is None:
        targets = sorted({t for sc in ct.schemes for t in sc.targets})
        raise CheckpointError(f"{path}: tensor '{first}' is quantized but no quantization_config.config_groups target "
                              f"matches module '{base}' (targets: {', '.join(targets)})")
    what = f"config group '{s.name}' ({s.format}, {s.kind}{s.bits} {s.strategy}{'' if s.symmetric else ', asymmetric'})"
    packed = s.format == "pack-quantized"
    codes = "weight_packed" if packed else "weight"
    other = "weight" if packed else "weight_packed"
    if not packed and "weight" not in parts and base + ".weight" in raw:
        parts["weight"] = base + ".weight"  # a float weight beside a scale: the dtype check below names it
    if other in parts or (packed and base + ".weight" in raw):
        raise CheckpointError(f"{path}: module '{base}' holds both '{base}.{other}' and '{base}.{codes}'; {what} stores "
                              f"'{codes}'")
    needed = [codes, "weight_scale"] + (["weight_shape"] if packed else []) + ([] if s.symmetric else ["weight_zero_point"])
    for role in needed:
        if role not in parts:
            raise CheckpointError(f"{path}: module '{base}' has no tensor '{base}.{role}' ({what} needs "
                                  + ", ".join(needed) + ")")
    if s.symmetric and "weight_zero_point" in parts:
        raise CheckpointError(f"{path}: tensor '{parts['weight_zero_point']}' is a zero point but {what} is symmetric")
    if "weight_g_idx" in parts and s.strategy != "group":
        raise CheckpointError(f"{path}: tensor '{parts['weight_g_idx']}' is an act-order group index but {what} has no groups")
    want_dtype = torch.int32 if packed else FP8 if s.kind == "float" else torch.int8
    if dtype(codes) != want_dtype or len(shape(codes)) != 2:
        raise CheckpointError(f"{path}: tensor '{parts[codes]}' is {_dt(dtype(codes))} {list(shape(codes))}; {what} stores "
                              f"{_dt(want_dtype)} [out, in]")
    if packed:
        if dtype("weight_shape") not in INT_DTYPES or shape("weight_shape") != (2,):
            raise CheckpointError(f"{path}: tensor '{parts['weight_shape']}' is {_dt(dtype('weight_shape'))} "
                                  f"{list(shape('weight_shape'))}; expected int [2] (the weight's [out, in])")
        N, K = (int(v) for v in raw.tensor(parts["weight_shape"]))
        want = (N, -(-K * s.bits // 32))
        if shape(codes) != want or N <= 0 or K <= 0:
            raise CheckpointError(f"{path}: tensor '{parts[codes]}' has shape {list(shape(codes))} but weight_shape "
                                  f"[{N}, {K}] at {s.bits} bits packs to {list(want)}")
    else:
        N, K = shape(codes)
    if s.strategy == "group" and K % s.group:
        raise CheckpointError(f"{path}: tensor '{parts[codes]}' has {K} inputs, not a multiple of {what}'s group_size "
                              f"{s.group}")
    want = scale_shape(s, N, K)
    ok = {want, (N,)} if s.strategy == "channel" else {want, ()} if s.strategy == "tensor" else {want}
    if shape("weight_scale") not in ok:
        raise CheckpointError(f"{path}: tensor '{parts['weight_scale']}' has shape {list(shape('weight_scale'))} but "
                              f"weight [{N}, {K}] under {what} needs {list(want)}")
    if dtype("weight_scale") not in SCALE_DTYPES:
        raise CheckpointError(f"{path}: tensor '{parts['weight_scale']}' is {_dt(dtype('weight_scale'))}; expected float32, "
                              "bfloat16 or float16")
    zero_packed = packed and s.strategy in ("group", "channel")
    if "weight_zero_point" in parts:
        zwant = (-(-N * s.bits // 32), want[1]) if zero_packed else shape("weight_scale")
        zdt = (torch.int32,) if zero_packed else INT_DTYPES
        if shape("weight_zero_point") != zwant or dtype("weight_zero_point") not in zdt:
            raise CheckpointError(f"{path}: tensor '{parts['weight_zero_point']}' is {_dt(dtype('weight_zero_point'))} "
                                  f"{list(shape('weight_zero_point'))} but {what} needs {_dt(zdt[0])} {list(zwant)}"
                                  + (" (packed along the outputs)" if zero_packed else ""))
    if "weight_g_idx" in parts:
        _check_g_idx(raw, parts["weight_g_idx"], path, K, s.group)

    def decode(t: dict[str, torch.Tensor], dtype: torch.dtype, N=N, K=K, s=s) -> torch.Tensor:
        q = unpack(t["weight_packed"], s.bits, K) if packed else t["weight"]
        zero = t.get("weight_zero_point")
        if zero is not None:
            zero = unpack(zero.t().contiguous(), s.bits, N).t() if zero_packed else zero
        return dequantize(q, t["weight_scale"], zero, s, dtype, t.get("weight_g_idx"))

    int4 = pack = into = None
    if packed and s.kind == "int" and s.strategy in ("group", "channel"):
        group = s.group if s.strategy == "group" else K
        if s.bits == 4:
            int4 = Int4Codes(group, lambda t, N=N, K=K, s=s, group=group: int4_weight(t, s, N, K, group))
        if K % group == 0:  # decoded to bf16 from the stored words in one C pass (not act order): straight into
            # qmatmul's bf16 packing, or into a given tensor
            pack = lambda t, out, N=N, K=K, s=s, group=group: _words_bf16(t, s, N, K, group, out, True)  # noqa: E731
            into = lambda t, out, N=N, K=K, s=s, group=group: _words_bf16(t, s, N, K, group, out, False)  # noqa: E731
    # (one scale per tensor, row or tile: FP8 and symmetric int8 decode in one C pass, straight into qmatmul's bf16
    # packing or into a given tensor)
    if not packed and "weight_zero_point" not in parts and s.strategy != "group":
        pack = lambda t, out, s=s: dequant.scaled_packed(t["weight"], t["weight_scale"], s.block, out)  # noqa: E731
        into = lambda t, out, s=s: dequant.scaled_counted(t["weight"], t["weight_scale"], s.block,  # noqa: E731
                                                          torch.bfloat16, out)
    int8 = None  # symmetric int8, one scale per row (or per tensor): the int8 kernel's own form, run as stored
    if s.kind == "int" and s.bits == 8 and s.symmetric and s.strategy in ("channel", "tensor"):
        int8 = lambda t, into, N=N, K=K: int8_codes(t, packed, N, K, into)  # noqa: E731
    return {role: parts[role] for role in parts if role != "weight_shape"}, (N, K), decode, int4, pack, into, int8


def int8_codes(t: dict[str, torch.Tensor], packed: bool, N: int, K: int, into: torch.Tensor | None) -> Int8Codes:
    """A symmetric int8 weight's stored tensors (channel or tensor strategy) -> its codes in the q8 kernel's layout
    (`qmatmul.pack_int8`, into `into` when given; inputs padded with zero codes to a multiple of 32) and its scale per
    row: codes x scale is `dequantize`'s q * s exactly."""
    q = (unpack(t["weight_packed"], 8, K) if packed else t["weight"]).to(torch.int8)
    if K % 32:
        q = F.pad(q, (0, -K % 32))
    return Int8Codes(qmatmul.pack_int8(q, into), t["weight_scale"].float().reshape(-1).expand(N).contiguous())


def int4_weight(t: dict[str, torch.Tensor], s: Scheme, N: int, K: int, group: int) -> Int4Weight:
    """A pack-quantized int4 weight's stored tensors (group or channel strategy) -> its codes as an Int4Weight: the
    stored codes are q + 8 and the zero points z + 8 (symmetric: 8), so (codes - zero) * scale is `dequantize`'s
    (q - z) * s exactly; act order (weight_g_idx): the inputs permuted so that each group is contiguous (`perm`).
    Without act order the stored words go straight to the q4 kernel's layout (`dequant.int4_words_packed`)."""
    zero, scale = _int_groups(t, s, N, K, group)
    ordered = not act_order(t.get("weight_g_idx"), K, group)
    if ordered and (packed := dequant.int4_words_packed(t["weight_packed"], N, K, "ct")) is not None:
        return Int4Weight(None, scale, zero, group, None, packed)
    codes = int4_nibbles(t["weight_packed"]).reshape(N, -1)[:, :K]
    perm = None
    if not ordered:
        perm = torch.argsort(t["weight_g_idx"].long(), stable=True)  # as `dequantize` groups them
        codes = codes[:, perm]
    return Int4Weight(codes.contiguous(), scale, zero, group, perm)


def _int_groups(t: dict[str, torch.Tensor], s: Scheme, N: int, K: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pack-quantized weight's zero points (stored z + 2^(bits-1), packed along the outputs; symmetric: 2^(bits-1))
    as uint8 and scales as fp32, both [N, K/group]."""
    scale = t["weight_scale"].float().reshape(N, K // group).contiguous()
    if s.symmetric:
        return torch.full((N, K // group), 1 << (s.bits - 1), dtype=torch.uint8), scale
    zp = t["weight_zero_point"]  # [ceil(N * bits / 32), G], packed along the outputs
    if s.bits == 4:
        return int4_nibbles(zp).permute(0, 2, 1).reshape(-1, zp.shape[1])[:N].contiguous(), scale
    return unpack_cols(zp.t().contiguous(), s.bits)[:, :N].t().to(torch.uint8).contiguous(), scale


def _words_bf16(t: dict[str, torch.Tensor], s: Scheme, N: int, K: int, group: int, out: torch.Tensor | None,
                packed: bool) -> tuple[torch.Tensor, int] | None:
    """`dequant.words_bf16` of a pack-quantized int4 / int8 weight's stored words, in qmatmul's bf16 packing
    (`packed`) or [N, K] (into `out` when given); None with act order (or where it does not run): the torch decoder
    instead."""
    if act_order(t.get("weight_g_idx"), K, group):
        return None
    zero, scale = _int_groups(t, s, N, K, group)
    return dequant.words_bf16(t["weight_packed"], scale, zero, group, "ct", s.bits, out, packed)


def _check_g_idx(raw, name: str, path, K: int, group: int) -> None:
    st, key = raw[name]
    if st.dtype(key) not in INT_DTYPES or tuple(st.shape(key)) != (K,):
        raise CheckpointError(f"{path}: tensor '{name}' is {_dt(st.dtype(key))} {list(st.shape(key))}; expected int [{K}]")
    g = raw.tensor(name).long()
    G = K // group
    if int(g.min()) < 0 or int(g.max()) >= G:
        raise CheckpointError(f"{path}: tensor '{name}' holds group {int(g.max()) if int(g.max()) >= G else int(g.min())}, "
                              f"outside 0..{G - 1}")
    counts = torch.bincount(g, minlength=G)
    if bool((counts != group).any()):
        bad = int((counts != group).nonzero()[0])
        raise CheckpointError(f"{path}: tensor '{name}' gives group {bad} {int(counts[bad])} inputs; every group has "
                              f"group_size {group}")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
