"""Checkpoint I/O: layouts, sharding, dtypes, bit-exact round trips, and every bad-checkpoint message."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp
from conftest import tiny_model
from mtp.io import read_tensors


def states_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("tied", [True, False])
def test_load_save_load_is_bit_exact_including_mtp(tmp_path, tied):
    m = tiny_model(tie_word_embeddings=tied, mtp_num_hidden_layers=2)
    mtp.save_model(m, tmp_path / "a")
    a = mtp.load_model(tmp_path / "a")
    assert a.has_mtp and any(k.startswith("mtp.layers.1.") for k in a.state_dict())
    mtp.save_model(a, tmp_path / "b")
    b = mtp.load_model(tmp_path / "b")
    states_equal(m, a)
    states_equal(a, b)
    assert load_file(tmp_path / "a" / "model.safetensors").keys() == load_file(tmp_path / "b" / "model.safetensors").keys()
    assert ("lm_head.weight" in load_file(tmp_path / "a" / "model.safetensors")) == (not tied)


def test_sharded_round_trip(tmp_path):
    m = tiny_model()
    mtp.save_model(m, tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    states_equal(m, mtp.load_model(tmp_path))


def test_multimodal_layout_loads_and_ignores_visual(tmp_path):
    m = tiny_model()
    state = {("model.language_model." + k[6:] if k.startswith("model.") else k): v.contiguous()
             for k, v in m.state_dict().items() if k != "lm_head.weight"}
    state["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "model.safetensors")
    cfg = {k: v for k, v in m.config.to_hf_dict().items() if k != "architectures"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": cfg,
                                                      "vision_config": {"depth": 1}}))
    loaded = mtp.load_model(tmp_path)
    states_equal(m, loaded)
    assert loaded.config.outer is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "float32"])
def test_dtype_choice(tmp_path, dtype):
    mtp.save_model(tiny_model(), tmp_path)
    m = mtp.load_model(tmp_path, dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else torch.float32
    assert all(p.dtype == want for p in m.parameters())
    m(torch.tensor([[1, 2, 3]]))  # runs


def test_saving_in_bf16(tmp_path):
    mtp.save_model(tiny_model(), tmp_path, dtype="bf16")
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "model.safetensors").values())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def rewrite(path, fn):
    state = load_file(path / "model.safetensors")
    fn(state)
    save_file(state, path / "model.safetensors")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.layers.0.linear_attn.A_log"), r"missing tensor\(s\) model.layers.0.linear_attn.A_log"),
    (lambda s: s.update({"model.layers.0.bogus.weight": torch.zeros(2)}), "unexpected tensor 'model.layers.0.bogus.weight'"),
    (lambda s: s.update({"mtp.fc.weight": torch.zeros(32, 32)}), r"'mtp.fc.weight' has shape \[32, 32\], expected \[32, 64\]"),
    (lambda s: s.update({"model.norm.weight": torch.zeros(32, dtype=torch.int32)}), "'model.norm.weight' has dtype torch.int32"),
])
def test_bad_tensors_are_named(tmp_path, edit, message):
    mtp.save_model(tiny_model(), tmp_path)
    rewrite(tmp_path, edit)
    with pytest.raises(mtp.CheckpointError, match=message):
        mtp.load_model(tmp_path)


def test_truncated_and_corrupt_files_are_named(tmp_path):
    mtp.save_model(tiny_model(), tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(mtp.CheckpointError, match=r"model.safetensors: truncated: tensor '.*'"):
        mtp.load_model(tmp_path)
    f.write_bytes(data[:4])
    with pytest.raises(mtp.CheckpointError, match="model.safetensors: truncated or corrupt"):
        mtp.load_model(tmp_path)
    f.write_bytes(len(b"garbage!").to_bytes(8, "little") + b"garbage!" + data[8:])
    with pytest.raises(mtp.CheckpointError, match="corrupt safetensors header"):
        mtp.load_model(tmp_path)
    f.unlink()
    with pytest.raises(mtp.CheckpointError, match="no model.safetensors"):
        mtp.load_model(tmp_path)


def test_missing_shard_is_named(tmp_path):
    mtp.save_model(tiny_model(), tmp_path, max_shard_size=20_000)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(mtp.CheckpointError, match="do not exist: model-00002-of-"):
        mtp.load_model(tmp_path)


def test_checkpoint_without_mtp_warns_and_reports_no_mtp(tmp_path):
    mtp.save_model(tiny_model(), tmp_path)
    rewrite(tmp_path, lambda s: [s.pop(k) for k in [k for k in s if k.startswith("mtp.")]])
    with pytest.warns(mtp.MissingMTPWarning, match="no MTP tensors \\(mtp\\.\\*"):
        m = mtp.load_model(tmp_path)
    assert not m.has_mtp and m.mtp is None
    with pytest.raises(RuntimeError, match="no MTP module"):
        m.mtp_logits(torch.tensor([[1, 2, 3]]))
    ids = [1, 2, 3, 4]
    with pytest.warns(UserWarning, match="falling back to plain decoding"):
        r = mtp.generate(m, ids, max_new_tokens=5, draft_tokens=3)
    assert r.tokens == mtp.generate(m, ids, max_new_tokens=5).tokens


def test_memory_mapped_loading_is_lazy(tmp_path):
    mtp.save_model(tiny_model(), tmp_path)
    tensors = read_tensors(tmp_path)
    st, key = tensors["model.embed_tokens.weight"]
    t = st.tensor(key)
    assert t.untyped_storage().data_ptr() != 0 and st.shape(key) == (64, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # copy-on-write mapping: no non-writable-buffer warning
        st.tensor(key).add_(1)


LOAD_IMPORTS = """
import sys
import mtp
for path, quantize in zip(sys.argv[1::2], sys.argv[2::2]):
    mtp.load_model(path, **({} if quantize == "-" else dict(dtype="bfloat16", quantize=quantize)))
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_a_load_does_not_import_torch_dynamo(tmp_path):
    """Initializers and elementwise ops on the meta device run torch's Python references, whose first call imports
    torch._dynamo (1.1 s, more than the rest of loading the shipped model): a model built for a checkpoint runs none
    (budget.MetaFills, the DeltaNet's A_log). A fresh process, as a user's command is."""
    import subprocess
    import sys

    from mtp.cli_common import DEFAULT_MODEL

    mtp.save_model(tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              shared_expert_intermediate_size=16), tmp_path)
    r = subprocess.run([sys.executable, "-c", LOAD_IMPORTS, str(DEFAULT_MODEL), "-", str(DEFAULT_MODEL), "int4",
                        str(tmp_path), "-", str(tmp_path), "int8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
