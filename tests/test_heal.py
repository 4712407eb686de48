"""`mtp heal`: base -> fine-tune that drops mtp.* -> graft + self-distillation -> acceptance recovers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mtp import MissingMTPWarning, load_model
from mtp.data.build import build_dataset
from mtp.io import read_tensors
from mtp.io.safetensors_mmap import CheckpointError
from mtp.train.heal import graft, heal
from mtp.train.trainer import train
from test_train import MODEL, cfg


def other_corpus(root: Path) -> Path:
    """Code of another shape than test_data's corpus: the fine-tune moves the backbone away from the base."""
    rng = random.Random(5)
    src = root / "corpus2"
    src.mkdir(parents=True)
    for i in range(40):
        lines = []
        for _ in range(5):
            c, a = rng.choice(["Node", "Tree", "Graph", "Edge"]), rng.choice(["left", "right", "weight", "label"])
            lines += [f"class {c}{i % 5}:", "    def __init__(self, x):", f"        self.{a} = x", f"        self.{a}s = [x]", ""]
        (src / f"c_{i:03d}.py").write_text("\n".join(lines))
    return src


def drop_mtp(src: Path, dst: Path) -> None:
    """What a transformers fine-tune saves: no mtp.* tensors (config unchanged), plus a vision tensor to keep."""
    dst.mkdir(parents=True)
    t = read_tensors(src)
    state = {k: f.tensor(n).clone() for k, (f, n) in t.items() if not k.startswith("mtp.")}
    state["model.visual.patch_embed.weight"] = torch.arange(6.0).reshape(2, 3)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_data import build_toy

    root = tmp_path_factory.mktemp("heal")
    data = build_toy(root)
    train(cfg(data, root / "base", max_steps=30, eval_every=30, save_every=30))
    data2 = root / "data2"
    build_dataset([other_corpus(root)], data2, val_fraction=0.15, tokenizer_from=data, progress=False, quiet=True)
    train(cfg(data2, root / "ft", mode="finetune", init=str(root / "base" / "model"), model={}, mtp_depth=0,
              max_steps=25, lr=1e-2, warmup_steps=1, eval_every=25, save_every=25))
    drop_mtp(root / "ft" / "model", root / "ft_nomtp")
    return root, data2


def test_graft_preserves_files_and_heals_acceptance(setup):
    root, data2 = setup
    ft = root / "ft_nomtp"
    with pytest.warns(MissingMTPWarning):
        assert not load_model(ft).has_mtp
    report = heal(root / "base" / "model", ft, root / "healed", train=True, data=data2, steps=30, lr=1e-2, seq_len=32,
                  micro_batch=4, eval_seqs=16, threads=1, progress=False)
    out = root / "healed"
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["weight_map"]["model.visual.patch_embed.weight"] == "model-00001-of-00002.safetensors"
    # the fine-tune's tensor file is carried byte for byte (vision tensors included)
    assert (out / "model-00001-of-00002.safetensors").read_bytes() == (ft / "model.safetensors").read_bytes()
    healed = load_model(out)
    assert healed.has_mtp
    fin = read_tensors(ft)
    for k, (f, n) in read_tensors(out).items():
        if not k.startswith("mtp."):
            assert torch.equal(f.tensor(n), fin[k][0].tensor(fin[k][1])), k     # backbone untouched
    print(report)
    assert report["grafted_tensors"] == len([k for k in read_tensors(root / "base" / "model") if k.startswith("mtp.")])
    assert report["healed"]["accept_1"] > report["grafted"]["accept_1"] + 0.05


def test_graft_only_equals_base_mtp(setup, tmp_path):
    root, _ = setup
    names = graft(root / "base" / "model", root / "ft_nomtp", tmp_path / "g")
    base = read_tensors(root / "base" / "model")
    got = read_tensors(tmp_path / "g")
    assert names and all(torch.equal(got[k][0].tensor(got[k][1]), base[k][0].tensor(base[k][1])) for k in names)
    from mtp.cli import main

    assert main(["heal", "--base", str(root / "base" / "model"), "--finetuned", str(root / "ft_nomtp"),
                 "--out", str(tmp_path / "cli")]) == 0
    assert load_model(tmp_path / "cli").has_mtp


def test_graft_errors(setup, tmp_path):
    root, data2 = setup
    with pytest.raises(CheckpointError, match="holds no MTP tensors"):
        graft(root / "ft_nomtp", root / "ft_nomtp", tmp_path / "x")
    with pytest.raises(CheckpointError, match="already holds MTP tensors"):
        graft(root / "base" / "model", root / "ft" / "model", tmp_path / "x")
    other = tmp_path / "wide"
    train(cfg(data2, other, model={**MODEL, "hidden_size": 48}, max_steps=1, eval_every=1, save_every=1))
    with pytest.raises(CheckpointError, match="mtp.fc.weight.*shape"):
        graft(other / "model", root / "ft_nomtp", tmp_path / "x")
    with pytest.raises(ValueError, match="--data"):
        heal(root / "base" / "model", root / "ft_nomtp", tmp_path / "y", train=True)
