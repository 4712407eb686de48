"""Linear layers for inference that are row-invariant (and fast on CPU), swapped in once after loading
(`prepare_for_inference`).

Greedy speculative decoding is identical to plain decoding only if each row of a verify block is computed exactly
as a 1-row plain step, and batching is lossless only if a row does not depend on the others. Every `nn.Linear`
becomes a `FastLinear` that keeps the same `weight` parameter (state dict, saving and training are unchanged) and
runs one of these kernels, each row-invariant (tests/test_precision.py checks every layer of a model on the machine
that runs it):

- "bf16-native": bf16 weights through `qmatmul.bf16_linear` (fp32 sums in one fixed order per output: fp32
  multiply-adds, the same bits on every AVX2 CPU, or `vdpbf16ps` on AVX-512 BF16 CPUs, or the AMX tiles' `tdpbf16ps`
  on AMX CPUs, each their own bits): every bf16
  layer wherever qmatmul runs (`bf16_kernel`), so a bf16 model decodes through step.c's one call, and always the kept
  bf16 layers a family's one-call draft reads (`CausalLM.native_bf16`: Qwen3.5's MTP `fc`), so that step.c runs them
  with the eager path's bits. Without qmatmul it is "bf16".
- "bf16": oneDNN's packed weight layout (`mkldnn._linear_pointwise`) where oneDNN packs bf16 (AVX-512 bw/vl/dq or
  AVX-NE-CONVERT), else `F.linear`: where qmatmul cannot run, or asked for by MTP_BF16=torch.
- "int8": int8 weights with per-output-channel scales. On x86 CPUs with AVX2 `qmatmul.q8_linear` (activations
  quantized to int8 in blocks of 32, integer products: 2-3x torch's kernel, docs/decisions.md), else torch's
  weight-only `_weight_int8pack_mm` (bf16 activations).
- "int4": int4 weights with group-wise affine scales (`Int4Weight`), prepared from a float weight (round to nearest,
  asymmetric, groups of 128 input features) or taken from an int4 checkpoint's own codes. On AVX2
  `qmatmul.q4_linear` (int8 activations in blocks of up to 128), else torch's `_weight_int4pack_mm_for_cpu` (bf16 activations;
  torchao's CPU int4 weight-only tensor calls the same kernel). A layer whose shape torch's kernel cannot run
  (outputs not a multiple of 16, inputs not of 32) gets int8, on every machine, so a model quantizes alike
  everywhere. Both int4 kernels are row-invariant (1..64 rows, 1 and 2 threads).
  Quantizing (int8 and int4) is one C pass over each weight where it can run (`rtn.py`), else torch ops: the same
  codes, scales and zero points bit for bit.
- "fp32": `F.linear`, one row at a time in decode rounds (`linear_rows` within `row_invariant()`). MKL's fp32 GEMM
  is not row-invariant (a 1-row product takes its GEMV path, several rows its blocked GEMM, and they round
  differently), so a verify block multiplies row by row: each row reads the weights again (fp32 is not the fast
  path) but is exactly its plain step.
(fbgemm's int8 x int8 dynamic kernel was 1.7-4x faster than bf16 at Qwen3.5-0.8B widths but quantizes activations
with one scale per call, so it is not row-invariant: not used, docs/decisions.md.)

The prepared kernel is used only under no_grad/inference mode and only while the weight is unchanged (its version
counter is checked at each eager call), so a model that trains afterwards silently goes back to `F.linear`. An inference-only
load (`load_model(release=True)`) lets the int8 / int4 layers go of their float weights (`FastLinear.release`): the
codes are then all they hold, and a call that would need the weight raises `ReleasedWeightError` instead. Compiled
graphs cannot read a version counter without breaking the graph: they call the prepared kernels unchecked, and
decode/compiled.py renews whatever changed (`renew_prepared`) as each decoder starts.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import dequant, qmatmul, rtn
from .packed import dequantize_codes, dequantize_scaled

KERNELS = ("bf16", "bf16-native", "int8", "int4", "fp32")
# Group sizes torch's CPU int4 kernel takes (a larger group is split into these).
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
# The group size `--quantize int4` uses (the common GPTQ/AWQ choice; the kernel's fastest at 4 rows, decisions.md).
INT4_GROUP = 128
# Output rows quantized at a time: the fp32 temporaries of a [248320, 1024] output head stay near 64 MB, not 2 GB.
QUANT_ROWS = 16384

_PACKED_BF16: bool | None = None


def packed_bf16_supported() -> bool:
    """Can oneDNN pack bf16 linear weights on this CPU (AVX-512 bw/vl/dq or AVX-NE-CONVERT)? Probed once."""
    global _PACKED_BF16
    if _PACKED_BF16 is None:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
            _PACKED_BF16 = True
        except RuntimeError:
            _PACKED_BF16 = False
    return _PACKED_BF16


def bf16_kernel() -> str:
    """The kernel a bf16 linear layer runs ("bf16" asked of `FastLinear.prepare`): "bf16-native" wherever qmatmul runs,
    else oneDNN's "bf16". On an AVX2-only CPU torch's bf16 product is 2.5-6x slower than ours at 1 to 128 rows; on an
    AVX-512 BF16 one (Zen 4) ours is level with oneDNN's over a prompt's rows and faster at decode's few, and a model
    whose layers all run it decodes through the one-call program (model/step.py): 2x the tokens/s of oneDNN's
    layers there (docs/decisions.md, 2026-12-03 and 2026-12-04); on an AMX CPU ours runs on the tiles (2026-12-05).
    MTP_BF16=torch keeps oneDNN; MTP_BF16=native asks for ours (the default where it runs)."""
    choice = os.environ.get("MTP_BF16", "")
    if choice not in ("", "native", "torch"):
        raise ValueError(f"MTP_BF16 must be 'native' or 'torch', got {choice!r}")
    return "bf16" if choice == "torch" or not qmatmul.available() else "bf16-native"


@dataclass
class Int4Weight:
    """A weight [N, K] as 4-bit codes with group-wise affine scales, the form every int4 checkpoint format decodes to:
    w[n, perm[j]] = (codes[n, j] - zero[n, j // group]) * scale[n, j // group], with perm the identity when None
    (act-order checkpoints store the input features permuted so that each group is contiguous).

    codes uint8 [N, K] in 0..15; scale float [N, K / group]; zero uint8 [N, K / group] in 0..15; perm long [K]. A
    format whose stored words are a permutation away from the q4 kernel's gives `packed` (`qmatmul.pack_int4`'s layout
    of the codes) and codes None: `codes` then unpacks them when something reads them (not the q4 kernel)."""

    _codes: torch.Tensor | None
    scale: torch.Tensor
    zero: torch.Tensor
    group: int
    perm: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    @property
    def codes(self) -> torch.Tensor:
        if self._codes is None:
            self._codes = qmatmul.unpack_int4(self.packed, self.scale.shape[0])
        return self._codes

    def packed_codes(self) -> torch.Tensor:
        """The codes in `qmatmul.pack_int4`'s layout (the q4 kernel's), uint8 [ceil(N/8), 4K]."""
        return self.packed if self.packed is not None else qmatmul.pack_int4(self.codes)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.scale.shape[0], self.scale.shape[1] * self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype`, input features in their natural order (computed in fp32)."""
        return dequantize_codes(self.codes, self.scale, self.zero, self.group, dtype, self.perm)

    @staticmethod
    def quantize(w: torch.Tensor, group: int = INT4_GROUP, symmetric: bool = False) -> Int4Weight:
        """Round to nearest per group of `group` input features: w [N, K] -> Int4Weight. Asymmetric (the default,
        `--quantize int4`): min..max onto 0..15 with an integer zero point; symmetric: zero point 8, scale
        max |w| / 7 (codes 1..15, as symmetric int4 checkpoints store q + 8 with q in -8..7). The codes, scales and
        zero points are those a GPTQ/compressed-tensors int4 checkpoint stores, so the result can be written in those
        formats unchanged."""
        fast = rtn.quantize_int4(w.detach(), group, symmetric)  # the same codes in one C pass, where it runs
        if fast is not None:
            return Int4Weight(*fast, group)
        return _quantize_int4_torch(w, group, symmetric)


def _quantize_int4_torch(w: torch.Tensor, group: int, symmetric: bool) -> Int4Weight:
    """`Int4Weight.quantize` in torch ops (the reference rtn.c reproduces bit for bit)."""
    N, K = w.shape
    if N > QUANT_ROWS:  # per-row arithmetic: rows in chunks give the same codes with bounded fp32 temporaries
        out = Int4Weight(torch.empty(N, K, dtype=torch.uint8), torch.empty(N, K // group),
                         torch.empty(N, K // group, dtype=torch.uint8), group)
        for i in range(0, N, QUANT_ROWS):
            q = _quantize_int4_torch(w[i : i + QUANT_ROWS], group, symmetric)
            out.codes[i : i + QUANT_ROWS], out.scale[i : i + QUANT_ROWS], out.zero[i : i + QUANT_ROWS] = q.codes, q.scale, q.zero
        return out
    g = w.detach().float().reshape(N, K // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp_min(1e-10)
        zero = torch.full_like(scale, 8.0)
    else:
        lo = g.amin(-1).clamp(max=0.0)
        hi = g.amax(-1).clamp(min=0.0)
        scale = ((hi - lo) / 15).clamp_min(1e-10)
        zero = (-lo / scale).round().clamp(0, 15)
    codes = (g / scale[..., None]).round().add_(zero[..., None]).clamp_(0, 15)
    return Int4Weight(codes.reshape(N, K).to(torch.uint8), scale, zero.to(torch.uint8), group)


@dataclass(frozen=True)
class Int8Codes:
    """A weight [N, K] as an int8 checkpoint stores it with one scale per output row (compressed-tensors symmetric
    int8, channel or tensor strategy), the "int8" kernel's own form: w = codes * scale[:, None], the codes in qmatmul's
    layout (`qmatmul.pack_int8`, inputs padded with zero codes to a multiple of 32: uint8 [ceil(N/8), Kp/4, 8, 4]),
    scale fp32 [N]."""

    packed: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Int4Codes:
    """A quantized weight stored as 4-bit codes in groups along its inputs, that `DecodedTensor.int4` gives as an
    `Int4Weight` without a float copy: `group` inputs per scale (act order: after the permutation), `build(stored
    parts) -> Int4Weight`. Only where the layout maps exactly: the checkpoint's groups whole and contiguous (K % group
    == 0; act order: every group exactly `group` inputs)."""

    group: int
    build: Callable[[dict[str, torch.Tensor]], Int4Weight]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The "int8" kernel's weights: symmetric per output channel, round to nearest: w [N, K] -> (codes int8 [N, K] in
    -127..127, scale fp32 [N]) with w ~ codes * scale[:, None] (a symmetric channel-wise int8 checkpoint stores them)."""
    fast = rtn.quantize_int8(w.detach())  # the same codes in one C pass, where it runs
    return fast if fast is not None else _quantize_int8_torch(w)


def _quantize_int8_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int8` in torch ops (the reference rtn.c reproduces bit for bit)."""
    if w.shape[0] > QUANT_ROWS:  # per-row arithmetic: chunks of rows give the same codes with bounded temporaries
        codes, scale = torch.empty(w.shape, dtype=torch.int8), torch.empty(w.shape[0])
        for i in range(0, w.shape[0], QUANT_ROWS):
            codes[i : i + QUANT_ROWS], scale[i : i + QUANT_ROWS] = _quantize_int8_torch(w[i : i + QUANT_ROWS])
        return codes, scale
    scale = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scale


def int4_group_for(in_features: int) -> int | None:
    """The group size `--quantize int4` uses for a layer of this input width (None: no kernel group divides it)."""
    for g in (INT4_GROUP, 64, 32):
        if in_features % g == 0:
            return g
    return None


def int4_supported(out_features: int, in_features: int, group: int) -> bool:
    """Can torch's CPU int4 kernel run this shape? (N a multiple of 16; the group, or a split of it, a kernel size.)"""
    return out_features % 16 == 0 and in_features % group == 0 and _kernel_group(group) is not None


def int4_fits(linear: nn.Linear) -> bool:
    """Can the int4 kernel run this layer (`int4_supported` at its group size, `int4_group_for`)?"""
    group = int4_group_for(linear.in_features)
    return group is not None and int4_supported(linear.out_features, linear.in_features, group)


def quantized_kernel(bits: str, linear: nn.Linear) -> str:
    """The kernel `bits` ("int8" / "int4") gives this layer: int8 where the int4 kernel cannot run its shape."""
    return "int8" if bits == "int4" and not int4_fits(linear) else bits


def _kernel_group(group: int) -> int | None:
    """The kernel group size a checkpoint group splits into exactly (a 512-wide group is two 256-wide ones with the
    same scale), or None."""
    for g in reversed(INT4_KERNEL_GROUPS):
        if group % g == 0:
            return g
    return None


def _int4_pack(wq: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Int4Weight -> (packed codes uint8 [N, K/2] in the kernel's CPU-specific layout, scales and zeros bf16 [K/g, N, 2],
    kernel group g). The kernel computes (q - 8) * s + z, so z = (8 - zero) * s."""
    g = _kernel_group(wq.group)
    repeat = wq.group // g
    scale = wq.scale.float().repeat_interleave(repeat, dim=1)
    offset = (8.0 - wq.zero.float().repeat_interleave(repeat, dim=1)) * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(wq.codes.to(torch.int32), 1)
    sz = torch.stack([scale.t(), offset.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz, g


def _native_int4(wq: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4Weight (natural input order) -> the qmatmul int4 operands, interleaved by groups of 8 outputs: packed codes
    uint8 [N/8, 4K], scale and offset fp32 [N/8, K/group * 8], with w = (q - zero) * scale = q * scale + low."""
    scale = wq.scale.float()
    low = -wq.zero.float() * scale
    return wq.packed_codes(), qmatmul.pack_int4_groups(scale), qmatmul.pack_int4_groups(low)


class ReleasedWeightError(RuntimeError):
    """A call needed the float weight of a linear layer that let it go (`FastLinear.release`)."""


# Where `FastLinear.prepare` writes its prepared form (one part's rows of its fusion's buffers, `prepare_parts`): a
# bf16 packing's or int8 codes' buffer, or int4's three (codes, scales, lows); None: new tensors.
Into = torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


class FastLinear(nn.Linear):
    """nn.Linear with a prepared inference copy of its weight: [..., in] -> [..., out].

    Inside a compiled graph (`torch.compile`) the prepared kernel is called through the `mtp::prepared_linear`
    custom op, so the compiler neither decomposes nor replaces it: a compiled decode step multiplies with exactly the
    kernel the eager one uses (and so keeps its row invariance).

    An "int8" / "int4" layer can `release` its float weight (inference only: the codes are all it runs); the weight
    is then a meta tensor of the same shape, and a call that would need it raises `ReleasedWeightError`."""

    kernel: str | None = None
    _native = False  # runs qmatmul.c ("bf16-native" always; "int8" / "int4" where it supports the shape)
    _released: nn.Parameter | None = None  # the meta placeholder `release` put in place of the weight
    checkpoint_codes = False  # "int4" / "int8" prepared from a checkpoint's own codes (`prepare`'s from_checkpoint, int8)

    @classmethod
    def wrap(cls, linear: nn.Linear, kernel: str, int4: Int4Weight | None = None, from_checkpoint: bool = False,
             packed_into: Into = None, source: LayerSource | None = None) -> FastLinear:
        """The same module (same parameters) with a prepared copy for `kernel` (int4: from `int4`'s codes when given;
        `packed_into`, `source`: `prepare`'s)."""
        linear.__class__ = cls
        linear.prepare(kernel, int4, from_checkpoint, packed_into, source)
        return linear

    @torch.no_grad()
    def prepare(self, kernel: str, int4: Int4Weight | None = None, from_checkpoint: bool = False,
                packed_into: Into = None, source: LayerSource | None = None) -> None:
        """Build the prepared copy of the weight for `kernel`; "int4" from `int4` when given (the codes of this weight,
        `Int4Weight.quantize` of it, or `from_checkpoint`: an int4 checkpoint's own codes, any kernel group size and
        act order, which the weight - when the layer holds one - is only their decode of), else quantized here.
        `packed_into`: where a "bf16-native" packing or qmatmul's int8 codes go, or (a tuple) the int4 codes it
        quantizes for qmatmul with their scales and lows (`Into`: this part's rows of its fusion's buffers).
        `source`: where a layer loaded with no weight gets what it runs (`LayerSource`; its `int4` is read by the
        caller, which passes the codes as `int4`)."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {KERNELS}")
        if self._released is not None:
            raise ReleasedWeightError(self._released_message("be prepared again"))
        if kernel == "bf16":
            kernel = bf16_kernel()
        source = source or LayerSource()
        source.check(kernel)
        pack, weight, int8 = source.pack, source.weight, source.int8
        w = self.weight.detach() if weight is None or int4 is not None or int8 is not None else weight()
        self.kernel = kernel
        self._native = False
        self._version = self.weight._version
        self._pad = 0  # int8: zero input columns the codes carry past in_features (`_set_int8`)
        self.checkpoint_codes = kernel == "int4" and int4 is not None and from_checkpoint or kernel == "int8" and int8 is not None
        if kernel == "fp32":
            # the parameter itself, or an aligned copy: MKL rounds differently for a weight at another alignment (a
            # memory-mapped tensor sits wherever the file put it), and the same checkpoint should give the same bits
            self._packed = w if w.is_contiguous() and w.data_ptr() % 64 == 0 else w.clone(memory_format=torch.contiguous_format)
        elif kernel == "bf16-native" and qmatmul.available():
            self._packed = dequant.pack_bf16_counted(w.to(torch.bfloat16), packed_into)[0] if pack is None else pack(packed_into)
            self._native = True
        elif kernel in ("bf16", "bf16-native"):
            self.kernel = "bf16"
            w = w.to(torch.bfloat16)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1) if packed_bf16_supported() else w.contiguous()
        elif kernel == "int4":
            group = int4_group_for(self.in_features)
            if group is None or not int4_supported(self.out_features, self.in_features, group):
                raise ValueError(f"int4 needs out_features % 16 == 0 and in_features % 32 == 0, got {list(w.shape)}")
            if int4 is None and qmatmul.available() and qmatmul.supports(self.in_features, group):
                self._set_int4_rows(w, group, packed_into if isinstance(packed_into, tuple) else None)
            else:
                self._set_int4(int4 if int4 is not None else Int4Weight.quantize(w, group))
        elif int8 is not None:
            codes = int8(packed_into)
            self._packed, self._scale, self._native = codes.packed, codes.scale, True
            self._pad = codes.packed.shape[1] * 4 - self.in_features
        else:
            self._set_int8_from(w, packed_into)
        if not hasattr(self, "_slot"):
            self._slot = _register(self)

    def _set_int8(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """codes int8 [N, K], scale fp32 [N] (`quantize_int8`). K is padded with zero codes to a multiple of 32 (the
        inputs with zeros as the layer runs: exact zero terms): qmatmul's blocks need it, and torch 2.13's int8
        kernel reads past the row for K % 16 = 8 on AVX-512 CPUs (NaN outputs, or a crash; docs/decisions.md).
        qmatmul's codes are interleaved by groups of 8 outputs (`qmatmul.pack_int8`); torch's stay row-major."""
        self._pad = -codes.shape[1] % qmatmul.BLOCK
        codes = F.pad(codes, (0, self._pad)) if self._pad else codes
        self._native = qmatmul.available() and qmatmul.supports(self.in_features + self._pad)
        self._packed = qmatmul.pack_int8(codes) if self._native else codes
        self._scale = scale if self._native else scale.to(torch.bfloat16)

    def _set_int8_from(self, w: torch.Tensor, into: torch.Tensor | None = None) -> None:
        """`_set_int8(*quantize_int8(w))`; for qmatmul's kernel the codes go straight into its layout in one C pass
        (`rtn.quantize_int8_packed`: no [N, K] codes, no separate packing), into `into` when given (this part's
        groups of its fusion's buffer: `prepare_parts`)."""
        pad = -self.in_features % qmatmul.BLOCK
        fast = rtn.quantize_int8_packed(w, self.in_features + pad, qmatmul.isa() != "avx2", into) \
            if qmatmul.available() else None
        if fast is None:
            self._set_int8(*quantize_int8(w))
            if into is not None and self._native:  # (a row holding NaN / Inf: the torch form, then into its rows)
                self._packed = into.copy_(self._packed)
            return
        self._packed, self._scale = fast
        self._pad, self._native = pad, True

    def _set_int4(self, wq: Int4Weight) -> None:
        self._perm = wq.perm
        self._native = qmatmul.available() and qmatmul.supports(self.in_features, wq.group)
        if self._native:
            self._group = wq.group
            self._packed, self._sz, self._low = _native_int4(wq)
        else:
            self._packed, self._sz, self._group = _int4_pack(wq)

    def _set_int4_rows(self, w: torch.Tensor, group: int,
                       into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """`_set_int4(Int4Weight.quantize(w, group))` for the qmatmul kernel, QUANT_ROWS output rows at a time (its
        packing is by groups of 8 rows, so the result is the same): the [N, K] unpacked codes are never held at once.
        In one C pass where it runs (`rtn.quantize_int4_packed`: the codes straight into the kernel's layout). `into`:
        the (packed, scale, low) buffers to write, as `rtn.quantize_int4_packed` takes them."""
        N, K = w.shape
        self._perm, self._native, self._group = None, True, group
        fast = rtn.quantize_int4_packed(w, group, into=into)
        if fast is not None:
            self._packed, self._sz, self._low = fast
            return
        self._packed, self._sz, self._low = into or (torch.empty(N // 8, 4 * K, dtype=torch.uint8),
                                                     torch.empty(N // 8, K // group * 8), torch.empty(N // 8, K // group * 8))
        for i in range(0, N, QUANT_ROWS):  # (QUANT_ROWS % 8 == 0)
            groups = slice(i // 8, (i + QUANT_ROWS) // 8)
            self._packed[groups], self._sz[groups], self._low[groups] = _native_int4(Int4Weight.quantize(w[i : i + QUANT_ROWS], group))

    @property
    def released(self) -> bool:
        """Was the float weight let go (`release`)?"""
        return self._released is not None

    def release(self) -> None:
        """Let go of the float weight of an "int8" / "int4" layer, or of a "bf16-native" one on qmatmul's product
        (inference only): the module then holds its codes and scales (its packed weight: the same numbers, permuted),
        and `weight` is a meta tensor of the same shape and dtype (no memory). A call with grad enabled, or after the
        weight was changed or replaced, raises `ReleasedWeightError` instead of running stale codes."""
        if self.kernel not in ("int8", "int4") and not (self.kernel == "bf16-native" and self._native):
            raise ValueError(f"only an int8 / int4 layer or a packed bf16 one can release its float weight "
                             f"(kernel {self.kernel})")
        if self._released is not None:
            return
        w = self.weight
        placeholder = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        self.weight = placeholder  # only this module's reference: a weight tied to another module stays there
        self._version = placeholder._version
        self.__dict__["_released"] = placeholder  # a plain attribute, not a second registered parameter

    def _released_message(self, what: str) -> str:
        held = "its packed copy" if self.kernel == "bf16-native" else "its quantized codes"
        return (f"linear layer [{self.out_features} <- {self.in_features}] ({self.kernel}) holds only {held} "
                f"(loaded for inference with release=True, as `mtp generate/serve/bench/check` load): it cannot {what}; "
                "load the model without release=True to train or change its weights")

    @torch.no_grad()
    def restore(self) -> None:
        """Give a released "bf16-native" layer its float weight back, unpacked from its packed copy (exactly the
        weight it released: `qmatmul.unpack_bf16`); the packed copy is not rebuilt. Anything else released raises."""
        if self._released is None:
            return
        if self.kernel != "bf16-native":
            raise ReleasedWeightError(self._released_message("give its float weight back"))
        w = qmatmul.unpack_bf16(self._packed, self.out_features, self.in_features).to(self._released.dtype)
        del self.__dict__["_released"]
        self.weight = nn.Parameter(w, requires_grad=False)
        self._version = self.weight._version

    def int8_decoded(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An "int8" layer's weight as its codes give it, codes x scales (`packed.dequantize_scaled`, per channel):
        [out, in] in `dtype` (what it multiplies by)."""
        if self.kernel != "int8":
            raise ValueError(f"not an int8 layer (kernel {self.kernel})")
        codes = qmatmul.unpack_int8(self._packed, self.out_features) if self._native else self._packed
        return dequantize_scaled(codes[:, : self.in_features], self._scale, None, dtype)

    @torch.no_grad()
    def requantize(self, kernel: str) -> None:
        """`prepare(kernel)` for a layer that may have released its float weight: then from the codes it holds
        (`int8_decoded`; an int8 layer only), and the weight released again. A coarser copy for drafting (an int8
        layer's int4 codes: the int8 rounding then the int4 one) - not a substitute for quantizing the float weight."""
        if self._released is None:
            return self.prepare(kernel)
        decoded = self.int8_decoded(self._released.dtype)
        del self.__dict__["_released"]
        self.weight = nn.Parameter(decoded, requires_grad=False)
        self.prepare(kernel)
        self.release()

    def int4_weight(self) -> Int4Weight:
        """The int4 codes, scales and zero points `prepare("int4")` ran (an "int4" layer only)."""
        if self.kernel != "int4":
            raise ValueError(f"not an int4 layer (kernel {self.kernel})")
        if self._released is not None:
            raise ReleasedWeightError(self._released_message("give its float weight's int4 codes again"))
        if self.checkpoint_codes:
            raise ValueError("this int4 layer runs an int4 checkpoint's own codes; they are not kept unpacked (read them "
                             "from the checkpoint: `DecodedTensor.int4`), and quantizing its weight would not give them")
        return Int4Weight.quantize(self.weight.detach(), int4_group_for(self.in_features))  # as `prepare` did: same codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self.kernel is None:
                return F.linear(x, self.weight, self.bias)
            return torch.ops.mtp.prepared_linear(x, self._slot, self.out_features)
        if self.kernel is None or torch.is_grad_enabled() or self.weight._version != self._version:
            if self._released is not None:
                raise ReleasedWeightError(self._released_message("run with gradients enabled or after its weight changed"))
            return F.linear(x, self.weight, self.bias)
        if self._released is not None and self.weight is not self._released:  # a new weight assigned (load_state_dict)
            raise ReleasedWeightError(self._released_message("take a new weight"))
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The prepared kernel: x [..., in] -> [..., out] in x's dtype."""
        if self.kernel == "fp32":
            return linear_rows(x, self._packed, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.bfloat16:  # (no-op conversions skipped: at the shipped model's widths a step is dispatch)
            x2 = x2.to(torch.bfloat16)
        if self.kernel == "int4" and self._perm is not None:  # act order: the codes' columns are the inputs in this order
            x2 = x2.index_select(1, self._perm)
        if self._pad:
            x2 = F.pad(x2, (0, self._pad))
        if self.kernel == "bf16-native" or (self.kernel in ("int8", "int4") and self._native):
            bias = None if self.bias is None else self.bias.float()  # qmatmul adds an fp32 bias before its one rounding
            if not x2.is_contiguous():
                x2 = x2.contiguous()
            if self.kernel == "bf16-native":
                y = qmatmul.bf16_linear(x2, self._packed, self.out_features, bias)
            else:
                wide = x2.shape[0] >= WIDE_MIN_ROWS and prompt_products_on()
                if self.kernel == "int4":
                    y = qmatmul.q4_linear(x2, self._packed, self._sz, self._low, self._group, bias, wide)
                else:
                    y = qmatmul.q8_linear(x2, self._packed, self._scale, bias, wide)
            return (y if x.dtype == torch.bfloat16 else y.to(x.dtype)).reshape(*shape[:-1], y.shape[-1])
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        if self.kernel == "bf16" and self._packed.layout == torch.strided:  # no oneDNN bf16 packing on this CPU
            y = F.linear(x2, self._packed, bias)
        elif self.kernel == "bf16":
            y = torch.ops.mkldnn._linear_pointwise(x2, self._packed, bias, "none", [None], "")
        else:
            if self.kernel == "int4":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self._packed, self._group, self._sz)
            else:
                y = torch._weight_int8pack_mm(x2.contiguous(), self._packed, self._scale)
            if bias is not None:
                y = y + bias
        return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])


_ROWS = threading.local()
_PROMPT = threading.local()
# int8/int4 rows from this many up, within `prompt_products`, run on the bf16 tiles (qmatmul.c `q4_linear_wide`): at
# 2048 x 384, one thread, AMX Xeon: 16 rows 107 vs 83 us, 64 rows 160 vs 235, 256 rows 395 vs 890 (int4)
WIDE_MIN_ROWS = 64


@contextmanager
def _switched_on(flag: threading.local) -> Iterator[None]:
    """flag.on is True within (this thread), and back to what it was after."""
    before = getattr(flag, "on", False)
    flag.on = True
    try:
        yield
    finally:
        flag.on = before


@contextmanager
def row_invariant() -> Iterator[None]:
    """Within: `linear_rows` multiplies row by row. The decoder runs its rounds in it (a plain step and every row of a
    verify or of a batch then round alike); a prefill or training forward over many rows does not pay for it."""
    with _switched_on(_ROWS):
        yield


@contextmanager
def prompt_products() -> Iterator[None]:
    """Within: the int8/int4 layers that qmatmul runs multiply WIDE_MIN_ROWS rows or more on the bf16 tiles, their codes
    decoded to bf16 weights (where the build has them, `qmatmul.wide_available`), not by the integer kernels: other bits,
    so only what every path computes alike may run in it - a prompt's chunks (`decode.prefill.prefill_chunk`) and the
    MTP's read of the prompt, never a decode step or a verify (those must equal each other bit for bit)."""
    with _switched_on(_PROMPT):
        yield


def prompt_products_on() -> bool:
    """Is this thread within `prompt_products()`? (step.py's one-call prefill asks, to multiply as the layers would.)"""
    return getattr(_PROMPT, "on", False)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed one row at a time within `row_invariant()` when there are several rows and no gradient:
    x [..., in] -> [..., out], each row then exactly what a 1-row product gives whatever the BLAS. Each row is made
    contiguous: a GEMV may round differently for an input at another alignment."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 1 or torch.is_grad_enabled() or not getattr(_ROWS, "on", False):
        return F.linear(x, weight, bias)
    y = torch.cat([F.linear(x2[i : i + 1].contiguous(), weight, bias) for i in range(x2.shape[0])])
    return y.reshape(*shape[:-1], weight.shape[0])


# Prepared layers by slot, for the custom op (a compiled graph holds the slot number, not the module).
_SLOTS: weakref.WeakValueDictionary[int, FastLinear] = weakref.WeakValueDictionary()
_NEXT_SLOT = itertools.count()


def _register(layer: FastLinear) -> int:
    slot = next(_NEXT_SLOT)
    _SLOTS[slot] = layer
    return slot


@torch.library.custom_op("mtp::prepared_linear", mutates_args=())
def prepared_linear(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    """The prepared kernel of the FastLinear in `slot`: [..., in] -> [..., out_features]. The weight is not an input:
    a released layer's is a meta tensor, and a graph given one does not run the op on the host's tensors."""
    return _SLOTS[slot].run(x)


@prepared_linear.register_fake
def _(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class FusedProjections:
    """Several prepared linear layers that read the same input, run as ONE prepared matmul over their concatenated
    weights (fewer, larger kernel calls per decoding step: q|k|v, gate|up, the Gated DeltaNet's four input
    projections). Held as a plain attribute of the module that owns the layers, never a submodule, so parameter
    names and the state dict do not change. Used only while every part is prepared, unchanged and grad is off.

    int8 and int4 parts are quantized per output row, so the fused codes are the parts' codes concatenated along the
    outputs (exactly what quantizing the concatenated weight gives): the fusion is built from them, with no float
    copy, and the parts then run on views of the fused codes (no second copy) where the layout allows: torch's
    row-major int8 codes, and qmatmul's codes interleaved by groups of 8 outputs (int8 parts padded to a group in the
    fused layer: `padded`). torch's CPU int4 packing does not, so there the fused packing is built from the parts'
    unpacked codes (`int4`) and each part keeps its own. "bf16-native" parts are fused from their packed weights as
    qmatmul's int8 codes are (groups of 8 outputs, 16 in the AMX build; the parts' views); bf16 / fp32 parts from their
    weights."""

    def __init__(self, parts: list[FastLinear], int4: list[Int4Weight] | None = None):
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        self.padded = list(self.sizes)  # each part's width in the fused output (with int8 group pads: `_fuse_codes`)
        kernel = parts[0].kernel
        if kernel in ("int8", "int4") or parts[0]._native:
            bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
            self.fused = nn.Linear(parts[0].in_features, sum(self.sizes), bias=bias is not None, device="meta")
            if bias is not None:
                self.fused.bias = nn.Parameter(bias, requires_grad=False)
            self.fused.__class__ = FastLinear
            self._fuse_codes(int4)
        else:
            weight = torch.cat([p.weight.detach() for p in parts], dim=0)
            bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
            self.fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            self.fused.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                self.fused.bias = nn.Parameter(bias, requires_grad=False)
            FastLinear.wrap(self.fused, kernel)
        self.versions = [p.weight._version for p in parts]

    @torch.no_grad()
    def _fuse_codes(self, int4: list[Int4Weight] | None) -> None:
        """The fused layer's codes from the parts' prepared ones (int4 on torch's kernel: from `int4`, the parts'
        Int4Weights); then the parts run on row views of them. The fused layer holds no float weight (a meta
        placeholder, as a released layer does: it is only ever called through `usable`)."""
        f, parts = self.fused, self.parts
        f.kernel = parts[0].kernel
        f._native, f._pad = parts[0]._native, parts[0]._pad
        # qmatmul's int8 codes (and bf16 weights) come in groups of 8 outputs (bf16 in the AMX build: 16): each part
        # starts at a group, its last one padded with zero codes (and zero scales), so the parts stay views of the fused
        # codes; the fused outputs then hold the pads
        grouped = f.kernel in ("int8", "bf16-native") and f._native
        unit = qmatmul.bf16_group() if f.kernel == "bf16-native" else 8
        self.padded = [-(-n // unit) * unit for n in self.sizes] if grouped else list(self.sizes)
        f.out_features = sum(self.padded)
        f.__dict__["_released"] = None
        f.weight = nn.Parameter(torch.empty(f.out_features, f.in_features, dtype=parts[0].weight.dtype, device="meta"),
                                requires_grad=False)
        cat = lambda attr: _joined([getattr(p, attr) for p in parts])  # noqa: E731
        if parts[0].bias is not None:  # (again on a refresh: the parts' current biases, padded as the codes are)
            f.bias = nn.Parameter(torch.cat([F.pad(p.bias.detach(), (0, m - n)) for p, n, m in
                                             zip(parts, self.sizes, self.padded)]), requires_grad=False)
        # the fused tensors the parts then view, and how many outputs one of their rows holds (qmatmul codes: 8)
        if f.kernel == "bf16-native":
            f._packed = cat("_packed")
            views = {"_packed": unit}
        elif grouped:
            f._packed = cat("_packed")
            f._scale = torch.cat([F.pad(p._scale, (0, m - n)) for p, n, m in zip(parts, self.sizes, self.padded)])
            views = {"_packed": 8, "_scale": 1}
        elif f.kernel == "int8":
            f._packed, f._scale = cat("_packed"), cat("_scale")
            views = {"_packed": 1, "_scale": 1}
        elif f._native:  # int4 layers have a multiple of 16 outputs: every part starts at a group of 8
            f._perm, f._group = parts[0]._perm, parts[0]._group  # the parts' own (`fusable`: all alike)
            f._packed, f._sz, f._low = cat("_packed"), cat("_sz"), cat("_low")
            views = {"_packed": 8, "_sz": 8, "_low": 8}
        else:
            if int4 is None:
                raise ValueError("fusing int4 layers for torch's kernel needs their Int4Weights (its packing is not by row)")
            f._set_int4(Int4Weight(torch.cat([q.codes for q in int4]), torch.cat([q.scale for q in int4]),
                                   torch.cat([q.zero for q in int4]), int4[0].group, int4[0].perm))
            views = {}
        start = 0
        for p, n, m in zip(parts, self.sizes, self.padded):
            for attr, unit in views.items():
                setattr(p, attr, getattr(f, attr)[start // unit : (start + n + unit - 1) // unit])
            start += m
        f._version = f.weight._version
        f.__dict__["_released"] = f.weight
        if not hasattr(f, "_slot"):
            f._slot = _register(f)

    def usable(self) -> bool:
        if not torch.is_grad_enabled() and all(p.kernel == self.fused.kernel for p in self.parts):
            # a tensor's version is a host counter that a compiled graph cannot guard on (reading it breaks the
            # graph): compiled code trusts the fused weights, and decode/compiled.py renews stale ones (`renew_prepared`)
            # as each decoder starts
            return torch.compiler.is_compiling() or self.fresh()
        return False

    def fresh(self) -> bool:
        """No part's weight was changed in place (or replaced, for a released part) since the fusion."""
        return ([p.weight._version for p in self.parts] == self.versions
                and all(p._released is None or p.weight is p._released for p in self.parts))

    @torch.no_grad()
    def refresh(self) -> None:
        """Fuse the parts' current weights again (after an in-place change), into the same prepared layer."""
        if self.fused.kernel in ("int8", "int4") or self.fused._native:
            int4 = prepare_parts(self.parts, self.fused.kernel)  # raises for a released part: its weight is gone
            self._fuse_codes(int4)
        else:
            self.fused.weight.copy_(torch.cat([p.weight.detach() for p in self.parts], dim=0))
            if self.fused.bias is not None:
                self.fused.bias.copy_(torch.cat([p.bias.detach() for p in self.parts]))
            self.fused.prepare(self.fused.kernel)
        self.versions = [p.weight._version for p in self.parts]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., in] -> one output per part, [..., out_i] (views of the fused output, its group pads left out)."""
        out = self.fused(x).split(self.padded, dim=-1)
        if self.padded == self.sizes:
            return list(out)
        return [t if m == n else t[..., :n] for t, n, m in zip(out, self.sizes, self.padded)]


def project(module: nn.Module, x: torch.Tensor, *names: str) -> list[torch.Tensor]:
    """The outputs of `module`'s linear layers `names` on the same input x: through their fused form when
    `prepare_for_inference` built one (`module._fused`), else one by one."""
    fused = module.__dict__.get("_fused")
    if fused is not None and fused.usable():
        return fused(x)
    return [getattr(module, n)(x) for n in names]


@dataclass(frozen=True)
class LayerSource:
    """What a layer runs, given on demand by its checkpoint (model/checkpoint.py) instead of being prepared from the
    weight it holds (a released load leaves that weight meta, never loaded), one field for one kernel:
    `int4()`: an int4 checkpoint's own codes ("int4", `DecodedTensor.int4`; the layer may also hold their decode);
    `int8(into)`: an int8 checkpoint's own codes in qmatmul's layout, into the given buffer or a new one, and per-row
    scales ("int8" on qmatmul's kernel, `DecodedTensor.int8`); `pack(into)`: the weight in `qmatmul.pack_bf16`'s
    layout ("bf16-native" on qmatmul's product, `DecodedTensor.packed_bf16`); `weight()`: the float weight [out, in] to
    quantize ("int8" / "int4"; only read while the layer is prepared: a load decodes each into one reused scratch)."""

    int4: Callable[[], Int4Weight] | None = None
    int8: Callable[[torch.Tensor | None], Int8Codes] | None = None
    pack: Callable[[torch.Tensor | None], torch.Tensor] | None = None
    weight: Callable[[], torch.Tensor] | None = None

    def split(self, kernel: str) -> tuple[Int4Weight | None, LayerSource]:
        """(the int4 checkpoint codes, read now where `kernel` is "int4" and `int4` gives them, else None; the rest of
        this source): what `FastLinear.prepare` takes as `int4` and as `source`."""
        return (self.int4() if self.int4 is not None and kernel == "int4" else None), replace(self, int4=None)

    def check(self, kernel: str) -> None:
        """ValueError where a field is given that `kernel` (as resolved by `FastLinear.prepare`) cannot use (`int4` is
        read by the callers, for "int4" only)."""
        if self.pack is not None and not (kernel == "bf16-native" and qmatmul.available()):
            raise ValueError(f"a packed bf16 source needs qmatmul's bf16 product (kernel {kernel})")
        if self.int8 is not None and not (kernel == "int8" and qmatmul.available()):
            raise ValueError(f"an int8 checkpoint source needs qmatmul's int8 kernel (kernel {kernel})")
        if self.weight is not None and kernel not in ("int8", "int4"):
            raise ValueError(f"a weight source is for quantizing (kernel int8 / int4), not {kernel}")


Sources = dict[str, LayerSource]  # module name -> its LayerSource


def prepare_parts(parts: list[nn.Linear], kernel: str, sources: list[LayerSource | None] | None = None
                  ) -> list[Int4Weight] | None:
    """Prepare the layers of one fusion for `kernel`, each from its `LayerSource` where `sources` has one ("int4": a
    part's checkpoint codes; bf16 on qmatmul's product: its packing; int8 / int4: the weight to quantize; int8: its
    checkpoint codes); for "int4" on torch's kernel also return their Int4Weights (what `FusedProjections` builds the
    fused packing from), else None."""
    int4 = None
    groups = [int4_group_for(p.in_features) for p in parts]
    split = [(s or LayerSource()).split(kernel) for s in sources or [None] * len(parts)]
    codes, sources = [c for c, _ in split], [rest for _, rest in split]
    if (kernel == "int4" and None not in groups
            and not all(qmatmul.available() and qmatmul.supports(p.in_features, q.group if q is not None else g)
                        for p, g, q in zip(parts, groups, codes))):
        int4 = [q if q is not None else Int4Weight.quantize(p.weight.detach() if s.weight is None else s.weight(), g)
                for p, g, q, s in zip(parts, groups, codes, sources)]
        sources = [LayerSource()] * len(parts)  # (quantized already)
    # bf16, int8 and quantized int4 on qmatmul's products: each part packs into its rows of one buffer (int4: three,
    # its codes, scales and lows), which the fusion then runs as it is (`_joined`) instead of concatenating the
    # packings (a copy of most of the model's weights at load)
    into: list[Into] = [None] * len(parts)
    if qmatmul.available() and len(parts) > 1 and len({p.in_features for p in parts}) == 1:
        K, g = parts[0].in_features, groups[0]
        if kernel == "bf16-native" or kernel == "bf16" and bf16_kernel() == "bf16-native":
            into = _rows([qmatmul.bf16_packed_shape(p.out_features, K) for p in parts], torch.bfloat16)
        elif kernel == "int8":
            into = _rows([(-(-p.out_features // 8), -(-K // qmatmul.BLOCK) * qmatmul.BLOCK // 4, 8, 4) for p in parts],
                         torch.uint8)
        elif (kernel == "int4" and int4 is None and g is not None and len(set(groups)) == 1 and all(q is None for q in codes)
              and qmatmul.supports(K, g) and all(int4_supported(p.out_features, K, g) for p in parts)):
            into = list(zip(_rows([(p.out_features // 8, 4 * K) for p in parts], torch.uint8),
                            *(_rows([(p.out_features // 8, K // g * 8) for p in parts], torch.float32) for _ in range(2))))
    for i, p in enumerate(parts):
        wq = int4[i] if int4 is not None else codes[i]
        if isinstance(p, FastLinear):
            p.prepare(kernel, wq, codes[i] is not None, into[i], sources[i])
        else:
            FastLinear.wrap(p, kernel, wq, codes[i] is not None, into[i], sources[i])
    return int4


def _rows(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """One new buffer split into consecutive row blocks of these shapes (alike but in dim 0), one a part."""
    return list(torch.empty(sum(s[0] for s in shapes), *shapes[0][1:], dtype=dtype).split([s[0] for s in shapes]))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0; with no copy where the parts are, in order, the consecutive row blocks of one
    contiguous tensor (packed into their fusion's buffer: `prepare_parts`): that tensor."""
    base = parts[0]._base
    if base is not None and base.is_contiguous() and all(t._base is base and t.is_contiguous() for t in parts) \
            and sum(t.shape[0] for t in parts) == base.shape[0] and parts[0].data_ptr() == base.data_ptr() \
            and all(a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(parts, parts[1:])):
        return base
    return torch.cat(parts)


def fusable(parts: list[FastLinear], int4: list[Int4Weight] | None = None) -> bool:
    """Can these prepared layers run as one (`FusedProjections`; `int4`: `prepare_parts`'s)? One kernel; int4 parts
    also one kernel build, group size and input order (parts from an int4 checkpoint keep its group size, and with act
    order each permutes its inputs: fused only where all alike)."""
    first = parts[0]
    if any(p.kernel != first.kernel for p in parts):
        return False
    if first.kernel != "int4":
        return True
    if not first._native and int4 is None:  # (torch's int4 packing is not by row: fused from the Int4Weights only)
        return False
    return (all(p._native == first._native and p._group == first._group
                and (p._perm is None if first._perm is None else p._perm is not None and torch.equal(p._perm, first._perm))
                for p in parts)
            and (int4 is None or all(q.group == int4[0].group for q in int4)))


def prepare_for_inference(model: nn.Module, kernel: str, skip: tuple[str, ...] = (),
                          prepared: Callable[[FastLinear], None] | None = None, sources: Sources | None = None,
                          prefix: str = "") -> int:
    """Swap every nn.Linear of `model` (but those whose name ends with one of `skip`) for a FastLinear prepared for
    `kernel`, and fuse each module's `fused_projections` (unless their prepared forms differ: `fusable`). Returns how
    many layers were prepared. Parameters, names and the state dict do not change. `prepared(layer)` is called for
    each layer once its prepared form (and its fusion's) exists, layer by layer: the caller may let go of its float
    weight there (`FastLinear.release`). A layer named in `sources` is prepared from its `LayerSource` (its checkpoint's
    codes, packing or weight). `prefix`: the name of `model` inside the model the names in `skip` and `sources` are
    from (a submodule's layers by their full names)."""
    sources = sources or {}
    n = 0
    done: set[int] = set()
    skipped = lambda name: any(name.endswith(s) for s in skip)  # noqa: E731
    for name, m in model.named_modules():
        name = f"{prefix}.{name}" if prefix and name else prefix or name
        names = getattr(m, "fused_projections", None)
        if names:
            parts = [m._modules.get(x) for x in names]
            if all((type(p) is nn.Linear or isinstance(p, FastLinear)) and not skipped(f"{name}.{x}" if name else x)
                   for p, x in zip(parts, names)):
                full = [f"{name}.{x}" if name else x for x in names]
                fused = prepare_parts(parts, kernel, [sources.get(f) for f in full])
                if fusable(parts, fused):
                    m.__dict__["_fused"] = FusedProjections(parts, fused)
                else:
                    m.__dict__.pop("_fused", None)
                for p in parts:
                    done.add(id(p))
                    if prepared is not None:
                        prepared(p)
                if fusion := m.__dict__.get("_fused"):  # `prepared` may have released the parts' weights: a release
                    fusion.versions = [p.weight._version for p in parts]  # swaps in a placeholder, it changes nothing
                n += len(parts)
        if (type(m) is nn.Linear or isinstance(m, FastLinear)) and id(m) not in done and not skipped(name):
            codes, rest = sources.get(name, LayerSource()).split(kernel)
            if isinstance(m, FastLinear):
                m.prepare(kernel, codes, codes is not None, source=rest)
            else:
                FastLinear.wrap(m, kernel, codes, codes is not None, source=rest)
            done.add(id(m))
            if prepared is not None:
                prepared(m)
            n += 1
    return n


def renew_prepared(model: nn.Module) -> int:
    """Prepare again every layer and fusion of `model` whose weights changed in place since they were prepared.
    Eager calls check this at each call; compiled graphs cannot (a tensor's version is a host counter), so they trust
    the prepared copies and decode/compiled.py calls this as each decoder starts. Returns how many were renewed."""
    n = 0
    for m in model.modules():
        if isinstance(m, FastLinear) and m.kernel is not None and m.weight._version != m._version:
            m.prepare(m.kernel)
            n += 1
        fused = m.__dict__.get("_fused")
        if fused is not None and not fused.fresh():
            fused.refresh()
            n += 1
    return n
