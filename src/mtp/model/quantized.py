"""Quantized checkpoints (FP8, GPTQ, AWQ, compressed-tensors: model/compressed_tensors.py), decoded once at load:
the loader sees every quantized weight as the float tensor it stands for.

`decoded_index(files, config)` wraps a checkpoint's `TensorIndex`: for a checkpoint whose config.json has a
`quantization_config` (config/quantization.py), each float8 weight and its scale become one entry under the
weight's name that reads as a float tensor (`DecodedTensor`); the scales and the activation scales (unused: the
activations stay in the model's dtype) leave the index. Everything downstream - the family's name mapping, both
expert layouts (per-expert tensors stacked, or the fused `experts.gate_up_proj` / `down_proj` with a leading expert
dim), the shape and dtype checks, `materialize` - is unchanged. What is quantized follows the checkpoint: MTP layers
load in whatever form they are stored (FP8 releases often quantize them like the rest; others exclude them).

FP8 (DeepSeek-V3 / Qwen / GLM layout): `X.weight` float8 [..., N, K] with `X.weight_scale_inv` float32 (a fused
expert tensor `X` has `X_scale_inv`), the multiplier w = q * s of each [b0, b1] tile of `weight_block_size`
(shape [..., ceil(N / b0), ceil(K / b1)]), or with no block size one per tensor ([] or [1]) or per output channel
([..., N, 1] or [..., N]); `X.weight_scale` is read the same way (per-tensor / per-channel releases name it so).
Decoding is done in fp32, 128 rows at a time into the model's dtype: the weight is exactly
(q.float() * s.float()).to(dtype), and the temporaries stay small next to the weight.

GPTQ / AWQ (model/packed.py for the packings): `X.qweight` + `X.qzeros` + `X.scales` (+ GPTQ's `X.g_idx`) become
`X.weight` [N, K], decoded in fp32 into the model's dtype; per-expert layouts only (the releases' own).

Every rule is checked on the headers before anything is read or allocated, and an error names the tensor and the
rule: a float8 tensor without its scale (or in a checkpoint with no quantization_config), a scale without its
tensor or on a tensor that is not float8, a scale whose shape does not match the weight's, a quantized tensor in a
module the config excludes (`modules_to_not_convert`); for GPTQ / AWQ a missing qzeros or scales, shapes that do
not fit the bit width and group size, a g_idx outside the groups, a float and a quantized copy of one module.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.quantization import Quantization, parse_quantization
from ..io.safetensors_mmap import CheckpointError
from . import dequant
from .compressed_tensors import ct_entries
from .linear import Int4Codes, Int4Weight, Int8Codes
from .packed import AWQ_REVERSE, SCALE_DTYPES, act_order, awq_weight, dequantize_scaled, gptq_weight, int4_nibbles, unpack_cols

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # the weight's own name + suffix (X.weight_scale_inv, X.gate_up_proj_scale_inv)
ACTIVATION_SUFFIXES = ("input_scale", "activation_scale")  # static activation scales: not used (activations stay float)
PACKED_PARTS = ("qzeros", "scales", "g_idx")  # GPTQ / AWQ: X.qweight's companions (g_idx: GPTQ, optional)
INT_DTYPES = (torch.int32, torch.int64, torch.int16)


class DecodedTensor:
    """One quantized weight read as a float tensor, with the calls the loader makes on a stored one (`path`,
    `shape`, `dtype`, `tensor`, `release`). `parts` are the stored tensors it decodes from (role -> checkpoint name),
    `decode(parts, dtype)` the format's decoder; `index.dtype` is the dtype it decodes to (the model's). `pack(parts,
    out)`, where the format has one, decodes straight into qmatmul's bf16 packing (`packed_bf16`); `into(parts, out)`
    into a given bf16 tensor (`tensor_into`); `int8_codes(parts, into) -> Int8Codes` gives the stored int8 codes in
    qmatmul's layout where they are the int8 kernel's form (`int8`)."""

    def __init__(self, index: QuantizedIndex, parts: dict[str, str], shape: tuple[int, ...], decode,
                 int4: Int4Codes | None = None, pack=None, into=None, int8=None):
        self.index, self.parts, self._shape, self.decode = index, parts, shape, decode
        self.path = index.raw[next(iter(parts.values()))][0].path
        self.int4_codes, self.pack, self.into, self.int8_codes = int4, pack, into, int8
        self.non_finite: int | None = None  # NaN / Inf among the values `tensor` last gave, where its decoder counted them

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape

    def dtype(self, name: str) -> torch.dtype:
        return self.index.dtype

    def nbytes(self, name: str) -> int:
        return _prod(self._shape) * self.index.dtype.itemsize

    def _from_stored(self, fn):
        """fn(the stored parts, role -> tensor); their file pages are dropped once it has read them."""
        out = fn({role: self.index.raw.tensor(key) for role, key in self.parts.items()})
        for key in self.parts.values():
            st, k = self.index.raw[key]
            st.release(k)
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """The decoded weight (the file pages of its stored parts are dropped once read). A decoder gives the weight,
        or (the weight, how many of its values are NaN / Inf): then `non_finite`."""
        out = self._from_stored(lambda t: self.decode(t, self.index.dtype))
        out, self.non_finite = out if isinstance(out, tuple) else (out, None)
        return out

    def tensor_into(self, out: torch.Tensor) -> torch.Tensor:
        """`tensor("")` decoded in bf16, into `out` (contiguous bf16 of the weight's shape: a load's reused scratch,
        whose pages are warm where a new tensor's would be fresh) where the format can (`into`), else a new tensor;
        `non_finite` as `tensor` sets it."""
        if self.index.dtype != torch.bfloat16:
            raise ValueError(f"tensor_into: the weight decodes to {self.index.dtype}, not bfloat16")
        got = None if self.into is None else self._from_stored(lambda t: self.into(t, out))
        if got is None:
            return self.tensor("")
        out, self.non_finite = got
        return out

    def release(self, name: str) -> None:
        """Nothing to drop: `tensor` released the stored pages already."""

    def packed_bf16(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """`qmatmul.pack_bf16(tensor(name), out)`, the weight decoded in bf16: where the format can (`pack`, the C
        pass), straight into that layout with no [N, K] weight between; `non_finite` as `tensor` sets it (None: not
        counted; the packing holds the weight's values and zeros). A load that runs the weight on qmatmul's bf16
        product and lets go of it asks for this (model/checkpoint.py), one weight at a time."""
        if self.index.dtype != torch.bfloat16:
            raise ValueError(f"packed_bf16: the weight decodes to {self.index.dtype}, not bfloat16")
        got = None if self.pack is None else self._from_stored(lambda t: self.pack(t, out))
        if got is None:  # the format's decoder, then the packing (`non_finite` as the decoder set it: maybe None)
            return dequant.pack_bf16_counted(self.tensor(""), out)[0]
        out, self.non_finite = got
        return out

    def int4(self) -> Int4Weight:
        """The stored int4 codes, scales and zero points as they are (`int4_codes` not None), in the int4 kernel's
        form: `Int4Weight.dequantize()` is exactly the weight `tensor()` decodes, in fp32 (the file pages of the stored
        parts are dropped once read)."""
        return self._from_stored(self.int4_codes.build)

    def int8(self, into: torch.Tensor | None = None) -> Int8Codes:
        """The stored int8 codes and per-row scales as they are (`int8_codes` not None), the codes moved to qmatmul's
        layout (into `into` when given): codes x scales is exactly the weight `tensor()` decodes, in fp32 (the file
        pages of the stored parts are dropped once read)."""
        return self._from_stored(lambda t: self.int8_codes(t, into))

    def scale_names(self) -> list[str]:
        """The stored float tensors among the parts (the scales): what a NaN / Inf check of the codes reads."""
        return [key for role, key in self.parts.items() if role in ("scales", "weight_scale")]


class QuantizedIndex(dict):
    """A TensorIndex as the loader should see a quantized checkpoint: name -> (file or DecodedTensor, name), without
    the scales. `raw` is the checkpoint's own index; `dtype` (set by the loader) what quantized weights decode to."""

    def __init__(self, raw, quant: Quantization, decoded: dict[str, tuple], hidden: set[str]):
        super().__init__()
        self.raw, self.quant, self.path = raw, quant, raw.path
        self.dtype = torch.bfloat16
        for name, entry in raw.items():
            if name not in hidden and name not in decoded:
                self[name] = entry
        for name, (parts, shape, decode, *extra) in decoded.items():  # (extra: int4, pack, into, int8: DecodedTensor's)
            self[name] = (DecodedTensor(self, parts, shape, decode, *extra), name)
        self.decoded = set(decoded)

    def tensor(self, name: str) -> torch.Tensor:
        src, key = self[name]
        return src.tensor(key)

    def close(self) -> None:
        self.raw.close()


def scale_of(name: str, names) -> str | None:
    """The scale tensor stored for weight `name`, if any."""
    for suffix in SCALE_SUFFIXES:
        if name + suffix in names:
            return name + suffix
    return None


def weight_of_scale(name: str) -> str | None:
    """The weight a scale tensor's name belongs to (None: not a scale's name)."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix) and not name.endswith(ACTIVATION_SUFFIXES):
            return name[: -len(suffix)]
    return None


def module_of(name: str) -> str:
    """The module a tensor belongs to: `X.weight` -> X; a fused expert tensor `X.experts.gate_up_proj` -> X.experts."""
    return name.rsplit(".", 1)[0] if "." in name else name


def expected_scale_shapes(shape: tuple[int, ...], block: tuple[int, int] | None) -> list[tuple[int, ...]]:
    """The scale shapes a weight of `shape` [..., N, K] may have: one per tile of `block`, else per tensor or per
    output channel (and, for stacked experts, per expert)."""
    *lead, N, K = shape
    lead = tuple(lead)
    if block is not None:
        return [(*lead, -(-N // block[0]), -(-K // block[1]))]
    out = [(), (1,), (*lead, N, 1), (*lead, N)]
    if lead:
        out += [(*lead, 1, 1), lead]
    return out


def decoded_index(raw, config, where: Path | str = ""):
    """The checkpoint index the loader reads: `raw` itself for a float checkpoint, a QuantizedIndex for a quantized
    one. Checks every quantization rule on the headers (see the module docstring); errors name the file and tensor."""
    quant = parse_quantization(config.quantization_config)
    cfg = Path(where) / "config.json"
    if quant is None:
        fp8 = next((name for name, (st, key) in raw.items() if st.dtype(key) in FP8), None)
        if fp8 is not None:
            raise CheckpointError(f"{raw[fp8][0].path}: tensor '{fp8}' is {_dt(raw[fp8][0].dtype(fp8))} but {cfg} has no "
                                  "'quantization_config' (its scales would be ignored)")
        scale = next((name for name in raw if name.endswith("_scale_inv") and weight_of_scale(name) in raw), None)
        if scale is not None:
            raise CheckpointError(f"{raw[scale][0].path}: tensor '{scale}' is a quantization scale but {cfg} has no "
                                  "'quantization_config'")
        return raw
    if quant.method == "compressed-tensors":
        return QuantizedIndex(raw, quant, *ct_entries(raw, quant.ct))
    if quant.method != "fp8":
        return QuantizedIndex(raw, quant, *packed_entries(raw, quant))
    decoded: dict = {}
    hidden: set[str] = set()
    for name, (st, key) in raw.items():
        if name.endswith(ACTIVATION_SUFFIXES):
            hidden.add(name)
            continue
        weight = weight_of_scale(name)
        if weight is not None:
            hidden.add(name)
            if weight not in raw:
                raise CheckpointError(f"{st.path}: scale '{name}' has no tensor '{weight}' to scale")
            if raw[weight][0].dtype(weight) not in FP8:
                raise CheckpointError(f"{st.path}: tensor '{weight}' has a scale '{name}' but is "
                                      f"{_dt(raw[weight][0].dtype(weight))}; fp8 scales go with float8 weights")
            continue
        dtype = st.dtype(key)
        if dtype not in FP8:
            continue
        scale = scale_of(name, raw)
        if scale is None:
            raise CheckpointError(f"{st.path}: tensor '{name}' is {_dt(dtype)} but has no scale "
                                  f"'{name}{SCALE_SUFFIXES[0]}' (quantization_config: fp8 weights need their scales)")
        pattern = quant.excluded_by(module_of(name))
        if pattern is not None:
            raise CheckpointError(f"{st.path}: tensor '{name}' is quantized ({_dt(dtype)}) but module "
                                  f"'{module_of(name)}' is excluded by quantization_config.modules_to_not_convert "
                                  f"pattern '{pattern}'")
        shape = tuple(st.shape(key))
        if len(shape) < 2:
            raise CheckpointError(f"{st.path}: tensor '{name}' is {_dt(dtype)} with shape {list(shape)}; quantized "
                                  "weights are matrices [out, in] (or stacked experts [E, out, in])")
        sst, skey = raw[scale]
        sshape = tuple(sst.shape(skey))
        allowed = expected_scale_shapes(shape, quant.block)
        if sshape not in allowed:
            rule = (f"one per {quant.block[0]}x{quant.block[1]} block (weight_block_size)" if quant.block is not None
                    else "per tensor or per output channel (no weight_block_size)")
            want = " or ".join(str(list(a)) for a in (allowed[:1] if quant.block else allowed))
            raise CheckpointError(f"{sst.path}: scale '{scale}' has shape {list(sshape)} but weight '{name}' "
                                  f"{list(shape)} needs {want} ({rule})")
        if sst.dtype(skey) not in SCALE_DTYPES:
            raise CheckpointError(f"{sst.path}: scale '{scale}' is {_dt(sst.dtype(skey))}; expected float32, "
                                  "bfloat16 or float16")
        block = quant.block
        decoded[name] = ({"weight": name, "scale": scale}, shape,
                         lambda t, dtype, block=block: _scaled(t, dtype, block), None,
                         lambda t, out, block=block: dequant.scaled_packed(t["weight"], t["scale"], block, out),
                         lambda t, out, block=block: dequant.scaled_counted(t["weight"], t["scale"], block,
                                                                            torch.bfloat16, out))
    return QuantizedIndex(raw, quant, decoded, hidden)


def _scaled(t: dict[str, torch.Tensor], dtype: torch.dtype, block: tuple[int, int] | None):
    """FP8 codes and their scale -> the weight and how many of its values are NaN / Inf where the C pass decoded them
    (`dequant.scaled_counted`: the loader need not read the weight again to check it), else the weight."""
    counted = dequant.scaled_counted(t["weight"], t["scale"], block, dtype)
    return counted if counted is not None else dequantize_scaled(t["weight"], t["scale"], block, dtype)


def packed_entries(raw, quant: Quantization) -> tuple[dict, set[str]]:
    """GPTQ / AWQ: each `X.qweight` with `X.qzeros`, `X.scales` (and GPTQ's optional `X.g_idx`) -> one decoded entry
    `X.weight` [N, K] (model/packed.py); every shape, dtype and g_idx value checked here, from the headers (and the
    small g_idx tensors). Returns (decoded entries, the stored names they hide)."""
    decoded: dict = {}
    hidden: set[str] = set()
    what = f"{quant.method} ({quant.bits}-bit)"
    for name, (st, key) in raw.items():
        if st.dtype(key) in FP8:
            raise CheckpointError(f"{st.path}: tensor '{name}' is {_dt(st.dtype(key))} but the config says {quant.method}")
        base, _, role = name.rpartition(".")
        if role in PACKED_PARTS:
            if base + ".qweight" not in raw:
                raise CheckpointError(f"{st.path}: tensor '{name}' has no '{base}.qweight' it belongs to ({what})")
            continue
        if role != "qweight":
            continue
        weight = base + ".weight"
        if weight in raw:
            raise CheckpointError(f"{st.path}: module '{base}' holds both a float '{weight}' and a quantized '{name}'")
        parts = {"qweight": name}
        for part in PACKED_PARTS:
            if base + "." + part in raw:
                parts[part] = base + "." + part
            elif part != "g_idx":
                raise CheckpointError(f"{st.path}: tensor '{name}' has no '{base}.{part}' ({what} weights need their "
                                      "zero points and scales)")
        if "g_idx" in parts and quant.method == "awq":
            raise CheckpointError(f"{st.path}: tensor '{parts['g_idx']}' is a GPTQ act-order index, but the config says awq")
        pattern = quant.excluded_by(base)
        if pattern is not None:
            raise CheckpointError(f"{st.path}: tensor '{name}' is quantized but module '{base}' is excluded by "
                                  f"quantization_config.modules_to_not_convert pattern '{pattern}'")
        shapes = {role: tuple(raw[k][0].shape(k)) for role, k in parts.items()}
        for role, k in parts.items():
            dt = raw[k][0].dtype(k)
            ok = dt == torch.int32 if role in ("qweight", "qzeros") else dt in SCALE_DTYPES if role == "scales" else dt in INT_DTYPES
            if not ok or len(shapes[role]) != (1 if role == "g_idx" else 2):
                raise CheckpointError(f"{raw[k][0].path}: tensor '{k}' is {_dt(dt)} {list(shapes[role])}; {what} stores "
                                      + {"qweight": "int32 [rows, cols]", "qzeros": "int32 [groups, cols]",
                                         "scales": "float [groups, outputs]", "g_idx": "int [inputs]"}[role])
        per = 32 // quant.bits
        if quant.method == "gptq":
            K, N = shapes["qweight"][0] * per, shapes["qweight"][1]
            zeros = (-(-N // per),)
        else:
            K, N = shapes["qweight"][0], shapes["qweight"][1] * per
            zeros = (shapes["qweight"][1],)
        G = -(-K // quant.group) if quant.group else 1
        want = {"scales": (G, N), "qzeros": (G, *zeros), "g_idx": (K,)}
        for role, shape in want.items():
            if role in parts and shapes[role] != shape:
                group = f"group_size {quant.group}" if quant.group else "one group"
                raise CheckpointError(f"{raw[parts[role]][0].path}: tensor '{parts[role]}' has shape {list(shapes[role])} but "
                                      f"'{name}' {list(shapes['qweight'])} ({what}: weight [{N}, {K}], {group}) needs "
                                      f"{list(shape)}")
        group = min(quant.group or K, K)  # a group wider than the row is one group of K
        whole = K % group == 0  # the int4 kernel's form needs whole groups (act order: each exactly `group` inputs)
        if "g_idx" in parts:
            g = raw.tensor(parts["g_idx"])
            if g.numel() and (int(g.min()) < 0 or int(g.max()) >= G):
                raise CheckpointError(f"{raw[parts['g_idx']][0].path}: tensor '{parts['g_idx']}' holds group "
                                      f"{int(g.max()) if int(g.max()) >= G else int(g.min())}, outside 0..{G - 1}")
            whole = whole and bool((torch.bincount(g.long(), minlength=G) == group).all())
        if quant.method == "gptq":
            decode = lambda t, dtype, q=quant: gptq_weight(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"),  # noqa: E731
                                                           q.bits, q.group, q.zero_offset, dtype)
            codes = lambda t, q=quant, group=group: gptq_int4(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"),  # noqa: E731
                                                              group, q.zero_offset)
        else:
            decode = lambda t, dtype, q=quant: awq_weight(t["qweight"], t["qzeros"], t["scales"], q.group, dtype)  # noqa: E731
            codes = lambda t, group=group: awq_int4(t["qweight"], t["qzeros"], t["scales"], group)  # noqa: E731
        int4 = Int4Codes(group, codes) if quant.bits == 4 and whole else None
        # decoded to bf16 from the stored words in one C pass: straight into qmatmul's bf16 packing (no --quantize),
        # or into a quantizing load's scratch
        pack = into = None
        if K % group == 0 and quant.bits in (4, 8):
            pack = lambda t, out, q=quant, group=group: _words_bf16(t, q, group, out, True)  # noqa: E731
            into = lambda t, out, q=quant, group=group: _words_bf16(t, q, group, out, False)  # noqa: E731
        decoded[weight] = (parts, (N, K), decode, int4, pack, into)
        hidden |= set(parts.values())
    return decoded, hidden


def _words_bf16(t: dict[str, torch.Tensor], quant: Quantization, group: int, out: torch.Tensor | None, packed: bool
                ) -> tuple[torch.Tensor, int] | None:
    """`dequant.words_bf16` of a GPTQ (4 / 8 bits) or AWQ weight's tensors `t` (qweight, qzeros, scales, g_idx), its
    words read as stored: in qmatmul's bf16 packing (`packed`) or [N, K] (into `out` when given); None where it does
    not run them (act order, N not a multiple of 8, no library): the format's decoder instead."""
    qweight = t["qweight"]
    if quant.method == "gptq":
        K = qweight.shape[0] * 32 // quant.bits
        if act_order(t.get("g_idx"), K, group):
            return None
        zero, scale = gptq_groups(t["qzeros"], t["scales"], quant.zero_offset, quant.bits)
    else:
        zero, scale = awq_groups(t["qzeros"], t["scales"])
    return dequant.words_bf16(qweight, scale, zero, group, quant.method, quant.bits, out, packed)


def gptq_groups(qzeros: torch.Tensor, scales: torch.Tensor, zero_offset: int, bits: int = 4
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPTQ weight's qzeros int32 [G, N * bits / 32] and scales [G, N] -> zero points uint8 and scales fp32, [N, G]
    (v1: the stored zero plus `zero_offset`, within the same bits)."""
    N = scales.shape[1]
    z = int4_nibbles(qzeros).reshape(qzeros.shape[0], -1) if bits == 4 else unpack_cols(qzeros, bits)
    zero = (z[:, :N].to(torch.int32) + zero_offset) & ((1 << bits) - 1)  # [G, N]
    return zero.to(torch.uint8).t().contiguous(), scales.float().t().contiguous()


def awq_groups(qzeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An AWQ 4-bit weight's qzeros int32 [G, N/8] (GEMM packing) and scales [G, N] -> zero points uint8 and scales
    fp32, [N, G]."""
    zero = int4_nibbles(qzeros)[..., list(AWQ_REVERSE)].reshape(qzeros.shape[0], -1)  # [G, N]
    return zero.t().contiguous(), scales.float().t().contiguous()


def gptq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group: int, zero_offset: int) -> Int4Weight:
    """GPTQ 4-bit tensors (model/packed.py) -> their codes as an Int4Weight [N, K] (act order: the inputs permuted so
    that each group is contiguous, `perm`), exactly `gptq_weight`'s weight when dequantized. K % group == 0, and with
    g_idx every group holds `group` inputs."""
    R, N = qweight.shape
    K = R * 8
    zero, scale = gptq_groups(qzeros, scales, zero_offset)
    perm = None
    if act_order(g_idx, K, group):
        perm = torch.argsort(g_idx.long(), stable=True)  # group g's inputs contiguous, in order
    elif (packed := dequant.int4_words_packed(qweight, N, K, "gptq")) is not None:  # the stored words straight to the kernel's
        return Int4Weight(None, scale, zero, group, None, packed)
    # transposed as words (an eighth of the elements a transpose of the codes moves), then input k = 8 r + i is
    # nibble i of word r of each row
    codes = int4_nibbles(qweight.t().contiguous()).reshape(N, K)
    if perm is not None:
        codes = codes[:, perm]
    return Int4Weight(codes.contiguous(), scale, zero, group, perm)


def awq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> Int4Weight:
    """AWQ GEMM tensors -> their codes as an Int4Weight [N, K], exactly `awq_weight`'s weight when dequantized."""
    zero, scale = awq_groups(qzeros, scales)
    if (packed := dequant.awq_int4_packed(qweight)) is not None:  # the stored words straight to the kernel's layout
        return Int4Weight(None, scale, zero, group, None, packed)
    q = int4_nibbles(qweight)[..., list(AWQ_REVERSE)]  # [K, N / 8, 8]: output c of a word's eight is nibble AWQ_REVERSE[c]
    return Int4Weight(q.reshape(q.shape[0], -1).t().contiguous(), scale, zero, group)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
