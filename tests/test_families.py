"""DeepSeek-V3/R1, GLM-4.5/4.6 and MiMo-7B: backbone parity with transformers (prefill and cached), the MTP layer
against its equations, round trips that keep every tensor name, lossless speculative decoding on briefly trained
models, training through `mtp.train`, configs, bench shapes and bad input.

The reference checkpoints are written by transformers: a model with one layer more than the backbone is saved, so
its last decoder layer (in transformers' own names and per-expert layout) becomes the MTP layer's decoder layer; the
MTP-only tensors (enorm, hnorm, eh_proj, shared_head.* / MiMo's token_layernorm, ...) are added under the
checkpoint's names, and config.json says the backbone's layer count. The same folder is a complete checkpoint for
mtp and a loadable one for transformers (which ignores the MTP tensors)."""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import mtp
from conftest import pattern_batch, scripted_drafts_patterns
from mtp.config import ConfigError, DeepseekV3Config, Glm4MoeConfig, MiMoConfig
from mtp.io import read_tensors
from mtp.model import config_from_dict
from mtp.model.families import model_class_for


def hf_transformers():
    """transformers, for the tests that compare with it (the module's other tests run without it)."""
    return pytest.importorskip("transformers")


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=256)
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5, num_nextn_predict_layers=1)
# mscale_all_dim != mscale: both YaRN's cos/sin factor and the softmax mscale differ from 1.
YARN = {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.7, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)
GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True,
           partial_rotary_factor=0.5)


@dataclass
class Family:
    model_type: str
    hf_config: str  # transformers' classes of the reference
    hf_model: str
    kw: dict  # config keys (transformers' names)
    mtp_copies: bool = True  # the MTP layer holds embed_tokens / shared_head.head (not GLM-4.6, not MiMo)
    ours: dict = field(default_factory=dict)  # extra keys of our config (MiMo's MTP count)

    @property
    def mimo(self) -> bool:
        return self.model_type == "mimo"


FAMILIES = {
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                          {**TINY, **MOE, **MLA, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "rope_theta": 10000.0,
                           "rope_scaling": YARN}),
    "deepseek_v3-q_proj": Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                                 {**TINY, **MOE, **MLA, "q_lora_rank": None, "rope_interleave": False, "attention_bias": True,
                                  "n_group": 2, "topk_group": 1, "rope_theta": 5000.0}),
    "glm4_moe": Family("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", {**TINY, **MOE, **GQA, "rope_theta": 10000.0}),
    "glm4_moe-shared-head": Family("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
                                   {**TINY, **MOE, **GQA, "rope_theta": 10000.0}, mtp_copies=False,
                                   ours={"mtp_embed_tokens": False, "mtp_shared_head": False}),
    "mimo": Family("mimo", "Qwen2Config", "Qwen2ForCausalLM",
                   {**TINY, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "rope_theta": 640000.0}, mtp_copies=False, ours={"num_nextn_predict_layers": 1}),
}
MAIN = ["deepseek_v3", "glm4_moe-shared-head", "mimo"]  # one variant per family for the slower tests


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm (DeepSeek-V3, GLM, Qwen2): w * x / rms(x)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def mtp_prefix(fam: Family, layers: int) -> str:
    return "model.mtp_layers.0." if fam.mimo else f"model.layers.{layers}."


def mtp_only_tensors(fam: Family, H: int, V: int) -> dict[str, tuple[int, ...]]:
    """The MTP layer's tensors beyond its decoder layer, under the checkpoint's names (docs/families.md)."""
    if fam.mimo:
        return {"token_layernorm.weight": (H,), "hidden_layernorm.weight": (H,), "input_proj.weight": (H, 2 * H),
                "final_layernorm.weight": (H,)}
    names = {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H), "shared_head.norm.weight": (H,)}
    if fam.mtp_copies:
        names |= {"shared_head.head.weight": (V, H), "embed_tokens.weight": (V, H)}
    return names


@dataclass
class Reference:
    path: object
    hf: object  # transformers' backbone, loaded from `path`
    mtp_layer: object  # transformers' decoder layer holding the MTP layer's decoder weights
    rotary: object  # transformers' rotary embedding module
    config: object  # transformers' config of the backbone


def build_reference(fam: Family, path, seed: int = 0) -> Reference:
    L = fam.kw["num_hidden_layers"]
    transformers = hf_transformers()
    hf_cfg_cls, hf_cls = getattr(transformers, fam.hf_config), getattr(transformers, fam.hf_model)
    torch.manual_seed(seed)
    big = hf_cls(hf_cfg_cls(**{**fam.kw, "num_hidden_layers": L + 1})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers initialises norms to 1 and the router bias to 0: randomise so nothing hides
        for n, p in big.named_parameters():
            p.copy_(("norm" in n) + 0.2 * torch.randn(p.shape, generator=g))
        for n, b in big.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))  # non-zero: it must choose, never weight
    big.save_pretrained(path / "big")
    state = load_file(path / "big" / "model.safetensors")
    prefix = mtp_prefix(fam, L)
    if fam.mimo:
        state = {(prefix + k[len(f"model.layers.{L}."):] if k.startswith(f"model.layers.{L}.") else k): v
                 for k, v in state.items()}
    H, V = fam.kw["hidden_size"], fam.kw["vocab_size"]
    for name, shape in mtp_only_tensors(fam, H, V).items():
        state[prefix + name] = ("norm" in name) + 0.2 * torch.randn(shape, generator=g)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "big" / "config.json").read_text())
    cfg["num_hidden_layers"] = L
    if fam.mimo:
        cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], **fam.ours)
    (path / "config.json").write_text(json.dumps(cfg))
    shutil.rmtree(path / "big")
    backbone_cfg = hf_cfg_cls(**fam.kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = hf_cls.from_pretrained(path, config=backbone_cfg, dtype=torch.float32).eval()
    return Reference(path, hf, big.model.layers[L], big.model.rotary_emb, backbone_cfg)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    built: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in built:
            built[name] = build_reference(FAMILIES[name], tmp_path_factory.mktemp(name.replace("-", "_")))
        return built[name]

    return get


def load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", mtp.MissingMTPWarning)
        return mtp.load_model(path, **kw)


def names(path) -> set[str]:
    with read_tensors(path) as t:
        return set(t)


# ---------------------------------------------------------------------- backbone parity
@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_backbone_logits_match_transformers_prefill_and_cached(reference, name):
    ref = reference(name)
    ours = load(ref.path)
    assert type(ours).__name__ == {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                                   "mimo": "MiMoForCausalLM"}[FAMILIES[name].model_type] and ours.has_mtp
    ids = torch.randint(0, 64, (2, 90), generator=torch.Generator().manual_seed(1))  # past YaRN's original 64
    want = ref.hf(ids).logits
    torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
    cache = ours.new_cache(2, 128)
    cached = torch.cat([ours(ids[:, :70], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(70, 90)], 1)
    torch.testing.assert_close(cached, want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- the MTP layer, written out
@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_mtp_logits_follow_the_equations(reference, name):
    """Depths 1 and 2 by hand: the concat order, the norms, the hidden state the MTP reads (DeepSeek/GLM: after the
    backbone's final norm; MiMo: before it) and the one chained depths feed back (after the MTP layer's own final
    norm). The inner decoder layer is transformers' (it holds the MTP layer's decoder weights)."""
    fam, ref = FAMILIES[name], reference(name)
    ours = load(ref.path)
    L, eps = fam.kw["num_hidden_layers"], ref.config.rms_norm_eps
    with read_tensors(ref.path) as t:
        sd = {k: t.tensor(k).clone() for k in t}
    p = mtp_prefix(fam, L)
    ids = torch.randint(0, 64, (1, 14), generator=torch.Generator().manual_seed(2))
    T = ids.shape[1]
    if fam.mimo:  # h_i BEFORE the final norm: the decoder layers run by hand
        h = ref.hf.model.embed_tokens(ids)
        pe = ref.hf.model.rotary_emb(h, torch.arange(T)[None])
        for layer in ref.hf.model.layers:
            h = layer(h, attention_mask=None, position_embeddings=pe)
        torch.testing.assert_close(ref.hf.lm_head(ref.hf.model.norm(h)), ref.hf(ids).logits, atol=1e-5, rtol=0)
    else:  # h_i AFTER the final norm
        h = ref.hf.model(ids).last_hidden_state
    embed = sd[p + "embed_tokens.weight"] if fam.mtp_copies else sd["model.embed_tokens.weight"]
    head = sd[p + "shared_head.head.weight"] if fam.mtp_copies else sd["lm_head.weight"]
    got = ours.mtp_logits(ids, 2)
    prev = h[0]
    for d in (1, 2):
        n = T - d
        e = embed[ids[0, d:]]  # the token d ahead of each position (not zeroed at position 0)
        if fam.mimo:  # hidden FIRST
            x = torch.cat([rms(prev[:n], sd[p + "hidden_layernorm.weight"], eps),
                           rms(e, sd[p + "token_layernorm.weight"], eps)], -1) @ sd[p + "input_proj.weight"].T
        else:  # embedding first
            x = torch.cat([rms(e, sd[p + "enorm.weight"], eps), rms(prev[:n], sd[p + "hnorm.weight"], eps)], -1) \
                @ sd[p + "eh_proj.weight"].T
        pe = ref.rotary(x[None], torch.arange(n)[None])  # the MTP slot i sits at the position of h_i
        out = ref.mtp_layer(x[None], attention_mask=None, position_embeddings=pe)[0]
        prev = rms(out, sd[p + ("final_layernorm.weight" if fam.mimo else "shared_head.norm.weight")], eps)
        torch.testing.assert_close(got[d - 1][0], prev @ head.T, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_saved_checkpoint_keeps_every_name_and_loads_in_transformers(reference, name, tmp_path):
    fam, ref = FAMILIES[name], reference(name)
    ours = load(ref.path)
    mtp.save_model(ours, tmp_path)
    before, after = names(ref.path), names(tmp_path)
    assert after == before
    mtp_names = {k for k in before if type(ours).is_mtp_tensor(k, ours.config)}
    L = fam.kw["num_hidden_layers"]
    assert {mtp_prefix(fam, L) + k for k in mtp_only_tensors(fam, 32, 64)} < mtp_names
    if not fam.mimo:
        assert mtp_prefix(fam, L) + "mlp.experts.7.down_proj.weight" in mtp_names  # per expert, as transformers writes
        assert mtp_prefix(fam, L) + "mlp.gate.e_score_correction_bias" in mtp_names
    assert ("embed_tokens.weight" in {k.removeprefix(mtp_prefix(fam, L)) for k in mtp_names}) == fam.mtp_copies
    written = json.loads((tmp_path / "config.json").read_text())
    assert not {"mtp_embed_tokens", "mtp_shared_head"} & set(written)  # read from the tensors, never written
    hf_cls = getattr(hf_transformers(), fam.hf_model)
    with warnings.catch_warnings():  # transformers reads our config.json (MiMo's model_type it does not know)
        warnings.simplefilter("ignore")
        hf2 = hf_cls.from_pretrained(tmp_path, config=ref.config if fam.mimo else None, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(hf2(ids).logits, ref.hf(ids).logits, atol=1e-5, rtol=0)
    again = load(tmp_path)
    torch.testing.assert_close(again.mtp_logits(ids, 2)[1], ours.mtp_logits(ids, 2)[1], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
@torch.no_grad()
def test_router_stays_fp32_in_a_bf16_model(reference, name, tmp_path):
    ref = reference(name)
    ours = load(ref.path, dtype="bfloat16")
    params = dict(ours.named_parameters()) | dict(ours.named_buffers())
    router = {k for k in params if ".mlp.gate." in k}
    assert router and all(params[k].dtype == torch.float32 for k in router)
    assert ours.dtype == torch.bfloat16 and params["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    mtp.save_model(ours, tmp_path)
    with read_tensors(tmp_path) as t:
        dtypes = {k: t[k][0].dtype(k) for k in t}
    assert {k for k, dt in dtypes.items() if dt == torch.float32} == {k for k in dtypes if ".mlp.gate." in k}
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(4))
    assert torch.isfinite(ours.mtp_logits(ids)[0]).all()


def tiny_config(name: str, **over):
    """Our config of a family's tiny shape (the reference's keys, through `config_from_dict`)."""
    fam = FAMILIES[name]
    return config_from_dict({"model_type": fam.model_type, **fam.kw, **fam.ours, **over})


def tiny(name: str, seed: int = 0, std: float = 0.2, **over):
    config = tiny_config(name, **over)
    model = model_class_for(config)(config)
    mtp.model.init_weights_(model, std=std, seed=seed)
    return model.eval()


@torch.no_grad()
def test_more_mtp_layers_are_named_in_order_and_reused_cyclically(tmp_path):
    model = tiny("deepseek_v3", seed=1, num_nextn_predict_layers=2)
    mtp.save_model(model, tmp_path)
    keys = names(tmp_path)
    assert "model.layers.4.eh_proj.weight" in keys and not any(k.startswith("model.layers.5.") for k in keys)
    again = load(tmp_path)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    got = again.mtp_logits(ids, 3)
    torch.testing.assert_close(got[2], model.mtp_logits(ids, 3)[2], atol=0, rtol=0)
    assert [again.mtp.layer_for_depth(d) for d in (1, 2, 3, 4)] == [0, 1, 0, 1]


# ---------------------------------------------------------------------- decoding
@pytest.mark.parametrize("name", MAIN)
def test_a_released_bf16_load_decodes_as_the_kept_one(tmp_path, name):
    """A released bf16 load (what the commands load: each weight the model runs packed is packed straight from its
    file pages, checkpoint._StoredPack) gives the greedy tokens of the load that keeps its weights, plain and
    speculative."""
    mtp.save_model(tiny(name, seed=3).to(torch.bfloat16), tmp_path)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    kept, released = mtp.load_model(tmp_path), mtp.load_model(tmp_path, release=True)
    want = mtp.generate(kept, prompt, max_new_tokens=16, eos_token_ids=[]).tokens
    for k in (None, 2):
        assert mtp.generate(released, prompt, max_new_tokens=16, draft_tokens=k, eos_token_ids=[]).tokens == want, k


@pytest.mark.parametrize("name", MAIN)
@torch.no_grad()
def test_cached_mtp_steps_equal_teacher_forcing(name):
    """The drafter's catch-up runs depth 1 in pieces over its KV cache: the same as one teacher-forced pass."""
    model = tiny(name, seed=2)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(9))
    h = model.hidden(ids)
    want = model.mtp_step(1, h[:, :-1], ids[:, 1:], 0)
    caches = model.new_mtp_cache(1, 32)
    got = torch.cat([model.mtp_step(1, h[:, a:b], ids[:, a + 1 : b + 1], a, caches) for a, b in ((0, 7), (7, 8), (8, 19))], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def trained(name: str, steps: int = 80, seed: int = 0, **over):
    """A tiny model of the family whose backbone and MTP were trained together on pattern data for a few seconds."""
    model = tiny(name, seed=seed, std=0.02, vocab_size=8, **over).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = pattern_batch(8, 8, 32, gen)
        h = model.hidden(ids)
        loss = F.cross_entropy(model.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        for d, hd in enumerate(model.mtp_hidden_states(ids, hidden=h), start=1):
            loss = loss + F.cross_entropy(model.mtp_head(hd[:, :-1], d).flatten(0, 1), ids[:, d + 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("name, over", [("deepseek_v3", {"num_nextn_predict_layers": 2}), ("glm4_moe-shared-head", {}),
                                        ("mimo", {})])
def test_greedy_speculative_equals_plain(name, over, monkeypatch):
    model = trained(name, **over)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        prompt = pattern_batch(8, 1, int(torch.randint(2, 16, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(model, prompt, max_new_tokens=24).tokens
        for k in (1, 2, 3, 4, 5, 6, "auto"):
            r = mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k)
            assert r.tokens == want, k
    # every acceptance pattern, forced by scripted drafts (what a trained head produces depends on the CPU)
    assert scripted_drafts_patterns(model, prompt, monkeypatch) == {"none", "some", "all"}


@pytest.mark.parametrize("name, over", [("deepseek_v3", {"num_nextn_predict_layers": 2}), ("glm4_moe-shared-head", {}),
                                        ("mimo", {})])
def test_quantized_drafts_keep_the_output_and_take_the_input_projection(name, over):
    """`--draft-quantize auto`'s int4 drafts (what the command line gives a bf16 model on the CPU): the family's MTP
    input projection (`mtp_input_projection`: eh_proj / input_proj) runs a quantized kernel with the rest of the MTP,
    the backbone does not, and greedy speculative decoding is still the bf16 model's plain decoding."""
    from mtp.model import qmatmul
    from mtp.model.linear import FastLinear

    if not qmatmul.available():
        pytest.skip("quantized drafts run qmatmul's kernels")
    model = trained(name, **over).to(torch.bfloat16)
    model.prepare_for_inference()
    g = torch.Generator().manual_seed(1)
    prompts = [pattern_batch(8, 1, int(torch.randint(2, 16, (1,), generator=g)), g)[0].tolist() for _ in range(3)]
    want = [mtp.generate(model, p, max_new_tokens=24).tokens for p in prompts]
    backbone = {n: m.kernel for n, m in model.model.named_modules() if isinstance(m, FastLinear)}
    model.quantize_drafts("int4")
    projections = [m for n, m in model.mtp.named_modules() if n.endswith(model.mtp_input_projection)]
    assert projections and all(m.kernel in ("int8", "int4") for m in projections)
    assert {n: m.kernel for n, m in model.model.named_modules() if isinstance(m, FastLinear)} == backbone
    for p, w in zip(prompts, want):
        for k in (1, 3, "auto"):
            assert mtp.generate(model, p, max_new_tokens=24, draft_tokens=k).tokens == w, (p, k)


# ---------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_data import build_toy

    return build_toy(tmp_path_factory.mktemp("toy"))


@pytest.mark.parametrize("name", MAIN)
def test_pretrain_heads_and_finetune_through_mtp_train(data, tmp_path, name):
    from mtp.train.trainer import train
    from test_train import cfg, rows

    fam = FAMILIES[name]
    model_keys = {k: v for k, v in {**fam.kw, **fam.ours}.items() if k != "vocab_size"}
    train(cfg(data, tmp_path / "pre", model={"model_type": fam.model_type, **model_keys}, max_steps=2, eval_every=2))
    base = tmp_path / "pre" / "model"
    m = load(base)
    assert type(m.config).model_types[0] == fam.model_type and m.has_mtp
    # heads only: the backbone is bit-identical afterwards, the MTP layer moved
    train(cfg(data, tmp_path / "h", mode="heads", init=str(base), model={}, max_steps=3, lr=1e-2, eval_every=3))
    is_mtp = lambda k: type(m).is_mtp_tensor(k, m.config)  # noqa: E731
    with read_tensors(base) as before, read_tensors(tmp_path / "h" / "model") as after:
        assert set(before) == set(after)
        for k in before:
            if not is_mtp(k):
                assert torch.equal(before.tensor(k), after.tensor(k)), k
        assert any(not torch.equal(before.tensor(k), after.tensor(k)) for k in before if is_mtp(k))
    assert all(len(r["mtp"]) == 1 for r in rows(tmp_path / "h"))
    # finetune keeps every tensor name
    train(cfg(data, tmp_path / "f", mode="finetune", init=str(base), model={}, max_steps=2, eval_every=2))
    assert names(tmp_path / "f" / "model") == names(base)


@pytest.mark.parametrize("name", MAIN)
def test_heal_grafts_the_mtp_layer_back(tmp_path, name):
    from mtp.train.heal import graft

    fam = FAMILIES[name]
    model = tiny(name, seed=6)
    for out in ("base", "ft"):  # config.json as the family's own (no mtp keys): the tensors tell what the MTP holds
        mtp.save_model(model, tmp_path / out)
        cfg = json.loads((tmp_path / out / "config.json").read_text())
        (tmp_path / out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if not k.startswith("mtp_")}))
    f = tmp_path / "ft" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not type(model).is_mtp_tensor(k, model.config)}, f)
    grafted = graft(tmp_path / "base", tmp_path / "ft", tmp_path / "out")
    assert set(grafted) == {k for k in names(tmp_path / "base") if k.startswith(mtp_prefix(fam, fam.kw["num_hidden_layers"]))}
    assert names(tmp_path / "out") == names(tmp_path / "base")
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(load(tmp_path / "out").mtp_logits(ids)[0], model.mtp_logits(ids)[0], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- configs
DEEPSEEK_V3_CONFIG = {  # DeepSeek-V3's config.json, as shipped (older key style: rope_theta + rope_scaling)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "initializer_range": 0.02,
    "rms_norm_eps": 1e-06, "use_cache": True, "bos_token_id": 0, "eos_token_id": 1, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
}
GLM45_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "partial_rotary_factor": 0.5, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1,
    "n_routed_experts": 160, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "use_qk_norm": True, "vocab_size": 151552,
}
MIMO_CONFIG = {
    "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008,
    "max_position_embeddings": 32768, "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 640000, "sliding_window": 32768, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151680,
}


@pytest.mark.parametrize("cls, data", [(DeepseekV3Config, DEEPSEEK_V3_CONFIG), (Glm4MoeConfig, GLM45_CONFIG),
                                       (MiMoConfig, MIMO_CONFIG)])
def test_real_configs_round_trip_keeping_every_key(cls, data, tmp_path):
    cfg = cls.from_hf_dict(data)
    assert cfg.to_hf_dict() == data
    assert cfg.mtp_num_hidden_layers == 1 and cfg.mtp_keys == ("num_nextn_predict_layers",)
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert type(mtp.model.config_from_json(tmp_path / "config.json")) is cls
    cfg.mtp_num_hidden_layers = 0  # what heal / the trainer may set
    assert cfg.to_hf_dict()["num_nextn_predict_layers"] == 0


def test_config_values_transformers_derives():
    ds = DeepseekV3Config.from_hf_dict(DEEPSEEK_V3_CONFIG)
    assert ds.qk_head_dim == 192 and ds.rope()["rope_type"] == "yarn" and ds.rope()["factor"] == 40
    assert ds.is_moe_layer(3) and not ds.is_moe_layer(2) and ds.eos_token_ids == [1]
    glm = Glm4MoeConfig.from_hf_dict(GLM45_CONFIG)
    assert glm.rotary_dim == 64 and glm.eos_token_ids == [151329, 151336, 151338]
    assert MiMoConfig.from_hf_dict(MIMO_CONFIG).head_dim == 128


def test_yarn_table_and_softmax_scale_match_transformers():
    transformers = hf_transformers()
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from mtp.model.mla import MLAttention
    from mtp.model.rope import rotary_table

    hf = transformers.DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "auto_map"})
    inv_freq, factor = _compute_yarn_parameters(hf)
    ours = DeepseekV3Config.from_hf_dict(DEEPSEEK_V3_CONFIG)
    table = rotary_table(ours.rope(), ours.qk_rope_head_dim, ours.max_position_embeddings)
    torch.testing.assert_close(table.inv_freq, inv_freq, atol=0, rtol=0)
    assert table.scale == factor == 1.0  # mscale == mscale_all_dim: cos/sin unscaled
    with torch.device("meta"):
        attn = MLAttention(ours)
    assert attn.scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192**-0.5)) and attn.scale > 192**-0.5


@pytest.mark.parametrize("cls, data, mutate, key", [
    (DeepseekV3Config, DEEPSEEK_V3_CONFIG, dict(n_group=7), "n_group"),
    (DeepseekV3Config, DEEPSEEK_V3_CONFIG, dict(topk_group=9), "topk_group"),
    (DeepseekV3Config, DEEPSEEK_V3_CONFIG, dict(scoring_func="softmax"), "scoring_func"),
    (DeepseekV3Config, DEEPSEEK_V3_CONFIG, dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
    (DeepseekV3Config, DEEPSEEK_V3_CONFIG, dict(rope_scaling={"type": "longrope", "factor": 2}), "rope_scaling.rope_type"),
    (DeepseekV3Config, DEEPSEEK_V3_CONFIG, dict(qk_rope_head_dim=63), "qk_rope_head_dim"),
    (Glm4MoeConfig, GLM45_CONFIG, dict(num_key_value_heads=7), "num_key_value_heads"),
    (Glm4MoeConfig, GLM45_CONFIG, dict(partial_rotary_factor=1.5), "partial_rotary_factor"),
    (MiMoConfig, MIMO_CONFIG, dict(use_sliding_window=True), "use_sliding_window"),
    (MiMoConfig, MIMO_CONFIG, dict(hidden_size=0), "hidden_size"),
])
def test_bad_config_values_name_the_key(cls, data, mutate, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        cls.from_hf_dict({**data, **mutate})


@pytest.mark.parametrize("model_type, what", [("deepseek_v4", "DeepSeek-V4"), ("step3p7", "Step-3.5/3.7"),
                                               ("nemotron_h", "Nemotron-H")])
def test_unfinished_families_are_refused_by_name(tmp_path, model_type, what):
    with pytest.raises(ConfigError, match=f"'{model_type}'.*not supported: {re.escape(what)}.*not implemented"):
        config_from_dict({**DEEPSEEK_V3_CONFIG, "model_type": model_type})
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3_CONFIG, "model_type": model_type}))
    with pytest.raises(ConfigError, match=f"not supported: {re.escape(what)}"):
        mtp.load_model(tmp_path)


# ---------------------------------------------------------------------- bad checkpoints
def copy_reference(ref: Reference, dest):
    shutil.copytree(ref.path, dest)
    return dest


def edit(path, tensors=None, config=None):
    f = path / "model.safetensors"
    if tensors is not None:
        state = load_file(f)
        tensors(state)
        save_file(state, f, metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("name", MAIN)
def test_bad_mtp_tensors_are_named(reference, tmp_path, name):
    fam, ref = FAMILIES[name], reference(name)
    L = fam.kw["num_hidden_layers"]
    p = mtp_prefix(fam, L)
    proj = p + ("input_proj.weight" if fam.mimo else "eh_proj.weight")
    missing = edit(copy_reference(ref, tmp_path / "missing"), tensors=lambda s: s.pop(proj))
    with pytest.raises(mtp.CheckpointError, match=f"missing tensor.*'?{proj}"):
        mtp.load_model(missing)
    two = edit(copy_reference(ref, tmp_path / "two"), config={"num_nextn_predict_layers": 2})
    layer = "model.mtp_layers.0.\\*" if fam.mimo else f"model.layers.{L}.\\*"
    with pytest.raises(mtp.CheckpointError, match=f"'num_nextn_predict_layers' is 2 .*{layer}"):
        mtp.load_model(two)
    zero = edit(copy_reference(ref, tmp_path / "zero"), config={"num_nextn_predict_layers": 0})
    with pytest.raises(mtp.CheckpointError, match=f"'num_nextn_predict_layers' is 0 .*{layer}"):
        mtp.load_model(zero)
    # a checkpoint without its MTP layer (what a transformers fine-tune writes): a warning, then plain decoding
    gone = edit(copy_reference(ref, tmp_path / "gone"), tensors=lambda s: [s.pop(k) for k in [k for k in s if k.startswith(p)]])
    pattern = "model.mtp_layers" if fam.mimo else f"model.layers.{L}"
    with pytest.warns(mtp.MissingMTPWarning, match=f"holds no MTP tensors \\({pattern}"):
        plain = mtp.load_model(gone)
    assert not plain.has_mtp
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(plain(ids), ref.hf(ids).logits, atol=1e-4, rtol=0)
    with pytest.warns(UserWarning, match="falling back to plain decoding"):
        spec = mtp.generate(plain, [1, 2, 3], max_new_tokens=5, draft_tokens=2).tokens
    assert spec == mtp.generate(plain, [1, 2, 3], max_new_tokens=5).tokens


def test_bad_expert_tensors_name_the_deepseek_key(reference, tmp_path):
    ref = reference("deepseek_v3")
    path = edit(copy_reference(ref, tmp_path / "count"),
                tensors=lambda s: s.update({"model.layers.1.mlp.experts.8.gate_proj.weight": torch.zeros(16, 32)}))
    with pytest.raises(mtp.CheckpointError, match="expert 8 but config key 'n_routed_experts' is 8"):
        mtp.load_model(path)


# ---------------------------------------------------------------------- bench shapes
@pytest.mark.parametrize("shape", ["deepseek-v3", "glm-4.5"])
def test_bench_shapes_fit_and_build(monkeypatch, shape):
    from mtp.bench import costmodel

    real = costmodel.SHAPES[shape]
    config = config_from_dict(dict(real))
    with torch.device("meta"):
        model = model_class_for(config)(config)
    n = sum(p.numel() for p in model.parameters())
    assert n * 2 < 10.5e9, f"{shape}: {n / 1e9:.2f}B parameters"  # bf16 bytes
    assert costmodel.FULL_LAYERS[shape] > config.num_hidden_layers and model.mtp is not None
    assert sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)) == 1
    small = {**real, "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 8,
             "num_attention_heads": 4, "max_position_embeddings": 512}
    small |= ({"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
               "num_key_value_heads": 4} if real["model_type"] == "deepseek_v3" else {"head_dim": 8, "num_key_value_heads": 2})
    monkeypatch.setitem(costmodel.SHAPES, "tiny", small)
    tiny_model = costmodel.build_shape_model("tiny", torch.bfloat16)
    assert tiny_model.dtype == torch.bfloat16
    costs = costmodel.measure_costs(tiny_model, q_max=2, context=16, iters=1, warmup=0, compare_threads=False)
    assert costs["c_draft"] > 0 and math.isfinite(costs["c_verify"][2])
