"""Load and save checkpoints in their Hugging Face layout (safetensors, single or sharded), for every family.

Loading, in this order, so that nothing is allocated before the config and the checkpoint are known to agree:
resolve a folder or hub id; read `config.json` into the family's config (every value type-checked); read every
safetensors header (validated whole); map every tensor name through the family (`internal_name`); check the config's
layer counts and embedding size against the tensors; build the model on the meta device, refused when its weights
would not fit in memory (`budget.py`); check every name, shape and dtype; only then take the tensors from the
memory-mapped files (no copy when the dtype is kept), and look for NaN/Inf in them.

Saving stages every file beside its final name, fsyncs it, renames them all into place, then removes the weight files
of the previous checkpoint that are no longer part of it (`io/files.py`): a failed save leaves the folder as it was.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import math
import re
import warnings
from pathlib import Path

import torch

from ..io.files import FolderWriter, TensorIndex, save_tensors
from ..io.hub import resolve_checkpoint
from ..io.safetensors_mmap import CheckpointError, SafetensorsFile
from ..io.tokenizer import Tokenizer
from . import dequant, native, qmatmul
from .base import MTP_LAYER, CausalLM
from .budget import BUILD_ERRORS, TooLargeError, build_on_meta
from .families import config_from_json, model_class_for
from .linear import FastLinear, LayerSource
from .masks import MASKS_CONFIG, load_adapter
from .moe import Stack
from .quantized import DecodedTensor, QuantizedIndex, decoded_index

log = logging.getLogger("mtp")
# Files that travel with the weights: the tokenizer, the chat template, the default sampling parameters, and the
# token counts that reduced-vocabulary drafting reads.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "token_frequencies.json")
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}
BACKBONE_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Elements checked for NaN/Inf at a time: bounds the temporary the check allocates (16 MB of bools).
FINITE_CHUNK = 1 << 24


class MissingMTPWarning(UserWarning):
    """The config declares MTP layers but the checkpoint holds no MTP tensors."""


class NonFiniteWeightsWarning(UserWarning):
    """A checkpoint tensor holds NaN or Inf (load with strict=True to refuse such a checkpoint)."""


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype | None:
    """A torch float dtype from a dtype or its name; None for "auto" (keep the checkpoint's)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_NAMES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return DTYPE_NAMES[dtype]


def _checkpoint_dtype(files: TensorIndex, names: list[str]) -> torch.dtype:
    """The float dtype most of the checkpoint's weights are stored in."""
    counts: dict[torch.dtype, int] = {}
    for name in names:
        st, key = files[name]
        dt = st.dtype(key)
        if dt.is_floating_point:
            counts[dt] = counts.get(dt, 0) + 1
    best = max(counts, key=counts.get, default=torch.float32)
    return best if best in DTYPE_NAMES.values() else torch.float32


def _gc_paused(fn):
    """fn run with the cyclic garbage collector paused: a load builds many small objects (modules, parameters, the
    headers' entries), and the collections they set off took a quarter of loading the shipped model (0.95 -> 0.70 s
    without them, docs/decisions.md 2026-12-06). Garbage is still freed by its reference counts; cycles wait for the
    next collection after the load."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


@_gc_paused
def load_model(path: str | Path, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu",
               config=None, revision: str | None = None, quantize: str | None = None, strict: bool = False,
               release: bool = False) -> CausalLM:
    """Load a checkpoint folder or hub id (`org/name`, optional `revision`) -> model in eval mode.

    dtype "auto" keeps the checkpoint's (bf16 stays bf16, and the weights stay memory-mapped). On the CPU a bf16
    model's linear layers get oneDNN-packed copies for inference; `quantize="int8"` (per-channel) or "int4" (groups
    of 128) quantizes them and the routed experts (weight-only; the model is then bf16) - see `model/linear.py`. A
    quantized checkpoint (FP8: `model/quantized.py`) is decoded at load to `dtype` (auto: bf16). Quantizing goes layer
    by layer, and the memory-mapped pages of each weight it has read are dropped from memory as it goes (read again
    from the file if the float weight is ever used: training, `mtp quantize`). `release=True` (inference only: what
    `mtp generate / serve / check` load) also lets go of the quantized layers' float weights
    (`CausalLM.prepare_for_inference`): memory then holds the codes, the bf16 embedding and output heads; unquantized,
    of the float weights of the layers on qmatmul's bf16 product (their packed copies run), so a weight decoded at
    load (FP8, GPTQ without `quantize`) is held once, as a memory-mapped bf16 one is.
    An int4 checkpoint (GPTQ / AWQ 4-bit, compressed-tensors pack-quantized int4) with `quantize="int4"` runs its own
    codes in every int4 layer whose shape the kernels take at its group size (`_int4_sources`; with `release` those
    weights are never decoded); the others are decoded and quantized.
    Errors (CheckpointError, ConfigError) name the file and the tensor or key: missing, unexpected, wrong shape,
    wrong dtype, truncated or corrupt, a quantized tensor without its scale, a config that asks for more layers
    or a wider embedding than the tensors hold, a model larger than the memory available. A config with MTP layers
    but no MTP tensors loads with a MissingMTPWarning and `model.has_mtp == False` (never random heads). A tensor
    holding NaN or Inf gives a NonFiniteWeightsWarning naming it; `strict=True` refuses the checkpoint."""
    path = resolve_checkpoint(path, revision=revision)
    want_dtype = parse_dtype(dtype)
    if quantize is not None and want_dtype is None:
        want_dtype = torch.bfloat16
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder")
    if config is None:
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path}: no config.json")
        config = config_from_json(path / "config.json")
    cls = model_class_for(config)
    if torch.device(device).type == "cpu":  # the C kernels compiled side by side on a fresh machine (once a process)
        native.prebuild()
    with TensorIndex(path) as raw:
        files = decoded_index(raw, config, path)  # a quantized checkpoint's weights read as floats (model/quantized.py)
        shape = lambda key: files[key][0].shape(key)  # noqa: E731
        config = cls.checkpoint_config(config, list(files))
        sources, layout = cls.checkpoint_sources(list(files), shape, config)
        check_sizes(path, cls, config, sources, shape)
        n_mtp = config.mtp_num_hidden_layers
        has_mtp_tensors = any(cls.is_mtp_tensor(k, config) for k in files)
        with_mtp = n_mtp > 0 and has_mtp_tensors
        if n_mtp > 0 and not has_mtp_tensors:
            msg = (f"{path}: config declares {n_mtp} MTP layer(s) but the checkpoint holds no MTP tensors "
                   f"({cls.mtp_tensor_pattern(config)}; typical after fine-tuning with transformers, which drops them). "
                   "The model has NO usable MTP: speculative decoding falls back to plain decoding. Restore the heads "
                   "with `mtp heal`.")
            warnings.warn(msg, MissingMTPWarning, stacklevel=2)
            log.warning(msg)
        dtype_ = want_dtype or _checkpoint_dtype(files, [k for k in files if cls.internal_name(k, config) is not None])
        if isinstance(files, QuantizedIndex):
            files.dtype = dtype_
        try:
            model = build_on_meta(cls, config, dtype_, device, str(path / "config.json"), with_mtp=with_mtp)
        except TooLargeError:
            # Too big for memory - or only because the config disagrees with the tensors (e.g. head_dim 10**10):
            # then name the tensor. The layer counts are the checkpoint's, so an unbounded meta build is bounded.
            check_against(path, files, cls, config, sources, _meta_or_none(cls, config, with_mtp))
            raise
        check_against(path, files, cls, config, sources, model)
        expected = {n: p for n, p in model.state_dict(keep_vars=True).items() if not _is_tied(model, n)}
        # int4 from an int4 checkpoint: the layers that can run its codes as stored; released, they are never decoded
        int4 = _int4_sources(model, files, sources) if quantize == "int4" and torch.device(device).type == "cpu" else {}
        # int8 from an int8 checkpoint (one scale per row): the layers that run its codes as stored, as int4 above
        int8 = _int8_sources(model, files, sources, quantize) if quantize and torch.device(device).type == "cpu" else {}
        # decoded weights that the model runs packed for qmatmul's bf16 product and lets go of: decoded at prepare, one
        # at a time (FP8 straight into its packing), never all held as [out, in] weights (a copy of the model)
        cpu_bf16 = dtype_ == torch.bfloat16 and torch.device(device).type == "cpu"
        packs = _packed_sources(model, files, sources) if release and quantize is None and cpu_bf16 else {}
        # decoded weights that a released load quantizes and lets go of: decoded at prepare, one at a time, into one
        # reused scratch (never all held as bf16 weights: a copy of the model, in fresh pages)
        decoded = (_quantized_sources(model, files, sources, set(int4) | set(int8))
                   if release and quantize is not None and cpu_bf16 else {})
        experts = _expert_sources(model, files, sources) if release and quantize is not None and cpu_bf16 else {}
        deferred = {**packs, **decoded}
        coded = ({f"{m}.weight" for m in {**int4, **int8}} if release else set()) | {f"{m}.weight" for m in deferred} \
            | {f"{m}.{p}" for m in experts for p in EXPERT_PARAMS}
        state = {name: torch.empty(p.shape, dtype=dtype_, device="meta") if name in coded else
                 materialize(files, sources[name], tuple(p.shape), torch.float32 if cls.keeps_fp32(name) else dtype_, device)
                 for name, p in expected.items()}
        # quantizing: each weight's file pages are dropped once read (checked here, quantized below), so the load
        # does not hold the whole float checkpoint in memory beside its codes; unquantized, `prepare_for_inference`
        # drops the pages of the bf16 weights it packs for qmatmul's product (the others it runs in place)
        drop = _page_dropper(files, sources, state) if quantize is not None or cpu_bf16 else None
        bad = check_finite(files, sources, state, drop if quantize is not None else None)
        if not (deferred or experts):
            report_non_finite(files, sources, bad, strict)
        if (int4 or int8) and release:  # the codes are integers: their scales are what could be NaN / Inf
            scales = {key: files.raw.tensor(key) for m, e in {**int4, **int8}.items() for key in e.scale_names()}
            names = {k: k for k in scales}
            report_non_finite(files.raw, names, check_finite(files.raw, names, scales), strict)
        model.load_state_dict(state, strict=False, assign=True)
        _retie(model)
        model.eval()
        del state  # the model holds the weights now: a released one is freed at once
        layers = ({m: LayerSource(int4=d.int4) for m, d in int4.items()} | {m: LayerSource(int8=d.int8) for m, d in int8.items()}
                  | {m: LayerSource(pack=d.packed_bf16) for m, d in packs.items()}
                  | {m: LayerSource(weight=src.weight) for m, src in decoded.items()})
        model.prepare_for_inference(quantize, release=release, on_quantized=drop, sources=layers, experts=experts)
        for m, d in packs.items():  # their NaN / Inf as the decoder counted them (or read from the packed copy: the
            layer = model.get_submodule(m)  # weight's values and zeros), reported with the others'
            if not (isinstance(layer, FastLinear) and layer.kernel == "bf16-native" and layer._native):
                # (`packed_bf16_layers` names what this prepare packs: a layer left holding no weight is a bug)
                raise RuntimeError(f"{m}: loaded with no weight for a packed copy that was not built")
            if n := d.non_finite if d.non_finite is not None else non_finite(layer._packed):
                bad.append((f"{m}.weight", n))
        for m, src in decoded.items():  # (`quantized_layers` names what this prepare quantizes: as above)
            layer = model.get_submodule(m)
            if not (isinstance(layer, FastLinear) and layer.kernel in ("int8", "int4")) or src.non_finite is None:
                raise RuntimeError(f"{m}: loaded with no weight for quantized codes that were not built")
            if src.non_finite:
                bad.append((f"{m}.weight", src.non_finite))
        for m, src in experts.items():  # (`quantized_experts` names what this prepare quantizes: as above)
            if "_kernels" not in model.get_submodule(m).__dict__ or src.given < src.count:
                raise RuntimeError(f"{m}: loaded with no expert weights for quantized codes that were not built")
            bad += [(f"{m}.{p}", n) for p, n in zip(EXPERT_PARAMS, src.bad) if n]
        if deferred or experts:
            report_non_finite(files, sources, bad, strict)
    model.source_path = str(path)
    model.checkpoint_layout = layout
    model.tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    if (path / MASKS_CONFIG).exists():  # a mask-token adapter trained onto this checkpoint (`mtp retrofit --style masks`)
        load_adapter(model, path)
    return model


def _decoded_entries(files, sources: dict, keep) -> dict[str, DecodedTensor]:
    """module name -> the checkpoint entry of each layer's weight that is one stored quantized tensor (a
    `DecodedTensor`: not stacked experts) for which `keep(entry)` holds."""
    entries = {}
    for name, src in sources.items():
        if name.endswith(".weight") and isinstance(src, str):
            st, _ = files[src]
            if isinstance(st, DecodedTensor) and keep(st):
                entries[name.removesuffix(".weight")] = st
    return entries


def _int4_sources(model: CausalLM, files, sources: dict) -> dict[str, DecodedTensor]:
    """module name -> the int4 checkpoint entry (`DecodedTensor` with `int4_codes`) of each linear layer that
    `prepare_for_inference("int4")` can run on the stored codes (`CausalLM.int4_checkpoint_layers`); the rest (other
    formats, bit widths, group sizes the kernels do not take, stacked experts) are decoded and quantized again."""
    entries = _decoded_entries(files, sources, lambda e: e.int4_codes is not None)
    fits = model.int4_checkpoint_layers({m: e.int4_codes.group for m, e in entries.items()})
    return {m: entries[m] for m in fits}


def _int8_sources(model: CausalLM, files, sources: dict, quantize: str) -> dict[str, DecodedTensor]:
    """module name -> the int8 checkpoint entry (`DecodedTensor` with `int8_codes`: one scale per row) of each linear
    layer that `prepare_for_inference(quantize)` runs as "int8" (`CausalLM.int8_checkpoint_layers`): on its stored
    codes, neither decoded nor quantized again; where qmatmul's kernel runs (the codes go straight to its layout)."""
    if not qmatmul.available():
        return {}
    entries = _decoded_entries(files, sources, lambda e: e.int8_codes is not None)
    return {m: entries[m] for m in model.int8_checkpoint_layers(list(entries), quantize)}


def _packed_sources(model: CausalLM, files, sources: dict) -> dict[str, DecodedTensor | _StoredPack]:
    """module name -> the checkpoint entry of each layer that a released load packs for qmatmul's bf16 product
    (`packed_bf16_layers`), packed at prepare one at a time, never held as a loaded [out, in] weight: a weight decoded
    from a quantized checkpoint as it is packed (`DecodedTensor.packed_bf16`; scaled FP8 / int8 codes straight into
    the packing), a bf16 one straight from its file pages (`_StoredPack`)."""
    out = {}
    for m in model.packed_bf16_layers():
        src = sources.get(f"{m}.weight")
        # (a parameter kept in fp32 is loaded as such: its decode is not the bf16 one)
        if not isinstance(src, str) or model.keeps_fp32(f"{m}.weight"):
            continue
        st, key = files[src]
        if isinstance(st, DecodedTensor):
            out[m] = st
        elif isinstance(st, SafetensorsFile) and st.dtype(key) == torch.bfloat16:
            out[m] = _StoredPack(st, key)
    return out


class _StoredPack:
    """A bf16 weight stored as such, packed for qmatmul's bf16 product straight from the file's pages, its NaN / Inf
    counted as it is moved (`dequant.pack_bf16_counted`: the loader's check need not read it before; `non_finite` None where
    the torch form packed it), the pages then dropped. What `DecodedTensor.packed_bf16` is for a quantized weight."""

    def __init__(self, st: SafetensorsFile, key: str):
        self.st, self.key = st, key
        self.non_finite: int | None = None

    def packed_bf16(self, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, self.non_finite = dequant.pack_bf16_counted(self.st.tensor(self.key), out)
        self.st.release(self.key)
        return packed


class _ScratchDecode:
    """A quantized checkpoint's weight given on demand to the layer that quantizes it (`linear.LayerSource.weight`),
    decoded into a scratch that every weight of one load shares (`DecodedTensor.tensor_into`): valid until the next
    one is decoded; `non_finite` its NaN / Inf count once given (from the decoder, or read from the scratch)."""

    def __init__(self, entry: DecodedTensor, scratch: list[torch.Tensor], size: int):
        self.entry, self.scratch, self.size = entry, scratch, size  # (size: the load's largest weight, in elements)
        self.non_finite: int | None = None

    def weight(self) -> torch.Tensor:
        if not self.scratch:  # (allocated at the first decode: a load that fails before quantizing never holds it)
            self.scratch.append(torch.empty(self.size, dtype=torch.bfloat16))
        shape = self.entry.shape("")
        w = self.scratch[0][: math.prod(shape)].view(shape)
        self.non_finite = _read_into(self.entry, "", w)
        return w


def _read_into(st, key: str, out: torch.Tensor) -> int:
    """Checkpoint tensor `key` of `st` into `out` (bf16, its shape): a quantized one decoded there
    (`DecodedTensor.tensor_into`), a float one copied (its file pages then dropped). Returns its NaN / Inf count (the
    decoder's, or read from `out`)."""
    if isinstance(st, DecodedTensor):
        t = st.tensor_into(out)
        if t.data_ptr() != out.data_ptr():  # (a decoder that cannot write into a given tensor)
            out.copy_(t)
        n = st.non_finite
    else:
        out.copy_(st.tensor(key))
        st.release(key)
        n = None
    return n if n is not None else non_finite(out)


def _quantized_sources(model: CausalLM, files, sources: dict, coded: set[str]) -> dict[str, _ScratchDecode]:
    """module name -> the scratch decode of each layer that a released, quantized load quantizes and lets go of
    (`quantized_layers`, but those in `coded`: run on their checkpoint's int4 / int8 codes) and whose weight is decoded from
    a quantized checkpoint, where the one-pass kernels quantize (qmatmul: the quantizing reads the weight once)."""
    if not qmatmul.available():
        return {}
    entries = {}
    for m in model.quantized_layers():
        src = sources.get(f"{m}.weight")
        if (m not in coded and isinstance(src, str) and isinstance(files[src][0], DecodedTensor)
                and not model.keeps_fp32(f"{m}.weight")):
            entries[m] = files[src][0]
    scratch: list[torch.Tensor] = []
    size = max((math.prod(e.shape("")) for e in entries.values()), default=0)
    return {m: _ScratchDecode(e, scratch, size) for m, e in entries.items()}


EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class _ExpertDecode:
    """A released, quantizing load's routed experts (one `Experts` module) given one expert at a time to
    `Experts.prepare` from their per-expert checkpoint tensors (`moe.Stack` sources): expert e's gate|up rows and its
    down decoded (a quantized checkpoint's, `DecodedTensor.tensor_into`) or copied (a float one's, its file pages then
    dropped) into two scratches that the whole load shares, valid until the next expert. `bad`: the NaN / Inf counted
    per parameter (EXPERT_PARAMS); `given`: how many experts were given."""

    def __init__(self, files, stacks: tuple[Stack, Stack], shapes: tuple[tuple[int, ...], ...], scratch: list):
        self.files, self.stacks, self.shapes, self.scratch = files, stacks, shapes, scratch
        self.count, self.given, self.bad = shapes[0][0], 0, [0, 0]

    def __call__(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.given += 1
        return self._fill(0, e), self._fill(1, e)

    def _fill(self, which: int, e: int) -> torch.Tensor:
        shape = self.shapes[which][1:]
        out = self.scratch[which][: math.prod(shape)].view(shape)
        row = 0
        for key in self.stacks[which].parts[e]:
            st, _ = self.files[key]
            part = out[row : row + st.shape(key)[0]]
            self.bad[which] += _read_into(st, key, part)
            row += part.shape[0]
        return out


def _expert_sources(model: CausalLM, files, sources: dict) -> dict[str, _ExpertDecode]:
    """module name -> the expert-by-expert source of each routed experts module that a released, quantizing load
    quantizes and lets go of (`quantized_experts`) and whose checkpoint stores them per expert (`moe.Stack`): never
    all held as [E, ...] float weights (the largest part of an MoE model, in fresh pages), each expert decoded or
    copied only as it is quantized. Where the one-pass kernels quantize (qmatmul)."""
    if not qmatmul.available():
        return {}
    planned = {}
    for m in model.quantized_experts():
        stacks = tuple(sources.get(f"{m}.{p}") for p in EXPERT_PARAMS)
        if all(isinstance(s, Stack) for s in stacks):
            module = model.get_submodule(m)
            planned[m] = (stacks, tuple(tuple(getattr(module, p).shape) for p in EXPERT_PARAMS))
    if not planned:
        return {}
    # (allocated now, with nothing else held yet: the largest expert's two weights, shared by every module)
    scratch = [torch.empty(max(math.prod(shapes[i][1:]) for _, shapes in planned.values()), dtype=torch.bfloat16)
               for i in range(2)]
    return {m: _ExpertDecode(files, stacks, shapes, scratch) for m, (stacks, shapes) in planned.items()}


def _page_dropper(files: TensorIndex, sources: dict, state: dict[str, torch.Tensor]):
    """weight -> None: drop the memory-mapped file pages of a loaded weight (found by its data pointer) once it has
    been quantized. Its pages are clean copies of the file (nothing wrote to them since loading), so dropping them
    loses nothing: a later read of the float weight faults them in again. A weight that was copied at load (another
    dtype, stacked experts) had its pages dropped then; a weight not from the map (a release's copy) is left."""
    mapped = {}
    for name, t in state.items():
        src = sources.get(name)
        if isinstance(src, str) and t.device.type == "cpu" and t.numel() > 0:
            st, key = files[src]
            # a stored tensor (a decoded one's `tensor` would decode it again) that is a view of the map, not a copy
            if isinstance(st, SafetensorsFile) and st.tensor(key).data_ptr() == t.data_ptr():
                mapped[t.data_ptr()] = src

    def drop(weight: torch.Tensor) -> None:
        if weight.is_meta:  # never loaded (a layer run on its checkpoint's int4 codes)
            return
        src = mapped.get(weight.data_ptr())
        if src is not None:
            st, key = files[src]
            st.release(key)
    return drop


def _meta_or_none(cls, config, with_mtp: bool) -> CausalLM | None:
    """cls(config) on the meta device with no memory bound, or None when even that cannot be built (a size whose
    element count overflows)."""
    try:
        with torch.device("meta"):
            return cls(config, with_mtp=with_mtp)
    except BUILD_ERRORS:
        return None


def check_against(path: Path, files: TensorIndex, cls, config, sources: dict, model: CausalLM | None) -> None:
    """Every parameter of the (meta) model has a checkpoint tensor of its shape and a float dtype, and every tensor a
    parameter; drops the tied head's source (the shared parameter wins over a stored copy)."""
    if model is None:
        return
    expected = dict(model.state_dict(keep_vars=True))
    for name in [n for n in expected if _is_tied(model, n)]:
        expected.pop(name)
        sources.pop(name, None)  # some tied checkpoints store a copy; the shared parameter wins
    check_names(path, files, cls, expected, sources, config)
    for name, p in expected.items():
        check_source(files, sources[name], tuple(p.shape))


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out) or "none"


def _is_range(indices: list[int], n: int) -> bool:
    """Are the sorted distinct `indices` exactly 0..n-1? (Without building range(n): n may be 10**9.)"""
    return len(indices) == n and (n == 0 or (indices[0] == 0 and indices[-1] == n - 1))


def check_sizes(path: Path, cls, config, sources: dict, shape) -> None:
    """What the config asks for against what the checkpoint's tensors hold, before the model is built: the decoder
    layers (`model.layers.{i}`), the MTP layers (when the checkpoint holds any) and the embedding [vocab, hidden]."""
    where = path / "config.json"
    backbone = sorted({int(m[1]) for k in sources if (m := BACKBONE_LAYER.match(k))})
    L = config.num_hidden_layers
    if not _is_range(backbone, L):
        raise CheckpointError(f"{where}: config key 'num_hidden_layers' is {L} but the checkpoint holds decoder layers "
                              f"{_spans(backbone)} (model.layers.{{i}}.*)")
    found = sorted({int(m[1]) for k in sources if (m := MTP_LAYER.match(k))})
    n = config.mtp_num_hidden_layers
    if found and not _is_range(found, n):
        names = ", ".join(cls.checkpoint_name(f"mtp.layers.{i}.*", config) for i in found[:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise CheckpointError(f"{where}: config key '{config.mtp_layers_key}' is {n} but the checkpoint holds MTP layer "
                              f"tensors {names}{more}")
    embed = sources.get("model.embed_tokens.weight")
    want = (config.vocab_size, config.hidden_size)
    if isinstance(embed, str) and tuple(shape(embed)) != want:
        raise CheckpointError(f"{where}: config keys 'vocab_size' x 'hidden_size' ask for an embedding of {list(want)} "
                              f"but the checkpoint's tensor '{embed}' is {list(shape(embed))}")


def check_names(path: Path, files: TensorIndex, cls, expected: dict, sources: dict, config=None) -> None:
    """Every parameter has a source and every source a parameter; errors name the checkpoint's tensor."""
    missing = sorted(set(expected) - set(sources))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(cls.checkpoint_name(m, config) for m in missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(set(sources) - set(expected))
    if unexpected:
        key = first_tensor(sources[unexpected[0]])
        raise CheckpointError(f"{files[key][0].path}: unexpected tensor '{key}'"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + " for this config")


def first_tensor(source: str | Stack) -> str:
    """The (first) checkpoint tensor a parameter is read from."""
    return source if isinstance(source, str) else source.parts[0][0]


def source_shape(source: str | Stack, shape) -> tuple[int, ...]:
    """The shape a checkpoint source loads as: one tensor's, or the experts' stacked [E, rows, ...]."""
    if isinstance(source, str):
        return tuple(shape(source))
    first = [tuple(shape(k)) for k in source.parts[0]]
    return (len(source.parts), sum(s[0] for s in first), *first[0][1:])


def check_source(files: TensorIndex, source: str | Stack, want: tuple[int, ...]) -> None:
    """A parameter's checkpoint tensor(s) have its shape and a float dtype (read from the headers only)."""
    if isinstance(source, str):
        st, key = files[source]
        if st.shape(key) != want:
            raise CheckpointError(f"{st.path}: tensor '{key}' has shape {list(st.shape(key))}, expected {list(want)} "
                                  "for this config")
        if not st.dtype(key).is_floating_point:
            raise CheckpointError(f"{st.path}: tensor '{key}' has dtype {st.dtype(key)}, expected a float type")
        return
    for e, names in enumerate(source.parts):
        rows = 0
        for key in names:
            st, _ = files[key]
            s = st.shape(key)
            if rows + s[0] > want[1] or tuple(s[1:]) != want[2:] or not st.dtype(key).is_floating_point:
                raise CheckpointError(f"{st.path}: tensor '{key}' has shape {list(s)}, which does not fit "
                                      f"expert {e} of a {list(want)} parameter for this config")
            rows += s[0]
        if rows != want[1]:
            raise CheckpointError(f"{files[names[0]][0].path}: the tensors of expert {e} ({', '.join(names)}) give "
                                  f"{rows} rows, expected {want[1]} for this config")


def materialize(files: TensorIndex, source: str | Stack, shape: tuple[int, ...], dtype: torch.dtype,
                device: str | torch.device) -> torch.Tensor:
    """One parameter from its checkpoint source (checked by `check_source`). A tensor kept in its dtype on the CPU
    stays a view of the memory-mapped file (no copy); a converted or stacked one is copied and its file pages are
    dropped from memory at once, so loading peaks near the weights' size rather than twice it."""
    if isinstance(source, str):
        st, key = files[source]
        src = st.tensor(key)
        out = src.to(device=device, dtype=dtype)
        if out.data_ptr() != src.data_ptr():
            st.release(key)
        return out
    out = torch.empty(shape, dtype=dtype, device=device)
    for e, names in enumerate(source.parts):
        row = 0
        for key in names:
            st, _ = files[key]
            t = st.tensor(key)
            out[e, row : row + t.shape[0]].copy_(t)
            row += t.shape[0]
            st.release(key)
    return out


def non_finite(t: torch.Tensor) -> int:
    """How many elements of a float tensor are NaN or +-Inf: in C where it can (`dequant.count_nonfinite`, one pass at
    memory speed); else the common case (none) costs one min/max pass, which propagates NaN and shows an infinity (5
    GB/s on one core, 30x faster than isfinite: docs/decisions.md), and only a tensor that fails it is counted element
    by element, FINITE_CHUNK at a time."""
    if t.numel() == 0:
        return 0
    if (n := dequant.count_nonfinite(t)) is not None:
        return n
    lo, hi = torch.aminmax(t.reshape(-1))
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0
    flat = t.reshape(-1)
    return sum(int((~torch.isfinite(flat[i : i + FINITE_CHUNK])).sum()) for i in range(0, flat.numel(), FINITE_CHUNK))


def _counted(files: TensorIndex, source, t: torch.Tensor) -> int | None:
    """NaN / Inf in t as its decoder counted them while writing it (`DecodedTensor.non_finite`: an FP8 weight decoded
    in C), or None: t must be read to know."""
    if not isinstance(files, QuantizedIndex) or not isinstance(source, str):
        return None
    st, _ = files[source]
    if isinstance(st, DecodedTensor) and st.non_finite is not None and t.dtype in (st.index.dtype, torch.float32):
        return st.non_finite  # (a widening to fp32 keeps every value as it is)
    return None


def check_finite(files: TensorIndex, sources: dict, state: dict[str, torch.Tensor], drop=None) -> list[tuple[str, int]]:
    """The weights holding NaN or Inf, [(parameter, how many)], for `report_non_finite` (meta tensors: not loaded,
    skipped). `drop(t)`, when given, is called on each tensor once checked (the loader drops its file pages there)."""
    bad = []
    for name, t in state.items():
        if t.is_floating_point() and not t.is_meta:
            n = _counted(files, sources[name], t)
            if n is None:
                n = non_finite(t)
            if n:
                bad.append((name, n))
        if drop is not None:
            drop(t)
    return bad


def report_non_finite(files: TensorIndex, sources: dict, bad: list[tuple[str, int]], strict: bool) -> None:
    """NaN or Inf in a weight makes every forward non-finite (greedy decoding then emits token 0, often end-of-text,
    with no other sign): warn naming the tensors in `bad` [(parameter, how many NaN / Inf)] (NonFiniteWeightsWarning),
    or refuse the checkpoint under `strict` (CheckpointError); nothing when `bad` is empty."""
    if not bad:
        return
    key = first_tensor(sources[bad[0][0]])
    listed = ", ".join(f"'{first_tensor(sources[name])}' ({n} value{'s' * (n > 1)})" for name, n in bad[:5])
    more = f" and {len(bad) - 5} more tensors" if len(bad) > 5 else ""
    msg = f"{files[key][0].path}: NaN or Inf in tensor {listed}{more}: every output of this model would be garbage"
    if strict:
        raise CheckpointError(msg)
    msg += " (load with strict=True / --strict to refuse such a checkpoint)"
    warnings.warn(msg, NonFiniteWeightsWarning, stacklevel=3)
    log.warning(msg)


def _is_tied(model: CausalLM, name: str) -> bool:
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def _retie(model: CausalLM) -> None:
    # load_state_dict(assign=True) replaces parameters one by one, which unties a shared one.
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def save_model(model: CausalLM, path: str | Path, max_shard_size: int | None = None,
               dtype: torch.dtype | str | None = None, state: dict[str, torch.Tensor] | None = None,
               quantization_config: dict | None = None) -> None:
    """Write config.json + safetensors (the family's own names) + the tokenizer files to folder `path`. Every file is
    staged and fsynced first, then all are renamed into place and the previous checkpoint's weight files that are no
    longer part of it are removed: a save that fails (a full disk: OSError ENOSPC) leaves the folder as it was.
    `state` (checkpoint name -> tensor) replaces the model's own tensors and `quantization_config` goes into
    config.json: how `mtp quantize` (quantize.py) writes a quantized checkpoint of the model."""
    path = Path(path)
    state = model.checkpoint_state() if state is None else state
    if gone := [k for k, v in state.items() if v.is_meta]:  # before the folder is touched
        raise ValueError(f"cannot save tensor '{gone[0]}'{f' and {len(gone) - 1} more' if len(gone) > 1 else ''}: the "
                         "model was loaded for inference with release=True and holds only its quantized codes; load it "
                         "without release=True to save it")
    path.mkdir(parents=True, exist_ok=True)
    if dtype is not None and (dt := parse_dtype(dtype)) is not None:
        state = {k: v if model.keeps_fp32(k) or not v.is_floating_point() else v.to(dt) for k, v in state.items()}
    config = model.config.text_only()
    if model.mtp is None and config.mtp_num_hidden_layers > 0:
        log.warning("saving a model without MTP weights: config keeps %s=%d", config.mtp_layers_key,
                    config.mtp_num_hidden_layers)
    config.extra.pop("quantization_config", None)  # a quantized checkpoint was decoded at load: it saves as floats
    if quantization_config is not None:
        config.extra["quantization_config"] = quantization_config
    saved_dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    config.extra["dtype"] = str(saved_dtype).removeprefix("torch.")
    config.extra.pop("torch_dtype", None)
    config.extra["architectures"] = [config.architecture]
    source = model.source_path
    with FolderWriter(path) as out:
        save_tensors(state, out, max_shard_size)
        if model.__dict__.get("masks") is not None:  # its mask-token adapter, beside the unchanged weights
            model.masks.write(out)
        out.write_text("config.json", json.dumps(config.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        if source and Path(source).resolve() != path.resolve():
            for name in COMPANION_FILES:
                if (Path(source) / name).exists():
                    out.copy(name, Path(source) / name)
