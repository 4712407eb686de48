"""Load and save checkpoints in their Hugging Face layout (safetensors, single or sharded), for every family.

Loading: resolve a folder or hub id, read `config.json` into the family's config, map every tensor name
through the family (`internal_name`), check names, shapes and dtypes against the model built on the meta
device, and take the tensors from the memory-mapped files (no copy when the dtype is kept). Saving writes
the family's own tensor names and config keys, each file atomically.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import torch

from ..io.files import TensorIndex, atomic_write_text, save_tensors
from ..io.hub import resolve_checkpoint
from ..io.safetensors_mmap import CheckpointError
from ..io.tokenizer import Tokenizer
from .base import CausalLM
from .families import config_from_json, model_class_for
from .moe import Stack

log = logging.getLogger("mtp")
# Files that travel with the weights: the tokenizer, the chat template, the default sampling parameters, and the
# token counts that reduced-vocabulary drafting reads.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "token_frequencies.json")
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}


class MissingMTPWarning(UserWarning):
    """The config declares MTP layers but the checkpoint holds no MTP tensors."""


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


def load_model(path: str | Path, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu",
               config=None, revision: str | None = None, quantize: str | None = None) -> CausalLM:
    """Load a checkpoint folder or hub id (`org/name`, optional `revision`) -> model in eval mode.

    dtype "auto" keeps the checkpoint's (bf16 stays bf16, and the weights stay memory-mapped). On the CPU a bf16
    model's linear layers get oneDNN-packed copies for inference; `quantize="int8"` quantizes them (weight-only,
    per-channel; the model is then bf16) - see `model/linear.py`. Errors
    (CheckpointError) name the file and tensor: missing, unexpected, wrong shape, wrong dtype, truncated or
    corrupt. A config with MTP layers but no MTP tensors loads with a MissingMTPWarning and
    `model.has_mtp == False` (never random heads)."""
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
    with TensorIndex(path) as files:
        shape = lambda key: files[key][0].shape(key)  # noqa: E731
        config = checkpoint_config(cls, config, list(files))
        sources, layout = cls.checkpoint_sources(list(files), shape, config)
        n_mtp = config.mtp_num_hidden_layers
        has_mtp_tensors = any(cls.is_mtp_tensor(k, config) for k in files if cls.internal_name(k, config) is not None)
        with_mtp = n_mtp > 0 and has_mtp_tensors
        if n_mtp > 0 and not has_mtp_tensors:
            msg = (f"{path}: config declares {n_mtp} MTP layer(s) but the checkpoint holds no MTP tensors "
                   f"({cls.mtp_tensor_pattern(config)}; typical after fine-tuning with transformers, which drops them). "
                   "The model has NO usable MTP: speculative decoding falls back to plain decoding. Restore the heads "
                   "with `mtp heal`.")
            warnings.warn(msg, MissingMTPWarning, stacklevel=2)
            log.warning(msg)
        with torch.device("meta"):
            model = cls(config, with_mtp=with_mtp)
        expected = dict(model.state_dict(keep_vars=True))
        for name in [n for n in expected if _is_tied(model, n)]:
            expected.pop(name)
            sources.pop(name, None)  # some tied checkpoints store a copy; the shared parameter wins
        check_names(path, files, cls, expected, sources, config)
        dtype_ = want_dtype or _checkpoint_dtype(files, [k for k in files if cls.internal_name(k, config) is not None])
        state = {name: materialize(files, sources[name], tuple(p.shape), torch.float32 if keeps_fp32(cls, name) else dtype_,
                                   device) for name, p in expected.items()}
    model.load_state_dict(state, strict=False, assign=True)
    _retie(model)
    model.eval()
    model.prepare_for_inference(quantize)
    model.source_path = str(path)
    model.checkpoint_layout = layout
    model.tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return model


def checkpoint_config(cls, config, names: list[str]):
    """The config completed with what only the checkpoint's tensor names tell (a family's optional
    `checkpoint_config(config, names)`; e.g. whether DeepSeek-style MTP layers hold their own embedding)."""
    complete = getattr(cls, "checkpoint_config", None)
    return config if complete is None else complete(config, names)


def keeps_fp32(cls, name: str) -> bool:
    """Is this parameter (our name or the checkpoint's) kept in fp32 whatever the model's dtype? A family lists such
    parameters by name suffix in `fp32_parameters` (DeepSeek's router, as transformers keeps it)."""
    return any(name == s or name.endswith("." + s) for s in getattr(cls, "fp32_parameters", ()))


def check_names(path: Path, files: TensorIndex, cls, expected: dict, sources: dict, config=None) -> None:
    """Every parameter has a source and every source a parameter; errors name the checkpoint's tensor."""
    missing = sorted(set(expected) - set(sources))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(cls.checkpoint_name(m, config) for m in missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(set(sources) - set(expected))
    if unexpected:
        src = sources[unexpected[0]]
        key = src if isinstance(src, str) else src.parts[0][0]
        raise CheckpointError(f"{files[key][0].path.name}: unexpected tensor '{key}'"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + " for this config")


def _check_tensor(st, key: str, want: tuple[int, ...]) -> None:
    if st.shape(key) != want:
        raise CheckpointError(f"{st.path.name}: tensor '{key}' has shape {list(st.shape(key))}, expected {list(want)} "
                              "for this config")
    if not st.dtype(key).is_floating_point:
        raise CheckpointError(f"{st.path.name}: tensor '{key}' has dtype {st.dtype(key)}, expected a float type")


def materialize(files: TensorIndex, source: str | Stack, shape: tuple[int, ...], dtype: torch.dtype,
                device: str | torch.device) -> torch.Tensor:
    """One parameter from its checkpoint source. A tensor kept in its dtype on the CPU stays a view of the
    memory-mapped file (no copy); a converted or stacked one is copied and its file pages are dropped from memory
    at once, so loading peaks near the weights' size rather than twice it."""
    if isinstance(source, str):
        st, key = files[source]
        _check_tensor(st, key, shape)
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
            if row + t.shape[0] > shape[1] or tuple(t.shape[1:]) != shape[2:] or not t.dtype.is_floating_point:
                raise CheckpointError(f"{st.path.name}: tensor '{key}' has shape {list(t.shape)}, which does not fit "
                                      f"expert {e} of a {list(shape)} parameter for this config")
            out[e, row : row + t.shape[0]].copy_(t)
            row += t.shape[0]
            st.release(key)
        if row != shape[1]:
            raise CheckpointError(f"{files[names[0]][0].path.name}: the tensors of expert {e} ({', '.join(names)}) give "
                                  f"{row} rows, expected {shape[1]} for this config")
    return out


def _is_tied(model: CausalLM, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _retie(model: CausalLM) -> None:
    # load_state_dict(assign=True) replaces parameters one by one, which unties a shared one.
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight


def save_model(model: CausalLM, path: str | Path, max_shard_size: int | None = None,
               dtype: torch.dtype | str | None = None) -> None:
    """Write config.json + safetensors (the family's own names) + the tokenizer files to folder `path`, each
    file atomically."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = model.checkpoint_state()
    if dtype is not None and (dt := parse_dtype(dtype)) is not None:
        state = {k: v if keeps_fp32(type(model), k) else v.to(dt) for k, v in state.items()}
    save_tensors(state, path, max_shard_size)
    config = model.config.text_only()
    if model.mtp is None and config.mtp_num_hidden_layers > 0:
        log.warning("saving a model without MTP weights: config keeps mtp_num_hidden_layers=%d",
                    config.mtp_num_hidden_layers)
    saved_dtype = next(iter(state.values())).dtype
    config.extra["dtype"] = str(saved_dtype).removeprefix("torch.")
    config.extra.pop("torch_dtype", None)
    config.extra["architectures"] = [config.architecture]
    atomic_write_text(path / "config.json", json.dumps(config.to_hf_dict(), indent=2, sort_keys=True) + "\n")
    source = model.source_path
    if source and Path(source).resolve() != path.resolve():
        for name in COMPANION_FILES:
            if (Path(source) / name).exists():
                shutil.copyfile(Path(source) / name, path / name)
