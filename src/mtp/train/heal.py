"""`mtp heal`: give a fine-tuned checkpoint that lost its MTP tensors (`mtp.*` in Qwen3.5; each family names its own)
its base model's MTP back.

Grafting works on the tensor files: the fine-tune's safetensors are copied byte for byte (so extra tensors
such as `model.visual.*` survive) and renamed as shards of a normal sharded checkpoint, and the base's
`mtp.*` tensors (checked by name and shape against the fine-tune's config) go into one more shard, listed
in `model.safetensors.index.json`. With `train=True` the grafted MTP is re-aligned to the fine-tuned
backbone in `heads` mode by self-distillation, and its shard is rewritten. Expected acceptance (MTP argmax
== backbone argmax) is reported for the base, the graft and the healed model when a data folder is given.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import torch

from ..io.files import INDEX, FolderWriter, read_tensors, weight_files, write_safetensors, write_shards
from ..io.safetensors_mmap import CheckpointError, SafetensorsFile
from ..model import config_from_json, load_model
from ..model.checkpoint import first_tensor, source_shape
from ..model.device import resolve_device
from ..model.families import model_class_for


def _with_mtp_of(config, base):
    """A copy of the fine-tune's config with the base's MTP settings (the config keys its family names)."""
    want = copy.deepcopy(config)
    for key in config.mtp_keys:
        setattr(want, key, getattr(base, key))
    want.validate()
    return want


def graft(base: Path, finetuned: Path, out: Path) -> list[str]:
    """Write `out`: the fine-tune's files + the base's MTP tensors. Returns the grafted tensor names."""
    base, finetuned, out = Path(base), Path(finetuned), Path(out)
    for p, what in ((base, "--base"), (finetuned, "--finetuned")):
        if not (p / "config.json").exists():
            raise CheckpointError(f"{what} {p}: no config.json (not a checkpoint folder)")
    if out.resolve() in (base.resolve(), finetuned.resolve()):
        raise ValueError(f"--out {out} must differ from --base and --finetuned")
    bcfg = config_from_json(base / "config.json")
    fcfg = config_from_json(finetuned / "config.json")
    cls = model_class_for(fcfg)
    if model_class_for(bcfg) is not cls:
        raise CheckpointError(f"--base {base} ({type(bcfg).__name__}) and --finetuned {finetuned} "
                              f"({type(fcfg).__name__}) are different model families")
    with read_tensors(base) as bkeys, read_tensors(finetuned) as fkeys:
        mtp_keys = sorted(k for k in bkeys if cls.is_mtp_tensor(k, bcfg))
        if not mtp_keys:
            raise CheckpointError(f"--base {base}: holds no MTP tensors, nothing to graft")
        if any(cls.is_mtp_tensor(k, fcfg) for k in fkeys):
            raise CheckpointError(f"--finetuned {finetuned}: already holds MTP tensors; nothing to heal")
        # what the fine-tune's architecture expects of the MTP, with the base's MTP settings (our names)
        fcfg = cls.checkpoint_config(_with_mtp_of(fcfg, bcfg), list(bkeys))
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in cls(fcfg).state_dict().items() if k.startswith("mtp.")}
        shape = lambda key: bkeys[key][0].shape(key)  # noqa: E731
        have, _ = cls.checkpoint_sources(mtp_keys, shape, fcfg)  # our name -> base tensor (or per-expert tensors)
        missing = sorted(cls.checkpoint_name(k, fcfg) for k in set(want) - set(have))
        extra = sorted(first_tensor(have[k]) for k in set(have) - set(want))
        if missing or extra:
            raise CheckpointError(f"--base {base}: MTP tensors do not match the fine-tune's architecture "
                                  f"(missing {missing[:3]}, unexpected {extra[:3]})")
        for ours, src in have.items():
            k = first_tensor(src)
            got = source_shape(src, shape)
            if got != want[ours]:
                raise CheckpointError(f"--base {bkeys[k][0].path.name}: tensor '{k}' gives shape {list(got)}, the "
                                      f"fine-tune ({finetuned}) needs {list(want[ours])}: base and fine-tune differ in size")
        ref_key = next((k for k in fkeys if k.endswith("embed_tokens.weight")), next(iter(fkeys)))
        dtype = fkeys[ref_key][0].dtype(fkeys[ref_key][1])
        tensors = {k: bkeys.tensor(k).to(torch.float32 if cls.keeps_fp32(k) else dtype).contiguous() for k in mtp_keys}
        out.mkdir(parents=True, exist_ok=True)
        with FolderWriter(out) as w:
            for f in finetuned.iterdir():  # config, tokenizer, chat template, generation config ...
                if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX, "config.json"):
                    w.copy(f.name, f)
            # the fine-tune's files byte for byte (extra tensors such as `model.visual.*` survive), then the MTP's
            write_shards(w, [*weight_files(finetuned), tensors])
            w.write_text("config.json", json.dumps(fcfg.to_hf_dict(), indent=2) + "\n")
    return mtp_keys


def _rewrite_mtp_shard(out: Path, model) -> None:
    index = json.loads((out / INDEX).read_text())
    names = {v for k, v in index["weight_map"].items() if model.is_mtp_tensor(k, model.config)}
    if len(names) != 1:
        raise CheckpointError(f"{out}: MTP tensors are spread over {len(names)} files; expected one")
    shard = names.pop()
    with SafetensorsFile(out / shard) as st:
        dtype = st.dtype(st.keys()[0])
    state = {k: v.detach().to(torch.float32 if model.keeps_fp32(k) else dtype).contiguous()
             for k, v in model.checkpoint_state().items() if model.is_mtp_tensor(k, model.config)}
    with FolderWriter(out, replace_weights=False) as w:
        w.write(shard, lambda f: write_safetensors(f, state, {"format": "pt"}))


def acceptance(path: Path, data: Path, seq_len: int, eval_seqs: int, batch: int = 8, device: str = "cpu") -> dict:
    """Validation metrics (incl. accept_d) of a checkpoint on the data folder's validation split."""
    from ..data.shards import TokenShards
    from .batches import Batches
    from .evaluate import evaluate

    model = load_model(path, dtype="float32", device=device)
    if model.mtp is None:
        return {"accept_1": 0.0, "note": "no MTP: every draft is rejected (plain decoding)"}
    vb = Batches(TokenShards(data, "val"), seq_len).fixed(eval_seqs, batch)
    return evaluate(model, vb)


def heal(base: Path, finetuned: Path, out: Path, train: bool = False, data: Path | None = None, steps: int = 200,
         lr: float = 1e-3, seq_len: int = 256, micro_batch: int = 8, eval_seqs: int = 64, threads: int | None = None,
         seed: int = 0, progress: bool = True, device: str = "auto") -> dict:
    """Graft, optionally re-align (heads mode, self-distillation), and report acceptance before/after."""
    dev = str(resolve_device(device))
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
        report["base"] = pick(acceptance(Path(base), data, seq_len, eval_seqs, device=dev))
        report["finetuned_before"] = {"accept_1": 0.0, "note": "no MTP tensors: no drafts"}
        report["grafted"] = pick(acceptance(out, data, seq_len, eval_seqs, device=dev))
    if train:
        from .config import TrainConfig
        from .trainer import train as run

        with tempfile.TemporaryDirectory(prefix="mtp-heal-") as tmp:
            cfg = TrainConfig(data=str(data), out=tmp, mode="heads", init=str(out), heads_target="self",
                              seq_len=seq_len, micro_batch=micro_batch, max_steps=steps, lr=lr,
                              warmup_steps=max(1, steps // 20), eval_every=steps, save_every=steps,
                              eval_seqs=eval_seqs, seed=seed, progress=progress, keep_checkpoints=1, device=device)
            run(cfg)
            trained = load_model(Path(tmp) / "model", dtype="float32")
        _rewrite_mtp_shard(out, trained)
        report["healed"] = pick(acceptance(out, data, seq_len, eval_seqs, device=dev))
        report["heal_steps"] = steps
    return report
