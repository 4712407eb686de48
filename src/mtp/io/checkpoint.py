"""Load and save Qwen3.5 checkpoints in the HF layout (safetensors, single or sharded).

Read layouts: text-only (`model.*`, `lm_head.*`, `mtp.*`) and multimodal (`model.language_model.*`,
`model.visual.*` ignored, `lm_head.*`, `mtp.*`). Written layout: text-only with a flat
`qwen3_5_text` config, which transformers (`Qwen3_5ForCausalLM`), vLLM and llama.cpp read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import Qwen35Config
from ..model import Qwen35ForCausalLM
from ..model.rope import rope_inv_freq
from .safetensors_mmap import CheckpointError, SafetensorsFile
from .tokenizer import Tokenizer

log = logging.getLogger("mtp")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}


class MissingMTPWarning(UserWarning):
    """The config declares MTP layers but the checkpoint holds no `mtp.*` tensors."""


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_NAMES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return DTYPE_NAMES[dtype]


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (from the index when sharded)."""
    if (path / INDEX).exists():
        try:
            index = json.loads((path / INDEX).read_text())
            names = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{path / INDEX}: corrupt index ({e})") from None
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{path / INDEX}: lists shard file(s) that do not exist: {', '.join(missing)}")
        return [path / n for n in names]
    if (path / SINGLE).exists():
        return [path / SINGLE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model.safetensors, {INDEX} or *.safetensors file")
    return files


def hf_to_mtp_name(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name (None: not part of the text model)."""
    if name.startswith("model.visual.") or name.startswith("visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def read_tensors(path: str | Path) -> dict[str, tuple[SafetensorsFile, str]]:
    """All tensors of a checkpoint folder: our name -> (file, name in file). Lazy (memory-mapped)."""
    path = Path(path)
    out: dict[str, tuple[SafetensorsFile, str]] = {}
    for f in weight_files(path):
        st = SafetensorsFile(f)
        for key in st.keys():
            ours = hf_to_mtp_name(key)
            if ours is not None:
                if ours in out:
                    raise CheckpointError(f"{f}: tensor '{key}' also appears in {out[ours][0].path.name}")
                out[ours] = (st, key)
    return out


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               config: Qwen35Config | None = None) -> Qwen35ForCausalLM:
    """Load a Qwen3.5 checkpoint folder (HF layout) -> model in eval mode.

    Errors (CheckpointError) name the file and tensor: missing, unexpected, wrong shape, wrong dtype,
    truncated or corrupt. A config with MTP layers but no `mtp.*` tensors loads with a MissingMTPWarning
    and `model.has_mtp == False` (never random heads).
    """
    path = Path(path)
    dtype = parse_dtype(dtype)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder")
    if config is None:
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path}: no config.json")
        config = Qwen35Config.from_json(path / "config.json")
    tensors = read_tensors(path)
    has_mtp_tensors = any(k.startswith("mtp.") for k in tensors)
    with_mtp = config.mtp_num_hidden_layers > 0 and has_mtp_tensors
    if config.mtp_num_hidden_layers > 0 and not has_mtp_tensors:
        msg = (f"{path}: config declares mtp_num_hidden_layers={config.mtp_num_hidden_layers} but the checkpoint "
               "holds no mtp.* tensors (typical after fine-tuning with transformers, which drops them). The model "
               "has NO usable MTP: speculative decoding falls back to plain decoding. Restore the heads with "
               "`mtp heal`.")
        warnings.warn(msg, MissingMTPWarning, stacklevel=2)
        log.warning(msg)

    with torch.device("meta"):
        model = Qwen35ForCausalLM(config, with_mtp=with_mtp)
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store a copy; the embedding wins
    where = lambda k: tensors[k][0].path.name  # noqa: E731
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        k = unexpected[0]
        raise CheckpointError(f"{where(k)}: unexpected tensor '{tensors[k][1]}'"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + " for this config")
    state = {}
    for k, p in expected.items():
        st, key = tensors[k]
        if st.shape(key) != tuple(p.shape):
            raise CheckpointError(f"{st.path.name}: tensor '{key}' has shape {list(st.shape(key))}, "
                                  f"expected {list(p.shape)} for this config")
        if not st.dtype(key).is_floating_point:
            raise CheckpointError(f"{st.path.name}: tensor '{key}' has dtype {st.dtype(key)}, expected a float type")
        state[k] = st.tensor(key).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta).to(device)
    model._rope_table = None
    model.eval()
    model.source_path = str(path)
    model.tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return model


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_state(state: dict[str, torch.Tensor], path: Path, max_shard_bytes: int | None = None,
               metadata: dict[str, str] | None = None) -> None:
    """Write tensors as model.safetensors (or shards + index when over max_shard_bytes), atomically."""
    meta = {"format": "pt", **(metadata or {})}
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    for old in list(path.glob("model*.safetensors")) + ([path / INDEX] if (path / INDEX).exists() else []):
        old.unlink()
    if max_shard_bytes is None or total <= max_shard_bytes:
        _atomic_write(path / SINGLE, lambda tmp: save_file(state, tmp, metadata=meta))
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(state):
        n = state[k].numel() * state[k].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = state[k]
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _atomic_write(path / name, lambda tmp, s=shard: save_file(s, tmp, metadata=meta))
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _atomic_write(path / INDEX, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2) + "\n"))


def model_state(model: Qwen35ForCausalLM) -> dict[str, torch.Tensor]:
    """Tensors to write, under the HF names (tied head omitted, as transformers does)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_model(model: Qwen35ForCausalLM, path: str | Path, max_shard_size: int | None = None,
               dtype: torch.dtype | str | None = None) -> None:
    """Write config.json + safetensors (text-only HF layout) to folder `path`, each file atomically."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = model_state(model)
    if dtype is not None:
        dt = parse_dtype(dtype)
        state = {k: v.to(dt) for k, v in state.items()}
    save_state(state, path, max_shard_size)
    config = model.config.text_only()
    if model.mtp is None and config.mtp_num_hidden_layers > 0:
        log.warning("saving a model without MTP weights: config keeps mtp_num_hidden_layers=%d",
                    config.mtp_num_hidden_layers)
    saved_dtype = next(iter(state.values())).dtype
    config.extra["dtype"] = str(saved_dtype).removeprefix("torch.")
    config.extra.pop("torch_dtype", None)
    config.extra["architectures"] = ["Qwen3_5ForCausalLM"]
    _atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(
        json.dumps(config.to_hf_dict(), indent=2, sort_keys=True) + "\n"))
    source = getattr(model, "source_path", None)
    if source and Path(source).resolve() != path.resolve():
        for name in TOKENIZER_FILES:
            if (Path(source) / name).exists():
                shutil.copyfile(Path(source) / name, path / name)
