"""The decode forward of a Qwen3.5 dense backbone as one C call (`step.c`) on x86 CPUs: `Qwen35ForCausalLM.decode`
runs it where `decode(...)` can (else it returns None and the layers run one by one).

At the shipped model's size a decode step is overhead, not arithmetic: ~400 tensor operations, ~80 module calls and
~45 ctypes calls per plain step, ~1.8 of its ~2.9 ms on an AMX Xeon (docs/decisions.md, 2026-12-02). The program
holds, once per model, each layer's prepared weights, norms and shapes (`Program`); a call fills in the caches and
positions and runs every layer without returning to Python. It runs the eager path's own C kernels (their function
pointers, so the same machine code) and exact operations between them, so its outputs equal the eager forward's bit
for bit (tests/test_step.py): greedy decoding through it is the eager decoding.

What it runs: a bf16 model on the CPU whose backbone is exactly Gated DeltaNet / gated-attention layers with SwiGLU
MLPs and zero-centred norms, every projection a `FastLinear` on qmatmul.c - int8, int4, or bf16 weights on its bf16
product ("bf16-native": what bf16 layers run where oneDNN cannot pack them, `linear.bf16_kernel`) - fused where the
eager path fuses, no bias, no act-order permutation; no hooks, no autograd, not compiling, and a decode forward whose
rows' first positions are on the host (`Positions.starts`). Anything else (bf16 weights on oneDNN, MoE, LoRA, a
compiled graph) takes the per-layer path. MTP_STEP=0 (or MTP_NATIVE=0) turns it off.

The draft chain of the MTP (decode/round.py `draft`, greedy or by the drafts' rule: repetition penalty, temperature,
top-k) is one call too (`draft`, `build_draft`): each depth's embedding row, pre-fc norms, input
projection, MTP layer and norm, the head (int8, int4 or bf16-native; or a reduced draft vocabulary's head in the
drafts' precision, its argmax mapped to the token ids) and the pick (the argmax, or a sampled row's argmax of x + its
noise, x = logits penalised over the tokens seen and the drafts before, / T, cut to its top-k, writing the x the
unseeded rule reads as q), K depths back to back: ~25 tensor operations and 2 program calls per depth before, the
same drafts, q and MTP keys/values bit for bit (tests/test_step.py).
"""

from __future__ import annotations

import ctypes
import operator
import os
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from . import act, argmax_kernel, attention_kernel, deltanet_kernel, norm_kernel, qmatmul, top_p_kernel
from .attention import GatedAttention
from .base import PickRule
from .cache import Cache, DeltaState, DeltaSteps, KVCache, Positions
from .deltanet import GatedDeltaNet
from .layer import MLP, DecoderLayer
from .linear import WIDE_MIN_ROWS, FastLinear, prompt_products_on
from .native import NativeLibrary
from .norm import RMSNorm

p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(n, p) for n in ("q8_linear", "q4_linear", "rmsnorm", "deltanet_decode", "attend_decode", "silu_mul",
                                 "sigmoid_mul", "bf16_linear", "argmax_rows", "top_p_rows", "q8_linear_wide",
                                 "q4_linear_wide", "attend_prompt", "bf16_linear_fused", "q8_linear_wide_fused",
                                 "q4_linear_wide_fused")]


class _Linear(ctypes.Structure):
    _fields_ = [("bits", i64), ("N", i64), ("K", i64), ("G", i64), ("w", p), ("scale", p), ("low", p)]


class _Layer(ctypes.Structure):
    _fields_ = ([("kind", i64), ("norm1", p), ("norm2", p), ("in_", _Linear * 4), ("n_in", i64), ("Nin", i64),
                 ("off", i64 * 4)] + [(n, _Linear) for n in ("out", "gate_up", "down")] + [("I", i64), ("up", i64)]
                + [(n, i64) for n in ("Hk", "Hv", "Kd", "Vd", "kernel")]
                + [(n, p) for n in ("taps", "A_log", "dt_bias", "gnorm", "knorm")] + [("geps", f32), ("scale", f32)]
                + [(n, p) for n in ("conv", "ssm", "values", "window", "updates")])


class _Step(ctypes.Structure):
    _fields_ = ([(n, i64) for n in ("B", "T", "H", "V", "S", "R")] + [("eps", f32)]
                + [(n, p) for n in ("ids", "x", "index", "starts", "embed", "cos", "sin", "norm", "out")]
                + [("prompt", i64)])


class _Draft(ctypes.Structure):
    _fields_ = ([(n, i64) for n in ("B", "W", "K", "H", "V", "S", "R", "P")] + [("eps", f32)]
                + [(n, p) for n in ("embed", "norm_e", "norm_h", "norm")] + [("fc", _Linear), ("head", _Linear), ("vocab_ids", p)]
                + [(n, p) for n in ("cos", "sin", "pend_h", "pend_next")] + [("PR", i64)]
                + [(n, p) for n in ("pend_n", "mtp_pos", "drafts", "temp", "greedy", "top_k", "noise", "q", "penalty",
                                    "seen")])


class _Pick(ctypes.Structure):
    _fields_ = [(n, p) for n in ("temp", "greedy", "top_k", "noise", "unseeded", "q", "u", "drafts", "limit", "penalty",
                                 "seen", "top_p")]


def _fits(sampling: PickRule, B: int, T: int, V: int) -> bool:
    """Are `sampling`'s tensors what the C picks read for B rows of T tokens over V: temperature fp32 [B], greedy
    bool [B], top_k long [B] (step.c keeps every token where it is < 1 or >= V), noise and q (if given) fp32
    [B, T, V], penalty fp32 [B] and seen bool [B, V] (both or neither), top_p fp32 [B] (if given), contiguous, on the
    CPU? (Noise may be None only where every row is greedy: the caller knows, the C picks read no noise for a greedy
    row.)"""
    t, greedy, top_k, noise, q, penalty, seen, top_p = sampling
    given = [x for x in (t, greedy, top_k, noise, q, penalty, seen, top_p) if x is not None]
    f32 = lambda x, shape: x.dtype == torch.float32 and x.shape == shape  # noqa: E731
    return (f32(t, (B,)) and greedy.dtype == torch.bool and greedy.shape == (B,)
            and top_k.dtype == torch.int64 and top_k.shape == (B,) and (noise is None or f32(noise, (B, T, V)))
            and (q is None or f32(q, (B, T, V))) and (penalty is None) == (seen is None)
            and (penalty is None or (f32(penalty, (B,)) and seen.dtype == torch.bool and seen.shape == (B, V)))
            and (top_p is None or f32(top_p, (B,)))
            and all(x.is_contiguous() and x.device.type == "cpu" for x in given))


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _declare(lib: ctypes.CDLL) -> None:
    for name, struct in (("qwen35_decode", _Step), ("qwen35_draft", _Draft)):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(struct), ctypes.POINTER(_Layer), i64, ctypes.c_int]
        fn.restype = ctypes.c_int


LIBRARY = NativeLibrary("step.c", "MTP_STEP", "decode forwards run layer by layer", _declare)
_LIBRARIES = (qmatmul.LIBRARY, norm_kernel.LIBRARY, deltanet_kernel.LIBRARY, attention_kernel.LIBRARY, act.LIBRARY,
              argmax_kernel.LIBRARY, top_p_kernel.LIBRARY)


def _kernels() -> _Kernels:
    fn = lambda lib, name: ctypes.cast(getattr(lib.handle(), name), p).value  # noqa: E731
    wide = qmatmul.wide_available()  # (the AMX build)
    return _Kernels(fn(qmatmul.LIBRARY, "q8_linear"), fn(qmatmul.LIBRARY, "q4_linear"), fn(norm_kernel.LIBRARY, "rmsnorm"),
                    fn(deltanet_kernel.LIBRARY, "deltanet_decode"), fn(attention_kernel.LIBRARY, "attend_decode"),
                    fn(act.LIBRARY, "silu_mul"), fn(act.LIBRARY, "sigmoid_mul"), fn(qmatmul.LIBRARY, "bf16_linear"),
                    fn(argmax_kernel.LIBRARY, "argmax_rows"), fn(top_p_kernel.LIBRARY, "top_p_rows"),
                    fn(qmatmul.LIBRARY, "q8_linear_wide") if wide else None,
                    fn(qmatmul.LIBRARY, "q4_linear_wide") if wide else None, fn(attention_kernel.LIBRARY, "attend_prompt"),
                    *(fn(qmatmul.LIBRARY, name) if wide else None  # the tile products fused with their next step
                      for name in ("bf16_linear_fused", "q8_linear_wide_fused", "q4_linear_wide_fused")))


class Ineligible(Exception):
    """Why a model's backbone cannot run as one call (the message says)."""


class Stale(Ineligible):
    """A fusion is older than its weights (changed in place since `prepare_for_inference`): the layers run (unfused)
    until `linear.renew_prepared` fuses them again, and the program is then built."""


@dataclass
class Program:
    """One model's backbone as `step.c` reads it: the layers' static fields (weights, norms, shapes), and what must
    not change under them (`fresh`)."""

    layers: ctypes.Array
    kinds: list[type]  # per layer: GatedDeltaNet or GatedAttention
    hidden: int
    vocab: int
    eps: float
    embed: torch.Tensor | None  # None: the program runs on given hidden states
    norm: torch.Tensor
    keep: list[torch.Tensor]  # float copies the layers point at (A_log, dt_bias)
    params: list[tuple[dict, str, torch.Tensor, int]]  # (owner's parameters, name, tensor, version) read or copied
    prepared: list[tuple[FastLinear, torch.Tensor, torch.Tensor]]  # each linear run and the codes and scales read
    modules: list[nn.Module]  # the backbone's (`hooked`)
    kernels: _Kernels = field(default_factory=_kernels)
    draft: _Draft | None = None  # a draft program's static fields (`build_draft`)
    head: _Linear | None = None  # a verify program's output head (`build_verify`)

    def __post_init__(self) -> None:
        # what `fresh` and `hooked` compare, laid out for C-level loops (a step runs them every time)
        self._dicts, self._names, self._tensors, self._versions = (list(c) for c in zip(*self.params))
        self._linears = [lin for lin, _, _ in self.prepared]
        self._codes = [w for _, w, _ in self.prepared]
        # each linear's scales by attribute name (a layer without: its codes again), so `fresh` reads them in C
        self._scale_names = [_SCALES.get(lin.kernel, "_packed") for lin in self._linears]
        self._scales = [w if sc is None else sc for _, w, sc in self.prepared]
        self._hooks = [m._forward_hooks for m in self.modules] + [m._forward_pre_hooks for m in self.modules]

    def fresh(self) -> bool:
        """Nothing the program points at was replaced or changed in place since it was built (a weight behind a fusion
        or a prepared linear included: their versions then moved) and no layer was prepared again: the checks
        `FusedProjections.fresh` makes, for every tensor read (~20 us at the shipped model's size, every loop in C)."""
        return (all(map(operator.is_, map(dict.get, self._dicts, self._names), self._tensors))
                and list(map(_version, self._tensors)) == self._versions
                and all(map(operator.is_, map(_packed, self._linears), self._codes))
                and all(map(operator.is_, map(getattr, self._linears, self._scale_names), self._scales)))

    def hooked(self) -> bool:
        """Has a backbone module (or every module) a forward hook now? They must run: the layers then run."""
        return any(self._hooks) or bool(module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks)


_version = operator.attrgetter("_version")
_packed = operator.attrgetter("_packed")
_SCALES = {"int8": "_scale", "int4": "_sz"}  # a prepared linear's scales (`_scales`)


def _scales(lin: FastLinear) -> torch.Tensor | None:
    name = _SCALES.get(lin.kernel)
    return None if name is None else getattr(lin, name)


def _linear(lin: FastLinear, prepared: list, params: list, parts: list | None = None) -> _Linear:
    """The C view of a prepared linear `lin` (`parts`: the layers a fused `lin` was made from), recording what must stay
    as it is: the prepared codes and scales, and the float weights they were made from."""
    if not (isinstance(lin, FastLinear) and lin._native and lin.bias is None and not lin._pad
            and (lin.kernel != "int4" or lin._perm is None)):
        raise Ineligible(f"a projection is not an int8/int4/bf16-native qmatmul layer without bias "
                         f"({type(lin).__name__}, {getattr(lin, 'kernel', None)})")
    prepared.append((lin, lin._packed, _scales(lin)))  # a new preparation makes new tensors: the program is then stale
    for part in parts or [lin]:  # (a released weight is its meta placeholder: replacing it is a change too)
        w = part._parameters["weight"]
        params.append((part._parameters, "weight", w, w._version))
    if lin.kernel == "bf16-native":
        return _Linear(16, lin.out_features, lin.in_features, 0, lin._packed.data_ptr(), None, None)
    if lin.kernel == "int8":
        return _Linear(8, lin.out_features, lin.in_features, 0, lin._packed.data_ptr(), lin._scale.data_ptr(), None)
    return _Linear(4, lin.out_features, lin.in_features, lin._group, lin._packed.data_ptr(), lin._sz.data_ptr(),
                   lin._low.data_ptr())


def _fused(module: nn.Module, n: int):
    fused = module.__dict__.get("_fused")
    if fused is None or len(fused.parts) != n:
        raise Ineligible(f"{type(module).__name__}'s projections are not fused")
    if not fused.fresh():
        raise Stale(f"{type(module).__name__}'s fused projections are older than their weights")
    return fused


def _inputs(L: _Layer, module: nn.Module, prepared: list, params: list) -> None:
    """L's input projections: `module`'s fused layer, or (where the parts' kernels differ: int4 with int8 parts too
    narrow for it) its parts one by one, as `linear.project` runs them."""
    fused = module.__dict__.get("_fused")
    if fused is not None and fused.fresh():
        L.in_[0] = _linear(fused.fused, prepared, params, fused.parts)
        L.n_in, L.Nin, widths = 1, fused.fused.out_features, fused.padded
    elif fused is None:
        parts = [getattr(module, n) for n in module.fused_projections]
        for j, lin in enumerate(parts):
            L.in_[j] = _linear(lin, prepared, params)
        widths = [lin.out_features for lin in parts]
        L.n_in, L.Nin = len(parts), sum(widths)
    else:
        raise Stale(f"{type(module).__name__}'s fused projections are older than their weights")
    for j in range(len(widths)):
        L.off[j] = sum(widths[:j])


def _bf16(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device.type != "cpu":
        raise Ineligible(f"{what} is not a contiguous bf16 CPU tensor")
    return t


def build(layers: list[nn.Module], norm: nn.Module, embed: nn.Embedding | None, modules: list[nn.Module]) -> Program:
    """The program of decoder `layers` then `norm` (after `embed`'s rows of the token ids, or on given hidden states
    when None); `modules`: what else must stay free of hooks. Ineligible (the message says why) where it cannot."""
    weights = [norm.weight] + ([] if embed is None else [embed.weight])
    if type(norm) is not RMSNorm or any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in weights):
        raise Ineligible("not a bf16 CPU model with the zero-centred final norm")
    H, eps = norm.weight.shape[0], norm.eps
    if H % 8:
        raise Ineligible(f"hidden size {H} is not a multiple of 8")
    program_layers = (_Layer * len(layers))()
    params, prepared, keep, kinds = [], [], [], []
    modules = list(modules) + [norm] + ([] if embed is None else [embed])

    def param(module: nn.Module, name: str) -> torch.Tensor:
        t = module._parameters[name]
        params.append((module._parameters, name, t, t._version))
        return t

    for i, layer in enumerate(layers):
        mixer = layer.mixer if type(layer) is DecoderLayer else None
        if type(mixer) not in (GatedDeltaNet, GatedAttention) or type(layer.mlp) is not MLP:
            raise Ineligible(f"layer {i} is not a Gated DeltaNet / gated-attention layer with a SwiGLU MLP")
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.eps != eps for n in norms):
            raise Ineligible(f"layer {i}'s norms differ from the final norm")
        modules += list(layer.modules())
        L = program_layers[i]
        L.norm1, L.norm2 = (_bf16(param(n, "weight"), f"layer {i}'s norm").data_ptr() for n in norms)
        mlp_fused = _fused(layer.mlp, 2)
        L.gate_up = _linear(mlp_fused.fused, prepared, params, mlp_fused.parts)
        L.I, L.up = mlp_fused.sizes[0], mlp_fused.padded[0]
        L.down = _linear(layer.mlp.down_proj, prepared, params)
        _inputs(L, mixer, prepared, params)
        if type(mixer) is GatedDeltaNet:
            d = mixer
            L.kind, L.Hk, L.Hv, L.Kd, L.Vd, L.kernel = 0, d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim, d.kernel
            if d.num_v_heads % d.num_k_heads or L.off[1] < d.conv_dim or L.off[2] < L.off[1] + d.value_dim:
                raise Ineligible(f"layer {i}'s DeltaNet heads do not fit its projections")
            L.out = _linear(d.out_proj, prepared, params)
            L.taps = _bf16(param(d.conv1d, "weight"), f"layer {i}'s conv").data_ptr()  # [C, 1, kernel]: [C, kernel]
            a_log, dt_bias = param(d, "A_log").detach().float().contiguous(), param(d, "dt_bias").detach().float().contiguous()
            keep += [a_log, dt_bias]
            L.A_log, L.dt_bias = a_log.data_ptr(), dt_bias.data_ptr()
            L.gnorm, L.geps = _bf16(param(d.norm, "weight"), f"layer {i}'s gated norm").data_ptr(), d.norm.eps
        else:
            a = mixer
            D = a.head_dim
            if D % 8 or a.num_heads % a.num_kv_heads or a.q_norm.eps != a.k_norm.eps:
                raise Ineligible(f"layer {i}'s attention heads do not fit the kernels")
            L.kind, L.Hk, L.Hv, L.Kd, L.Vd = 1, a.num_kv_heads, a.num_heads, D, D
            L.out = _linear(a.o_proj, prepared, params)
            L.gnorm = _bf16(param(a.q_norm, "weight"), f"layer {i}'s q_norm").data_ptr()
            L.knorm = _bf16(param(a.k_norm, "weight"), f"layer {i}'s k_norm").data_ptr()
            L.geps, L.scale = a.q_norm.eps, D**-0.5
        kinds.append(type(mixer))
    if kinds.count(GatedAttention) == 0:
        raise Ineligible("no attention layer (the positions are checked against its cache)")
    embed_w = None if embed is None else _bf16(param(embed, "weight"), "the embedding")
    norm_w = _bf16(param(norm, "weight"), "the final norm")
    return Program(program_layers, kinds, H, 0 if embed_w is None else embed_w.shape[0], eps, embed_w, norm_w, keep,
                   params, prepared, modules)


def build_draft(model: nn.Module) -> Program:
    """The greedy draft chain of `model`'s sequential MTP (`draft`): its layers (as `build` reads them; the chain runs
    one at a time), its embedding, pre-fc norms, input projection and the head it drafts with (each int8, int4 or
    bf16-native)."""
    mtp = model.mtp
    if mtp is None or mtp.style != "sequential":
        raise Ineligible("no sequential MTP module")
    prog = build(list(mtp.layers), mtp.norm, None, [mtp])
    if any(kind is not GatedAttention for kind in prog.kinds):
        raise Ineligible("an MTP layer is not a gated-attention layer")
    params, prepared = list(prog.params), list(prog.prepared)

    def param(module: nn.Module, name: str, what: str) -> torch.Tensor:
        t = _bf16(module._parameters[name], what)
        params.append((module._parameters, name, t, t._version))
        return t

    embeds, heads = {mtp.embed_for_depth(1), mtp.embed_for_depth(2)}, {model.draft_head_module(1), model.draft_head_module(2)}
    if len(embeds) != 1 or len(heads) != 1:
        raise Ineligible("the depths read different embeddings or heads")
    embed = embeds.pop() or model.model.embed_tokens
    norms = (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden)
    if type(embed) is not nn.Embedding or any(type(n) is not RMSNorm or n.eps != prog.eps for n in norms):
        raise Ineligible("the MTP's embedding or pre-fc norms are not the kinds the C draft runs")
    fc_module, H = mtp.fc, prog.hidden
    fc = _linear(fc_module, prepared, params)
    if (fc.K, fc.N) != (2 * H, H):
        raise Ineligible("the MTP's input projection is not [2H] -> [H]")
    head_prepared: list = []
    head_module = heads.pop()
    head = _linear(head_module, head_prepared, params)
    prepared += head_prepared
    e = param(embed, "weight", "the embedding")
    if e.shape[1] != H or head.K != H or head.N != e.shape[0]:
        raise Ineligible("the embedding and the head do not fit the hidden size")
    d = _Draft(H=H, V=e.shape[0], eps=prog.eps, embed=e.data_ptr(), fc=fc, norm=prog.norm.data_ptr(), head=head)
    d.norm_e, d.norm_h = (param(n, "weight", "a pre-fc norm").data_ptr() for n in norms)
    return replace(prog, params=params, prepared=prepared, modules=prog.modules + [embed, fc_module, head_module, *norms],
                   draft=d)


def build_verify(model: nn.Module) -> Program:
    """The backbone's program (`build`) with the output head `lm_head` (int8, int4 or bf16-native), for a greedy
    round's verify (`qwen35_verify`: the forward, the head over every token, the argmax)."""
    m = model.model
    prog = build(list(m.layers), m.norm, m.embed_tokens, [model, m])
    params, prepared = list(prog.params), list(prog.prepared)
    head = _linear(model.lm_head, prepared, params)
    if head.K != prog.hidden or head.N != prog.vocab:
        raise Ineligible("the output head does not fit the hidden size and the vocabulary")
    return replace(prog, params=params, prepared=prepared, modules=prog.modules + [model.lm_head], head=head)


def _make(owner: nn.Module, part: str | int) -> Program:
    """The program of `owner`'s `part`: a Qwen35ForCausalLM's "backbone", "draft" (`build_draft`) or "verify"
    (`build_verify`), or a Qwen35MTP's layer `part` (then its norm)."""
    if part == "backbone":
        m = owner.model
        return build(list(m.layers), m.norm, m.embed_tokens, [owner, m])
    if part == "draft":
        return build_draft(owner)
    if part == "verify":
        return build_verify(owner)
    return build([owner.layers[part]], owner.norm, None, [owner])


def program(owner: nn.Module, part: str | int = "backbone") -> Program | None:
    """The program of `owner`'s `part` (`_make`), built on first use and again when what it points at changed (None:
    it cannot run as one call; `verdict` says why)."""
    programs = owner.__dict__.setdefault("_step", {})  # part -> Program, or the reason it cannot be one
    prog = programs.get(part)
    if isinstance(prog, Program) and prog.fresh():
        return prog
    if isinstance(prog, str):
        return None
    if os.environ.get("MTP_STEP", "1") == "0" or not all(lib.available() for lib in _LIBRARIES) or not LIBRARY.available():
        programs[part] = "the C kernels are not available (or MTP_STEP=0)"
        return None
    try:
        programs[part] = prog = _make(owner, part)
    except Ineligible as e:
        # a lasting verdict (the model's make-up); a stale fusion is renewed later, and the program is then built
        programs[part] = None if isinstance(e, Stale) else str(e)
        return None
    return prog


def verdict(owner: nn.Module, part: str | int = "backbone") -> str | None:
    """Why `owner`'s `part` cannot run as one call (None: it can, or it was not tried yet)."""
    prog = owner.__dict__.get("_step", {}).get(part)
    return prog if isinstance(prog, str) else None


def forget(model: nn.Module) -> None:
    """Drop the programs and verdicts of `model` and its MTP module (its layers were prepared again:
    `Qwen35ForCausalLM.prepare_for_inference`)."""
    for owner in (model, model.mtp):
        if owner is not None:
            owner.__dict__.pop("_step", None)


def _eligible_forward(pos: Positions) -> bool:
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling() or pos.starts is None or pos.index is None
                or pos.key_selection is not None or pos.rotary_by_kind is not None or pos.cos is None)


def decode(model, ids: torch.Tensor, cache: Cache, pos: Positions) -> tuple[torch.Tensor, list] | None:
    """`CausalLM.decode` of ids [B, T] as one C call -> (hidden [B, T, H], per layer `DeltaSteps` or None), or None
    where this forward cannot run so (the caller runs the layers)."""
    if not _eligible_forward(pos):
        return None
    prog = program(model)
    if prog is None or prog.hooked():
        return None
    if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.dim() != 2:
        return None
    return _run(prog, ids.shape[0], ids.shape[1], ids, None, cache.layers, pos)


def prefill(model, ids: torch.Tensor, cache: Cache) -> torch.Tensor | None:
    """`CausalLM.hidden` of ids [B, T] continuing a prefill's cache (every row at `cache.pos`) as one C call, the
    states kept in place -> hidden [B, T, H], the cache advanced by T; or None where this forward cannot run so (the
    caller runs the layers). Within `prompt_products` (a prompt's chunk: `decode.prefill`) attention runs as
    `attend_prompt` and int8/int4 products of WIDE_MIN_ROWS rows or more on the bf16 tiles, as the layers' prompt
    products do; outside it, the decode kernels: the T tokens' outputs and states are then their plain steps', bit for
    bit. Everything else is the layers' arithmetic, by the same kernels (their attention is SDPA)."""
    if (torch.is_grad_enabled() or torch.compiler.is_compiling() or ids.dtype != torch.int64 or ids.dim() != 2
            or ids.shape[1] == 0):  # (an empty read: the layers' path returns it)
        return None
    prog = program(model)
    if prog is None or prog.hooked() or model.rotary is None:
        return None
    B, T = ids.shape
    start = cache.pos
    cache.check_room(T)
    model.prepare_decode(start + T)
    index = torch.arange(start, start + T, dtype=torch.int64).expand(B, T).contiguous()
    pos = model.decode_positions(index, [start] * B)
    prompt = WIDE_MIN_ROWS if prompt_products_on() else 0
    done = _run(prog, B, T, ids.contiguous(), None, cache.layers, pos, commit=True, prompt=prompt)
    if done is None:
        return None
    cache.pos = start + T
    return done[0]


def mtp_layer(mtp: nn.Module, i: int, x: torch.Tensor, cache: KVCache, pos: Positions) -> torch.Tensor | None:
    """A Qwen35MTP's layer i and then its norm on x [B, T, H] (its input projection's output) at the decode positions
    `pos`, as one C call -> [B, T, H], or None where this forward cannot run so."""
    if not _eligible_forward(pos) or x.dtype != torch.bfloat16 or x.dim() != 3 or not x.is_contiguous():
        return None
    prog = program(mtp, i)
    if prog is None or prog.hooked():
        return None
    done = _run(prog, x.shape[0], x.shape[1], None, x, [cache], pos)
    return None if done is None else done[0]


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _bind(prog: Program, B: int, T: int, states: list, commit: bool, R: int, alloc=_empty
          ) -> tuple[ctypes.Array, list, int, torch.Tensor | None] | None:
    """A copy of `prog`'s layers for one forward of T tokens in each of B rows over the layers' decode `states` (a
    DeltaNet layer's window and per-token updates in tensors from `alloc(shape, dtype)`; `commit`: updated in place,
    one conv window scratch for every layer) -> (layers, per layer `DeltaSteps` or None, cache slots S, the scratch
    window the layers point at), or None where they do not fit (R: the rotary dims)."""
    steps: list = []
    S = None
    window = None
    # a copy per forward: the caches and outputs are filled in per call (decoders on other threads may run the same
    # program at once)
    layers = (_Layer * len(prog.layers))()
    ctypes.memmove(layers, prog.layers, ctypes.sizeof(layers))
    for L, kind, state in zip(layers, prog.kinds, states):
        if kind is GatedDeltaNet:
            C, kw = 2 * L.Hk * L.Kd + L.Hv * L.Vd, L.kernel - 1
            if (type(state) is not DeltaState or state.conv.shape != (B, C, kw) or state.ssm.shape != (B, L.Hv, L.Kd, L.Vd)
                    or state.conv.dtype != torch.bfloat16 or state.ssm.dtype != torch.float32
                    or not (state.conv.is_contiguous() and state.ssm.is_contiguous())):
                return None
            L.conv, L.ssm = state.conv.data_ptr(), state.ssm.data_ptr()
            if commit:
                if window is None:
                    window = alloc((B, C, kw + T), torch.bfloat16)
                if window.shape != (B, C, kw + T):
                    return None
                L.window, L.updates = window.data_ptr(), None
                steps.append(None)
            else:
                w = alloc((B, C, kw + T), torch.bfloat16)
                up = alloc((B, L.Hv, T, L.Kd + L.Vd + 1), torch.float32)
                L.window, L.updates = w.data_ptr(), up.data_ptr()
                steps.append(DeltaSteps(w, updates=up))
        else:
            if (type(state) is not KVCache or state.k.dtype != torch.bfloat16 or state.v.dtype != torch.bfloat16
                    or state.k.shape[:2] != (B, L.Hk) or state.k.shape[3] != L.Kd or state.v.shape != state.k.shape
                    or not (state.k.is_contiguous() and state.v.is_contiguous()) or R > L.Kd
                    or (S is not None and state.k.shape[2] != S)):
                return None
            S = state.k.shape[2]
            L.conv, L.values = state.k.data_ptr(), state.v.data_ptr()
            steps.append(None)
    return layers, steps, S, window


def _run(prog: Program, B: int, T: int, ids: torch.Tensor | None, x: torch.Tensor | None, states: list,
         pos: Positions, commit: bool | None = None, prompt: int = 0) -> tuple[torch.Tensor, list] | None:
    """One call of `prog` on ids [B, T] (or hidden states x [B, T, H]) over the layers' decode states; `commit`: the
    states updated in place (default: a `pos.commit` step of one token); `prompt`: step.c's `Step.prompt`."""
    cos, sin, index = pos.cos, pos.sin, pos.index
    R = cos.shape[-1]
    if (index.dtype != torch.int64 or index.shape != (B, T) or not index.is_contiguous() or cos.dtype != torch.bfloat16
            or cos.shape != (B, 1, T, R) or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous())
            or R % 2 or len(pos.starts) != B or len(states) != len(prog.layers)
            or (x is not None and x.shape != (B, T, prog.hidden))):
        return None
    if commit is None:
        commit = pos.commit and T == 1
    bound = _bind(prog, B, T, states, commit, R)
    if bound is None:
        return None
    layers, steps, S, _window = bound
    if max(pos.starts) + T > S:
        raise ValueError(f"attend: positions up to {max(pos.starts) + T - 1} past the cache's {S}")
    starts = torch.tensor(pos.starts, dtype=torch.int64)
    out = torch.empty(B, T, prog.hidden, dtype=torch.bfloat16)
    step = _Step(B, T, prog.hidden, prog.vocab, S, R, prog.eps, None if ids is None else ids.data_ptr(),
                 None if x is None else x.data_ptr(), index.data_ptr(), starts.data_ptr(),
                 None if prog.embed is None else prog.embed.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                 prog.norm.data_ptr(), out.data_ptr(), prompt)
    status = LIBRARY.lib().qwen35_decode(ctypes.byref(prog.kernels), ctypes.byref(step), layers, len(layers),
                                         torch.get_num_threads())
    if status == -2:
        raise IndexError(f"a token id is outside the vocabulary of {prog.vocab}")
    if status == -3:
        raise IndexError(f"a position is outside the cache's {S} slots")
    if status != 0:
        raise MemoryError("qwen35_decode: out of memory")
    return out, steps


def _bind_draft(prog: Program, table: tuple[torch.Tensor, torch.Tensor], K: int, pend_h: torch.Tensor,
                pend_next: torch.Tensor, pend_n: torch.Tensor, mtp_pos: torch.Tensor, caches: list,
                vocab: tuple[FastLinear, torch.Tensor] | None, drafts: torch.Tensor) -> tuple[_Draft, ctypes.Array] | None:
    """The draft program `prog`'s call for K drafts into drafts [B, K] over the round state's tensors and MTP `caches`
    (`draft`'s arguments; the rotary `table` (cos, sin)) -> (its `_Draft`, its layers), all but the width `W`; None
    where they do not fit."""
    head, ids = vocab if vocab is not None else (None, None)
    if head is not None:
        if (head.kernel not in ("bf16-native", "int8", "int4") or head.bias is not None or head.in_features != prog.hidden
                or head.weight._version != head._version or ids.dtype != torch.int64 or not ids.is_contiguous()
                or ids.shape != (head.out_features,) or head.out_features > prog.draft.V or ids.device.type != "cpu"):
            return None
    cos, sin = table
    B, PR = pend_next.shape
    H, R = prog.hidden, cos.shape[-1]
    tensors = (pend_h, pend_next, pend_n, mtp_pos, cos, sin, drafts)
    if (pend_h.dtype != torch.bfloat16 or pend_h.shape != (B, PR, H) or pend_next.dtype != torch.int64
            or pend_n.dtype != torch.int64 or mtp_pos.dtype != torch.int64 or pend_n.shape != (B,) or mtp_pos.shape != (B,)
            or drafts.dtype != torch.int64 or drafts.shape != (B, K)
            or not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors) or len(caches) != len(prog.layers)):
        return None
    layers = (_Layer * len(prog.layers))()  # this call's copy (decoders on other threads may run the program at once)
    ctypes.memmove(layers, prog.layers, ctypes.sizeof(layers))
    S = None
    for L, c in zip(layers, caches):
        if (type(c) is not KVCache or c.k.dtype != torch.bfloat16 or c.v.dtype != torch.bfloat16
                or c.k.shape[:2] != (B, L.Hk) or c.k.shape[3] != L.Kd or c.v.shape != c.k.shape
                or not (c.k.is_contiguous() and c.v.is_contiguous()) or R > L.Kd or (S is not None and c.k.shape[2] != S)):
            return None
        S = c.k.shape[2]
        L.conv, L.values = c.k.data_ptr(), c.v.data_ptr()
    d = _Draft.from_buffer_copy(prog.draft)
    d.B, d.K, d.S, d.R, d.P, d.PR = B, K, S, R, cos.shape[0], PR
    d.cos, d.sin, d.pend_h, d.pend_next = cos.data_ptr(), sin.data_ptr(), pend_h.data_ptr(), pend_next.data_ptr()
    d.pend_n, d.mtp_pos, d.drafts = pend_n.data_ptr(), mtp_pos.data_ptr(), drafts.data_ptr()
    if head is not None:
        d.head = _linear(head, [], [])
        d.vocab_ids = ids.data_ptr()
    return d, layers


def _draft_program(model) -> tuple[Program, tuple[torch.Tensor, torch.Tensor]] | None:
    """`model`'s draft program and the rotary table it reads, or None where the chain cannot run as one call now."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or model.rotary is None:
        return None
    prog = program(model, "draft")
    table = model.rotary.table
    if prog is None or prog.hooked() or table is None or table[0].dtype != torch.bfloat16:
        return None
    return prog, table


def draft(model, K: int, pend_h: torch.Tensor, pend_next: torch.Tensor, pend_n: torch.Tensor, mtp_pos: torch.Tensor,
          caches: list, width: int, host: tuple[list[int], list[int]],
          vocab: tuple[FastLinear, torch.Tensor] | None = None, sampling: PickRule | None = None) -> torch.Tensor | None:
    """round.py's draft chain of K >= 1 drafts as one C call -> drafts [B, K] (long), or None where it cannot run so
    (the round then runs it step by step, to the same drafts, caches and q). `sampling`: the rows' temperatures, top-k,
    noise and penalties (each sampled row drafts argmax(x + noise), x = logits penalised over the tokens seen and the
    drafts before, / T, outside its top-k -inf; a greedy row argmax(x); q gets every row's x), or None: argmaxes.
    pend_h [B, PR, H], pend_next [B, PR], pend_n and mtp_pos [B]: the round state's; `width`: the pending positions
    depth 1 reads; `host`: (mtp_pos, pend_n) on the host; `vocab`: a reduced draft vocabulary's head (a prepared
    layer [H] -> [N], int8, int4 or bf16-native) and its token ids [N] (decode/draft_vocab.py), instead of the full
    head. A pending count past `width` raises ValueError, a pending token outside the vocabulary IndexError, before
    anything is written. K = 0 (round.py's `catch_up`): depth 1 reads the `width` pending positions into the MTP's
    caches, nothing drafted -> [B, 0]."""
    found = _draft_program(model) if K >= 0 else None
    if found is None:
        return None
    prog, table = found
    B, PR = pend_next.shape
    drafts = torch.empty(B, K, dtype=torch.int64)
    bound = _bind_draft(prog, table, K, pend_h, pend_next, pend_n, mtp_pos, caches, vocab, drafts)
    if bound is None or not 1 <= width <= PR:
        return None
    d, layers = bound
    d.W = width
    if sampling is not None:
        if not _fits(sampling, B, K, d.V) or sampling.top_p is not None:  # (the drafts' rule has no top-p)
            return None
        _set_draft_rule(d, sampling)
    starts, counts = host
    if max(s + max(width, n - 1 + K) for s, n in zip(starts, counts)) > min(d.S, d.P):
        raise ValueError(f"draft: MTP positions past the cache's {d.S} slots or the rotary table's {d.P}")
    _draft_status(LIBRARY.lib().qwen35_draft(ctypes.byref(prog.kernels), ctypes.byref(d), layers, len(layers),
                                             torch.get_num_threads()), d.V)
    return drafts


def _set_draft_rule(d: _Draft, sampling: PickRule | None) -> None:
    """Point the chain `d` at `sampling`'s tensors (`_fits`), or back at the argmax (None)."""
    d.temp, d.greedy, d.top_k, d.noise, d.q, d.penalty, d.seen = map(_address, (sampling or (None,) * 8)[:7])


def _draft_status(status: int, V: int) -> None:
    if status == -2:
        raise IndexError(f"a pending token id is outside the vocabulary of {V}")
    if status in (-3, -4):
        raise ValueError("draft: an MTP position or pending count out of range")
    if status != 0:
        raise MemoryError("qwen35_draft: out of memory")


@dataclass
class RoundProgram:
    """One decoder's greedy round of K drafts over B rows as decode/round.c's `greedy_round` runs it (`round_program`):
    the function pointers of the draft chain, the verify forward (with the head and argmax) and the DeltaNet keep, the
    structs they read (bound to the round state's caches and tensors), and the buffers round.c fills or reads. Valid
    while `current`; the round state's tensors must not move."""

    verify_prog: Program
    draft_prog: Program | None
    table: tuple[torch.Tensor, torch.Tensor]
    kernels: int  # the address of the programs' kernel table
    verify: int  # function addresses: qwen35_verify, qwen35_draft (None without drafts), deltanet_keep_layers
    draft: int | None
    keep: int
    step: _Step
    layers: ctypes.Array
    draft_args: _Draft | None
    draft_layers: ctypes.Array | None
    keep_layers: ctypes.Array | None  # None: a kept step (the states updated in place)
    ids: torch.Tensor  # [B, K+1] long: the verify's tokens, filled by round.c
    index: torch.Tensor  # [B, K+1] long: their positions, likewise
    cos: torch.Tensor  # [B*(K+1), R] bf16: their rotary rows, likewise
    sin: torch.Tensor
    starts: ctypes.Array  # [B] int64: each row's first position on the host (`Positions.starts`), set per round
    hidden: torch.Tensor  # [B, K+1, H]: the verify's hidden states
    logits: torch.Tensor  # [B*(K+1), V] bf16 scratch
    target: torch.Tensor  # [B, K+1] long: their argmax
    drafts: torch.Tensor  # [B, K] long
    slots: int  # cache slots S
    held: list  # what the structs point at
    pick: _Pick = field(default_factory=_Pick)  # the verify's sampling rule, set per round (`sample`)

    def sample(self, drafts: PickRule | None, target: PickRule | None,
               unseeded: tuple[torch.Tensor, torch.Tensor] | None = None, limit: int | None = None) -> bool:
        """Set this round's sampling rule: the draft chain's (`drafts`, noise [B, K, V]; q [B, K, V] where rows are
        unseeded) and the verify's (`target`, noise [B, K+1, V], no q: each sampled row's token at each position is
        argmax(x + noise), x the logits (repetition-penalised over the tokens seen and the drafts before it) over its
        temperature cut to its top-k and top-p - round.py's seeded rule, and a plain step's; a greedy row's the argmax
        of x), or the argmax (None). `unseeded`: (mask [B] bool, uniforms [B, K]) of rows that take Leviathan et al.'s
        rule instead (with drafts; step.c `unseeded_row`), whose accepted counts are written over the round's limits at
        address `limit` ([B] int64). -> False where the tensors do not fit (nothing set). The tensors must live until
        the round has run."""
        B, T = self.target.shape
        V = self.logits.shape[-1]
        if target is not None:
            if (not _fits(target, B, T, V) or target.q is not None
                    or (T > 1 and (drafts is None or not _fits(drafts, B, T - 1, V) or drafts.top_p is not None))):
                return False
            if unseeded is not None:
                mask, u = unseeded
                if (T == 1 or drafts.q is None or limit is None or mask.dtype != torch.bool or mask.shape != (B,)
                        or u.dtype != torch.float32 or u.shape != (B, T - 1)
                        or not all(x.is_contiguous() and x.device.type == "cpu" for x in (mask, u))):
                    return False
        if self.draft_args is not None:
            _set_draft_rule(self.draft_args, drafts if target is not None else None)
        t, greedy, top_k, noise, _, penalty, seen, top_p = target or (None,) * 8
        mask, u = unseeded if target is not None and unseeded is not None else (None, None)
        pk = self.pick
        pk.temp, pk.greedy, pk.top_k, pk.noise, pk.unseeded, pk.u, pk.penalty, pk.seen, pk.top_p = map(
            _address, (t, greedy, top_k, noise, mask, u, penalty, seen, top_p))
        pk.q = None if mask is None else drafts.q.data_ptr()
        pk.drafts = None if target is None or T == 1 else self.drafts.data_ptr()  # (the unseeded rule's and the penalty's)
        pk.limit = None if mask is None else limit
        return True

    def current(self, model) -> bool:
        """Are the programs this was bound to still `model`'s, hook-free, the rotary table the same? The programs'
        own check that nothing they read changed (`Program.fresh`, ~100 us a round in the decode loop) ran when this
        was bound: a round state is one decoder's, and like compiled rounds (decode/compiled.py) a decoder runs the
        weights it started with; the next decoder sees weights changed in place."""
        programs, table = model.__dict__.get("_step", {}), model.rotary.table
        return (programs.get("verify") is self.verify_prog and not self.verify_prog.hooked() and table is not None
                and table[0] is self.table[0] and table[1] is self.table[1]
                and (self.draft_prog is None or (programs.get("draft") is self.draft_prog
                                                 and not self.draft_prog.hooked())))


_ALIGN = 64  # bytes: each scratch tensor starts on a cache line


def _scratch_bytes(prog: Program, B: int, T: int, commit: bool) -> int:
    """What `_bind` allocates for prog's DeltaNet layers (`_carve` alignment included)."""
    need = 0
    for L, kind in zip(prog.layers, prog.kinds):
        if kind is GatedDeltaNet:
            C, kw = 2 * L.Hk * L.Kd + L.Hv * L.Vd, L.kernel - 1
            window, states = B * C * (kw + T) * 2, 0 if commit else B * L.Hv * T * (L.Kd + L.Vd + 1) * 4
            need += -(-window // _ALIGN) * _ALIGN + -(-states // _ALIGN) * _ALIGN
            if commit:
                break  # (one window for every layer)
    return need


def _carve(buffer: torch.Tensor):
    """An `alloc` for `_bind` taking aligned tensors from uint8 `buffer` one after another."""
    used = [0]

    def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = -(-(torch.Size(shape).numel() * dtype.itemsize) // _ALIGN) * _ALIGN
        start, used[0] = used[0], used[0] + n
        if used[0] > buffer.numel():
            raise ValueError(f"scratch of {buffer.numel()} bytes: {used[0]} needed")
        return buffer[start:start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
    return alloc


def round_program(model, K: int, commit: bool, cache: Cache, mtp_caches: list | None, pos: torch.Tensor,
                  pend_h: torch.Tensor | None, pend_next: torch.Tensor | None, pend_n: torch.Tensor | None,
                  mtp_pos: torch.Tensor | None, vocab: tuple[FastLinear, torch.Tensor] | None = None,
                  scratch=None) -> RoundProgram | None:
    """`model`'s greedy round of K drafts over the B rows of a round state (its backbone `cache`, MTP caches, pos [B]
    and the MTP's pending tensors; `vocab`: a reduced draft vocabulary's head and token ids) bound for round.c, or None
    where it cannot run so. `commit`: a plain step every row keeps (K = 0; the states updated in place). `scratch(n)`:
    n bytes (uint8) that the DeltaNet layers' windows and per-token updates may take (one round runs at a time, so the
    rounds of one state can share them: a verify of 9 tokens at real size keeps ~1 MB per token and layer); None:
    their own."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or model.rotary is None or (commit and K):
        return None
    prog = program(model, "verify")
    table = model.rotary.table
    if prog is None or prog.hooked() or table is None or table[0].dtype != torch.bfloat16 or not table[0].is_contiguous():
        return None
    B, T, H = pos.shape[0], K + 1, prog.hidden
    R = table[0].shape[-1]
    if R % 2 or not table[1].is_contiguous() or table[1].shape != table[0].shape or len(cache.layers) != len(prog.layers):
        return None
    alloc = _empty
    if scratch is not None:
        alloc = _carve(scratch(_scratch_bytes(prog, B, T, commit)))
    bound = _bind(prog, B, T, cache.layers, commit, R, alloc)
    if bound is None:
        return None
    layers, steps, S, window = bound
    kept = [(state, st) for state, st in zip(cache.layers, steps) if st is not None]
    keep_layers = None
    if not commit:
        keep_layers = deltanet_kernel.keep_program(kept, B)
        if keep_layers is None or len(kept) != prog.kinds.count(GatedDeltaNet):
            return None
    drafts = torch.empty(B, K, dtype=torch.int64)
    draft_prog = draft_args = draft_layers = None
    if K:
        found = _draft_program(model)
        if found is None or found[1][0] is not table[0] or mtp_caches is None:
            return None
        draft_prog = found[0]
        bound_draft = _bind_draft(draft_prog, table, K, pend_h, pend_next, pend_n, mtp_pos, mtp_caches, vocab, drafts)
        if bound_draft is None:
            return None
        draft_args, draft_layers = bound_draft
    ids, index = torch.empty(B, T, dtype=torch.int64), torch.empty(B, T, dtype=torch.int64)
    cos, sin = (torch.empty(B * T, R, dtype=torch.bfloat16) for _ in range(2))
    starts = (ctypes.c_int64 * B)()
    hidden = torch.empty(B, T, H, dtype=torch.bfloat16)
    logits = torch.empty(B * T, prog.head.N, dtype=torch.bfloat16)
    target = torch.empty(B, T, dtype=torch.int64)
    step = _Step(B, T, H, prog.vocab, S, R, prog.eps, ids.data_ptr(), None, index.data_ptr(), ctypes.addressof(starts),
                 prog.embed.data_ptr(), cos.data_ptr(), sin.data_ptr(), prog.norm.data_ptr(), hidden.data_ptr())
    address = lambda lib, name: ctypes.cast(getattr(lib.handle(), name), p).value  # noqa: E731
    return RoundProgram(prog, draft_prog, table, ctypes.addressof(prog.kernels), address(LIBRARY, "qwen35_verify"),
                        address(LIBRARY, "qwen35_draft") if K else None,
                        address(deltanet_kernel.LIBRARY, "deltanet_keep_layers"), step, layers, draft_args,
                        draft_layers, keep_layers, ids, index, cos, sin, starts, hidden, logits, target, drafts, S,
                        [steps, window, vocab])
