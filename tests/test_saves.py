"""Saves never cost the previous checkpoint: every file is staged and fsynced, renamed into place, and only then are the
old weight files the new checkpoint does not use removed. A full disk (simulated: writes raise OSError ENOSPC once a
byte budget is spent, in the middle of a file) leaves the folder byte for byte as it was, for `save_model`, `mtp heal`
and `mtp train` (one line, the previous checkpoint intact)."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open

import mtp
import mtp.io.files
from conftest import tiny_model
from mtp.io.files import FolderWriter, write_safetensors


def snapshot(path) -> dict[str, str]:
    """Every file under `path` (hidden ones too) -> its sha256."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


class FullDisk:
    """A binary file whose writes fail with ENOSPC once `budget` bytes (shared by every file opened) are written; the
    write that crosses the budget writes what fits first, as a real disk does."""

    def __init__(self, f, budget: list[int]):
        self.f, self.budget = f, budget

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.budget[0]:
            self.f.write(data[: self.budget[0]])
            self.budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget[0] -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_disk(monkeypatch, free: int) -> None:
    """From now on, `io/files.py` writes see a disk with `free` bytes left."""
    budget = [free]
    real = open

    def full_open(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        return FullDisk(f, budget) if "w" in mode else f

    monkeypatch.setattr(mtp.io.files, "open", full_open, raising=False)


def states_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("old_shards, new_shards", [(None, None), (None, 20_000), (20_000, None), (20_000, 30_000)])
@pytest.mark.parametrize("free", [0, 100, 50_000])
def test_a_full_disk_leaves_the_previous_checkpoint_as_it_was(tmp_path, monkeypatch, old_shards, new_shards, free):
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    mtp.save_model(old, tmp_path, max_shard_size=old_shards)
    before = snapshot(tmp_path)
    with monkeypatch.context() as m:
        fill_disk(m, free)
        with pytest.raises(OSError) as e:
            mtp.save_model(new, tmp_path, max_shard_size=new_shards)
    assert e.value.errno == errno.ENOSPC and str(tmp_path) in e.value.filename  # names the file it could not write
    assert snapshot(tmp_path) == before  # no temporary left, nothing replaced, nothing removed
    assert states_equal(mtp.load_model(tmp_path), old)
    mtp.save_model(new, tmp_path, max_shard_size=new_shards)  # space again: the new one replaces it whole
    assert states_equal(mtp.load_model(tmp_path), new)
    weights = {p.name for p in tmp_path.glob("model*")}
    if new_shards is None:
        assert weights == {"model.safetensors"}  # the old shards and index are gone
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert weights == set(index["weight_map"].values()) | {"model.safetensors.index.json"}
    assert not list(tmp_path.glob(".*.tmp"))


def test_files_are_fsynced_before_they_are_renamed(tmp_path, monkeypatch):
    """The order a crash-safe save needs: each file's data, then the renames, then the folder; old files last."""
    events = []
    real_fsync, real_replace, real_unlink = os.fsync, os.replace, os.unlink
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"rename {os.path.basename(b)}"), real_replace(a, b))[1])
    (tmp_path / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    with FolderWriter(tmp_path) as w:
        w.write_text("a.json", "{}")
        w.write("model.safetensors", lambda f: write_safetensors(f, {"x": torch.ones(3)}))
        monkeypatch.setattr(os, "unlink", lambda p: (events.append("unlink"), real_unlink(p))[1])
    assert events == ["fsync", "fsync", "rename a.json", "rename model.safetensors", "fsync", "unlink"]
    assert not (tmp_path / "model-00001-of-00009.safetensors").exists()


def test_our_safetensors_writer_reads_back_in_safe_open(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5).to(torch.bfloat16), "c": torch.tensor(1.5).half(),
               "empty": torch.zeros(0, 2), "flag": torch.tensor([True, False])}
    with FolderWriter(tmp_path) as w:
        w.write("model.safetensors", lambda f: write_safetensors(f, tensors, {"format": "pt"}))
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for k, t in tensors.items():
            assert torch.equal(f.get_tensor(k), t) and f.get_tensor(k).dtype == t.dtype, k


def test_heal_on_a_full_disk_leaves_the_output_folder_as_it_was(tmp_path, monkeypatch):
    from mtp.train.cli import cmd_heal
    from serve_support import build_model_dir
    from test_heal import drop_mtp

    base = build_model_dir(tmp_path / "base", chat_template=False)
    fine = tmp_path / "fine"
    drop_mtp(base, fine)
    out = tmp_path / "out"
    mtp.save_model(tiny_model(seed=3), out)  # an earlier result in the output folder
    before = snapshot(out)
    args = type("Args", (), dict(base=base, finetuned=fine, out=out, train=False, data=None, steps=1, lr=1e-3, seq_len=8,
                                 micro_batch=1, eval_seqs=1, threads=1, seed=0, device="cpu"))
    with monkeypatch.context() as m:
        fill_disk(m, 1000)
        with pytest.raises(SystemExit) as e:
            cmd_heal(args)
    assert str(e.value).startswith("mtp heal: error: cannot write ") and "No space left on device" in str(e.value)
    assert "\n" not in str(e.value) and snapshot(out) == before
    cmd_heal(args)
    assert mtp.load_model(out).has_mtp


def test_mtp_train_on_a_full_disk_prints_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    from mtp.cli import main
    from mtp.train import trainer
    from test_data import build_toy
    from test_train import MODEL

    data = build_toy(tmp_path / "data")
    out = tmp_path / "run"
    real_save, saves = trainer.save, []

    def save_then_fill(run):  # the disk fills up after the first checkpoint (step 2)
        if saves:
            fill_disk(monkeypatch, 5000)
        saves.append(run.step)
        real_save(run)

    monkeypatch.setattr(trainer, "save", save_then_fill)
    argv = ["train", "--preset", "tiny", f"data={data}", f"out={out}", f"model={json.dumps(MODEL)}", "seq_len=32",
            "max_steps=4", "save_every=2", "eval_every=2", "eval_seqs=4", "eval_batch=4", "progress=false", "threads=1"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    message = str(e.value)
    assert message.startswith("mtp train: error: cannot write ") and ".step-000004.tmp" in message, message
    assert "No space left on device" in message and "\n" not in message
    assert saves == [2, 4] and (out / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]  # the failed one cleaned up
    assert mtp.load_model(out / "checkpoints" / "step-000002").has_mtp
    monkeypatch.undo()
    assert main(argv) == 0  # space again: resumes from step 2 and finishes
    assert (out / "latest").read_text().strip() == "step-000004"
