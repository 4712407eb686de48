"""Run checkpoints: HF-layout model folder + `trainer_state.pt` (optimizer, RNG, step, tokens), atomically.

`out/checkpoints/step-000123/` is written as `.step-000123.tmp/` (every file fsynced) and renamed when complete;
`out/latest` names the newest complete one (replaced atomically), so a kill at any point leaves a loadable run. A save
that fails (a full disk) removes its temporary folder and leaves the previous checkpoints and `latest` as they were.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ..io.files import FolderWriter, atomic_write_text, fsync_folder
from ..model import save_model
from ..model.checkpoint import COMPANION_FILES

STATE = "trainer_state.pt"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])


def copy_tokenizer(src: str | Path | None, dst: Path) -> None:
    """The tokenizer and the other companion files of folder `src` into `dst` (each fsynced, renamed into place)."""
    if src is None:
        return
    with FolderWriter(dst, replace_weights=False) as w:
        for name in COMPANION_FILES:
            if (Path(src) / name).exists():
                w.copy(name, Path(src) / name)


def save_checkpoint(out: Path, step: int, model, optimizer: torch.optim.Optimizer | dict, extra: dict,
                    tokenizer_dir: str | Path | None, keep: int = 2) -> Path:
    """Write out/checkpoints/step-XXXXXX atomically, point out/latest at it, prune to `keep` checkpoints.

    `model`: an unsharded model (`save_model` writes it); `optimizer`: the optimizer, or the state dict the caller
    already gathered into `optimizer.state_dict()`'s layout (FSDP: the full state, collected on rank 0)."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(model, tmp)
        copy_tokenizer(tokenizer_dir, tmp)
        opt_state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        state = {"step": step, "optimizer": opt_state, "rng": rng_state(), **extra}
        with FolderWriter(tmp, replace_weights=False) as w:
            w.write(STATE, lambda f: torch.save(state, f))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_folder(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back; the older checkpoints are untouched
        raise
    atomic_write_text(out / "latest", final.name + "\n")
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    f = out / "latest"
    if not f.exists():
        return None
    p = out / "checkpoints" / f.read_text().strip()
    if not (p / STATE).exists():
        raise FileNotFoundError(f"{f} names {p}, which has no {STATE}")
    return p
