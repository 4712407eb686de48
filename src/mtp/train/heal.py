"""`mtp heal`: give a fine-tuned Qwen3.5 checkpoint that lost `mtp.*` its base model's MTP back.

Grafting works on the tensor files: the fine-tune's safetensors are copied byte for byte (so extra tensors
such as `model.visual.*` survive) and renamed as shards of a normal sharded checkpoint, and the base's
`mtp.*` tensors (checked by name and shape against the fine-tune's config) go into one more shard, listed
in `model.safetensors.index.json`. With `train=True` the grafted MTP is re-aligned to the fine-tuned
backbone in `heads` mode by self-distillation, and its shard is rewritten. Expected acceptance (MTP argmax
== backbone argmax) is reported for the base, the graft and the healed model when a data folder is given.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import Qwen35Config, Qwen35ForCausalLM, load_model
from ..io.checkpoint import INDEX, _atomic_write, weight_files
from ..io.safetensors_mmap import CheckpointError, SafetensorsFile

MTP_SHARD_TAG = "mtp"


def _all_keys(path: Path) -> dict[str, tuple[SafetensorsFile, str]]:
    out = {}
    for f in weight_files(path):
        st = SafetensorsFile(f)
        for k in st.keys():
            out[k] = (st, k)
    return out


def graft(base: Path, finetuned: Path, out: Path) -> list[str]:
    """Write `out`: the fine-tune's files + the base's mtp.* tensors. Returns the grafted tensor names."""
    base, finetuned, out = Path(base), Path(finetuned), Path(out)
    for p, what in ((base, "--base"), (finetuned, "--finetuned")):
        if not (p / "config.json").exists():
            raise CheckpointError(f"{what} {p}: no config.json (not a checkpoint folder)")
    if out.resolve() in (base.resolve(), finetuned.resolve()):
        raise ValueError(f"--out {out} must differ from --base and --finetuned")
    bcfg = Qwen35Config.from_json(base / "config.json")
    fcfg = Qwen35Config.from_json(finetuned / "config.json")
    bkeys, fkeys = _all_keys(base), _all_keys(finetuned)
    mtp_keys = sorted(k for k in bkeys if k.startswith("mtp."))
    if not mtp_keys:
        raise CheckpointError(f"--base {base}: holds no mtp.* tensors, nothing to graft")
    if any(k.startswith("mtp.") for k in fkeys):
        raise CheckpointError(f"--finetuned {finetuned}: already holds mtp.* tensors; nothing to heal")
    # what the fine-tune's architecture expects under mtp.*, with the base's MTP settings
    want_cfg = Qwen35Config.from_json(finetuned / "config.json")
    want_cfg.mtp_num_hidden_layers = bcfg.mtp_num_hidden_layers
    want_cfg.mtp_style = bcfg.mtp_style
    want_cfg.mtp_use_dedicated_embeddings = bcfg.mtp_use_dedicated_embeddings
    want_cfg.validate()
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Qwen35ForCausalLM(want_cfg).state_dict().items() if k.startswith("mtp.")}
    missing = sorted(set(want) - set(mtp_keys))
    extra = sorted(set(mtp_keys) - set(want))
    if missing or extra:
        raise CheckpointError(f"--base {base}: mtp.* tensors do not match the fine-tune's architecture "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for k in mtp_keys:
        st, key = bkeys[k]
        if st.shape(key) != want[k]:
            raise CheckpointError(f"--base {st.path.name}: tensor '{k}' has shape {list(st.shape(key))}, the fine-tune "
                                  f"({finetuned}) needs {list(want[k])}: base and fine-tune differ in size")
    ref_key = next((k for k in fkeys if k.endswith("embed_tokens.weight")), next(iter(fkeys)))
    dtype = fkeys[ref_key][0].dtype(fkeys[ref_key][1])

    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + [out / INDEX]:
        old.unlink(missing_ok=True)
    for f in finetuned.iterdir():  # config, tokenizer, chat template, generation config ...
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX:
            shutil.copyfile(f, out / f.name)
    files = weight_files(finetuned)
    n = len(files) + 1
    weight_map: dict[str, str] = {}
    total = 0
    for i, f in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        shutil.copyfile(f, out / name)
        st = SafetensorsFile(out / name)
        for k in st.keys():
            weight_map[k] = name
            total += st.tensor(k).numel() * st.tensor(k).element_size()
    mtp_name = f"model-{n:05d}-of-{n:05d}.safetensors"
    tensors = {k: bkeys[k][0].tensor(bkeys[k][1]).to(dtype).contiguous() for k in mtp_keys}
    _atomic_write(out / mtp_name, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    for k, t in tensors.items():
        weight_map[k] = mtp_name
        total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic_write(out / INDEX, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2) + "\n"))
    fcfg.mtp_num_hidden_layers = bcfg.mtp_num_hidden_layers
    fcfg.mtp_style = bcfg.mtp_style
    fcfg.mtp_use_dedicated_embeddings = bcfg.mtp_use_dedicated_embeddings
    _atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(fcfg.to_hf_dict(), indent=2) + "\n"))
    return mtp_keys


def _rewrite_mtp_shard(out: Path, model) -> None:
    index = json.loads((out / INDEX).read_text())
    names = {v for k, v in index["weight_map"].items() if k.startswith("mtp.")}
    if len(names) != 1:
        raise CheckpointError(f"{out}: mtp.* tensors are spread over {len(names)} files; expected one")
    shard = out / names.pop()
    dtype = SafetensorsFile(shard).dtype(next(k for k in index["weight_map"] if k.startswith("mtp.")))
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k.startswith("mtp.")}
    _atomic_write(shard, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))


def acceptance(path: Path, data: Path, seq_len: int, eval_seqs: int, batch: int = 8) -> dict:
    """Validation metrics (incl. accept_d) of a checkpoint on the data folder's validation split."""
    from ..data.shards import TokenShards
    from .batches import Batches
    from .evaluate import evaluate

    model = load_model(path)
    if model.mtp is None:
        return {"accept_1": 0.0, "note": "no MTP: every draft is rejected (plain decoding)"}
    vb = Batches(TokenShards(data, "val"), seq_len).fixed(eval_seqs, batch)
    return evaluate(model, vb)


def heal(base: Path, finetuned: Path, out: Path, train: bool = False, data: Path | None = None, steps: int = 200,
         lr: float = 1e-3, seq_len: int = 256, micro_batch: int = 8, eval_seqs: int = 64, threads: int | None = None,
         seed: int = 0, progress: bool = True) -> dict:
    """Graft, optionally re-align (heads mode, self-distillation), and report acceptance before/after."""
    if train and data is None:
        raise ValueError("mtp heal --train needs --data (a folder built by `mtp data`)")
    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    grafted = graft(base, finetuned, out)
    report: dict = {"out": str(out), "grafted_tensors": len(grafted)}
    keep = ("loss", "accept_1", "accept_pos_1", "mean_accepted_length")
    if data is not None:
        pick = lambda m: {k: round(v, 4) for k, v in m.items() if k in keep or k.startswith("accept_")}  # noqa: E731
        report["base"] = pick(acceptance(Path(base), data, seq_len, eval_seqs))
        report["finetuned_before"] = {"accept_1": 0.0, "note": "no mtp.* tensors: no drafts"}
        report["grafted"] = pick(acceptance(out, data, seq_len, eval_seqs))
    if train:
        from .config import TrainConfig
        from .trainer import train as run

        with tempfile.TemporaryDirectory(prefix="mtp-heal-") as tmp:
            cfg = TrainConfig(data=str(data), out=tmp, mode="heads", init=str(out), heads_target="self",
                              seq_len=seq_len, micro_batch=micro_batch, max_steps=steps, lr=lr,
                              warmup_steps=max(1, steps // 20), eval_every=steps, save_every=steps,
                              eval_seqs=eval_seqs, seed=seed, progress=progress, keep_checkpoints=1)
            run(cfg)
            trained = load_model(Path(tmp) / "model")
        _rewrite_mtp_shard(out, trained)
        report["healed"] = pick(acceptance(out, data, seq_len, eval_seqs))
        report["heal_steps"] = steps
    return report
