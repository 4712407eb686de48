"""transformers' own MTP as a second reference and a peer, for the families it covers that we load (DeepSeek-V3,
GLM-4.5/4.6): `transformers.modeling_layers.MtpModel` (the MTP layer as transformers assembles it from the same
checkpoint) gives the same depth-1 logits as ours at every position, and `generate(use_mtp=True)` (its lossless MTP
decoding) gives the greedy output ours gives.

transformers' loader finds the MTP tensors by the real models' layer index (`model.layers.61` for DeepSeek-V3,
`model.layers.46` / `model.layers.92` for GLM-4.5-Air / GLM-4.5 and 4.6), so the checkpoints here have those depths
at tiny widths. Its MTP reads the embedding and head of the main model, not the MTP layer's copies
(`embed_tokens` / `shared_head.head`, equal to them in the released checkpoints): the copies here are equal too."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp
from conftest import assert_greedy_agrees
from test_families import FAMILIES, Family, build_reference

transformers = pytest.importorskip("transformers")
modeling_layers = pytest.importorskip("transformers.modeling_layers")
if not hasattr(modeling_layers, "MtpModel"):
    pytest.skip("this transformers has no MtpModel", allow_module_level=True)

# our test family -> the layer count of the released model whose MTP index transformers knows
DEPTHS = {"deepseek_v3": 61, "glm4_moe": 46, "glm4_moe-shared-head": 92}


def quiet(fn, *args, **kw):
    """transformers' loading reports the MTP tensors the main model does not use and MtpModel's tied tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def build(name: str, path):
    fam = FAMILIES[name]
    L = DEPTHS[name]
    fam = Family(fam.model_type, fam.hf_config, fam.hf_model, {**fam.kw, "num_hidden_layers": L}, fam.mtp_copies, fam.ours)
    quiet(build_reference, fam, path)
    f = path / "model.safetensors"
    state = load_file(f)
    if fam.mtp_copies:  # as released: the MTP layer's copies are the main model's embedding and head
        state[f"model.layers.{L}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        state[f"model.layers.{L}.shared_head.head.weight"] = state["lm_head.weight"].clone()
        save_file(state, f, metadata={"format": "pt"})
    hf = quiet(getattr(transformers, fam.hf_model).from_pretrained, path, dtype=torch.float32).eval()
    return hf, quiet(modeling_layers.MtpModel.from_pretrained, hf).eval(), quiet(mtp.load_model, path)


@pytest.fixture(scope="module", params=list(DEPTHS))
def peers(request, tmp_path_factory):
    return (request.param, *build(request.param, tmp_path_factory.mktemp(request.param.replace("-", "_"))))


def mtp_model_logits(hf, mtp_model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' depth-1 MTP logits [B, T-1, V] with teacher forcing: position i reads the main model's last
    hidden state at i and the token at i + 1 (at position i + 1, as its `generate` passes them)."""
    h = hf(ids, output_hidden_states=True).hidden_states[-1]
    B, T = ids.shape
    pos = torch.arange(1, T)[None].expand(B, -1)
    return mtp_model._project_to_logits(mtp_model.forward_layer(0, h[:, :-1], pos, None, input_ids=ids[:, 1:]))


@torch.no_grad()
def test_mtp_logits_equal_transformers_mtp_model(peers):
    name, hf, mtp_model, ours = peers
    assert mtp_model.num_mtp_layers == ours.mtp.num_layers == 1
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    want = mtp_model_logits(hf, mtp_model, ids)
    got = ours.mtp_logits(ids, 1)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # measured: 1.2e-6 (DeepSeek-V3), 1.1e-6 / 1.3e-6 (GLM, 46 / 92 layers)


@torch.no_grad()
def test_transformers_reads_the_checkpoint_we_save(peers, tmp_path):
    """Our save keeps the checkpoint's own MTP names: transformers' MtpModel loads them and agrees."""
    name, hf, _, ours = peers
    mtp.save_model(ours, tmp_path)
    hf2 = quiet(type(hf).from_pretrained, tmp_path, dtype=torch.float32).eval()
    mtp_model = quiet(modeling_layers.MtpModel.from_pretrained, hf2).eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours.mtp_logits(ids, 1)[0], mtp_model_logits(hf2, mtp_model, ids), atol=1e-4, rtol=0)


@torch.no_grad()
def test_greedy_use_mtp_generate_agrees_with_ours(peers):
    """transformers' `generate(use_mtp=True)` is lossless (= its plain greedy) and gives what ours gives, plain and
    speculative (equal up to a near-tie: two implementations round differently)."""
    name, hf, _, ours = peers
    n = 7
    prompt = torch.randint(0, ours.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))
    plain = hf.generate(prompt, max_new_tokens=14, do_sample=False)[0, n:].tolist()
    theirs = quiet(hf.generate, prompt, max_new_tokens=14, do_sample=False, use_mtp=True)[0, n:].tolist()
    assert theirs == plain
    want = mtp.generate(ours, prompt[0].tolist(), max_new_tokens=14).tokens
    for k in (1, "auto"):
        assert mtp.generate(ours, prompt[0].tolist(), max_new_tokens=14, draft_tokens=k).tokens == want, k
    assert_greedy_agrees(ours, prompt[0].tolist(), want, theirs)


def test_bench_measures_transformers_use_mtp_and_checks_it(tmp_path, capsys):
    """`mtp bench` adds transformers' `generate(use_mtp=True)` as a configuration where the family has it, its
    output checked equal to transformers' plain greedy (and the family without it gets a note instead)."""
    from mtp.cli import main
    from test_bench import byte_tokenizer

    fam = FAMILIES["deepseek_v3"]
    path = tmp_path / "model"
    path.mkdir()
    build_reference(Family(fam.model_type, fam.hf_config, fam.hf_model, {**fam.kw, "vocab_size": 300, "num_hidden_layers": 61}),
                    path)
    state = load_file(path / "model.safetensors")
    state["model.layers.61.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.61.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    byte_tokenizer(300).save(str(path / "tokenizer.json"))
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(path), "--quick", "--out", str(out), "--threads", "1", "--no-cost-model",
               "--draft-tokens", "1", "--max-new-tokens", "10", "--max-prompts", "1", "--repeats", "1", "--no-profile"])
    report = __import__("json").loads((out / "report.json").read_text())
    assert rc == 0 and report["identical_outputs"] and report["failed"] == {}, report["mismatches"]
    code = report["summary"]["code"]
    assert {"mtp plain", "mtp k=1", "transformers", "transformers use_mtp"} <= set(code)
    assert code["transformers use_mtp"]["new_tokens"] == 10 and code["transformers use_mtp"]["engine"] == "transformers"
    assert "checked equal to its plain generate" in report["meta"]["notes"]["transformers use_mtp"]
    assert "transformers use_mtp" in capsys.readouterr().out
