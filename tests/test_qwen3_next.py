"""Qwen3-Next: backbone parity with transformers' `Qwen3NextForCausalLM` (prefill and cached; MoE and dense layers;
renormalised and raw top-k weights), the `mtp.*` module against its equations around transformers' own decoder layer,
saves that keep every name and load in transformers, lossless speculative decoding, heads-only training, heal,
configs and bad input.

The reference checkpoint is written by transformers: a model with one full-attention layer more than the backbone
is saved, its last layer renamed `mtp.layers.0.*` (transformers' names and per-expert layout), and the MTP-only
tensors (`mtp.fc`, the two pre-fc norms, `mtp.norm`) added; config.json says the backbone's layer count.
transformers ignores `mtp.*` when it loads the folder."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import mtp
from conftest import pattern_batch, scripted_drafts_patterns
from mtp.config import ConfigError, Qwen3NextConfig
from mtp.io import read_tensors
from mtp.model import config_from_dict
from mtp.model.families import model_class_for

L = 4  # backbone layers: linear, full, linear, full
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24, rope_theta=10000.0,
            partial_rotary_factor=0.5, mlp_only_layers=[1], tie_word_embeddings=False)
TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
VARIANTS = {"renormalised": {}, "raw-topk": {"norm_topk_prob": False}}


def hf_transformers():
    return pytest.importorskip("transformers")


def zc_rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w)


@dataclass
class Reference:
    path: object
    hf: object  # transformers' backbone loaded from `path`
    mtp_layer: object  # transformers' decoder layer holding the MTP layer's decoder weights
    rotary: object


def build_reference(path, seed: int = 0, **over) -> Reference:
    transformers = hf_transformers()
    kw = {**TINY, **over}
    torch.manual_seed(seed)
    big = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **{**kw, "num_hidden_layers": L + 1, "layer_types": TYPES + ["full_attention"]})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers initialises norms to 0 (1-centred) and some gates to 0: randomise all
        for _, p in big.named_parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        for layer in big.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.rand(layer.linear_attn.A_log.shape, generator=g).log())
                layer.linear_attn.norm.weight.add_(1.0)
    big.save_pretrained(path / "big")
    state = load_file(path / "big" / "model.safetensors")
    state = {(f"mtp.layers.0.{k[len(f'model.layers.{L}.'):]}" if k.startswith(f"model.layers.{L}.") else k): v
             for k, v in state.items()}
    H = kw["hidden_size"]
    for name, shape in {"fc.weight": (H, 2 * H), "pre_fc_norm_embedding.weight": (H,), "pre_fc_norm_hidden.weight": (H,),
                        "norm.weight": (H,)}.items():
        state["mtp." + name] = 0.2 * torch.randn(shape, generator=g)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "big" / "config.json").read_text())
    cfg.update(num_hidden_layers=L, layer_types=TYPES)
    (path / "config.json").write_text(json.dumps(cfg))
    shutil.rmtree(path / "big")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Reference(path, hf, big.model.layers[L], big.model.rotary_emb)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    built: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in built:
            built[name] = build_reference(tmp_path_factory.mktemp(name.replace("-", "_")), **VARIANTS[name])
        return built[name]

    return get


def load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", mtp.MissingMTPWarning)
        return mtp.load_model(path, **kw)


def names(path) -> set[str]:
    with read_tensors(path) as t:
        return set(t)


# ---------------------------------------------------------------------- parity
@pytest.mark.parametrize("name", list(VARIANTS))
@torch.no_grad()
def test_backbone_logits_match_transformers_prefill_and_cached(reference, name):
    ref = reference(name)
    ours = load(ref.path)
    assert type(ours).__name__ == "Qwen3NextForCausalLM" and ours.has_mtp
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["SparseMoE", "MLP", "SparseMoE", "SparseMoE"]
    ids = torch.randint(0, 64, (2, 90), generator=torch.Generator().manual_seed(1))  # > one DeltaNet chunk (64)
    want = ref.hf(ids).logits
    torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
    cache = ours.new_cache(2, 128)
    cached = torch.cat([ours(ids[:, :70], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(70, 90)], 1)
    torch.testing.assert_close(cached, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
@torch.no_grad()
def test_mtp_logits_follow_the_equations(reference, name):
    """Depths 1 and 2 by hand around transformers' decoder layer (which holds the MTP layer's weights): the embedding
    of the token d ahead first in the concat, both pre-fc norms zero-centred, h the backbone's post-norm state, the
    post-norm MTP output fed back, the shared embedding and lm_head."""
    ref = reference(name)
    ours = load(ref.path)
    with read_tensors(ref.path) as t:
        sd = {k: t.tensor(k).clone() for k in t}
    ids = torch.randint(0, 64, (1, 14), generator=torch.Generator().manual_seed(2))
    T = ids.shape[1]
    prev = ref.hf.model(ids).last_hidden_state[0]
    got = ours.mtp_logits(ids, 2)
    for d in (1, 2):
        n = T - d
        e = sd["model.embed_tokens.weight"][ids[0, d:]]
        x = torch.cat([zc_rms(e, sd["mtp.pre_fc_norm_embedding.weight"]), zc_rms(prev[:n], sd["mtp.pre_fc_norm_hidden.weight"])],
                      -1) @ sd["mtp.fc.weight"].T
        pe = ref.rotary(x[None], torch.arange(n)[None])  # MTP slot i sits at the position of h_i
        out = ref.mtp_layer(x[None], attention_mask=None, position_embeddings=pe)
        out = out[0] if isinstance(out, tuple) else out
        prev = zc_rms(out[0], sd["mtp.norm.weight"])
        torch.testing.assert_close(got[d - 1][0], prev @ sd["lm_head.weight"].T, atol=1e-4, rtol=0)


@torch.no_grad()
def test_deltanet_projection_split_matches_transformers(reference):
    """The grouped in_proj_qkvz / in_proj_ba split into [q | k | v], z, b, a equals transformers' own reordering (up to
    the matmul kernels' rounding: a wrong order differs by the size of the values, ~0.5)."""
    ref = reference("renormalised")
    ours = load(ref.path)
    theirs, mine = ref.hf.model.layers[0].linear_attn, ours.model.layers[0].linear_attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x), theirs.in_proj_ba(x))
    qkv, z2, b2, a2 = mine.projections(x)
    want = torch.cat([t.reshape(2, 5, -1) for t in (q, k, v)], -1)
    for got, exp in ((qkv, want), (z2, z.reshape(2, 5, -1)), (b2, b), (a2, a)):
        torch.testing.assert_close(got, exp, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- saves
@torch.no_grad()
def test_save_keeps_every_name_and_loads_in_transformers(reference, tmp_path):
    ref = reference("renormalised")
    ours = load(ref.path)
    mtp.save_model(ours, tmp_path)
    assert names(tmp_path) == names(ref.path)
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in names(tmp_path)  # per expert, as transformers wrote it
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_next" and "num_nextn_predict_layers" not in written  # absent as read
    transformers = hf_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf2 = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(hf2(ids).logits, ref.hf(ids).logits, atol=1e-5, rtol=0)
    again = load(tmp_path)
    torch.testing.assert_close(again.mtp_logits(ids, 2)[1], ours.mtp_logits(ids, 2)[1], atol=0, rtol=0)


# ---------------------------------------------------------------------- decoding and training
def tiny(seed: int = 0, std: float = 0.2, **over):
    config = config_from_dict({"model_type": "qwen3_next", **TINY, "layer_types": TYPES, **over})
    model = model_class_for(config)(config)
    mtp.model.init_weights_(model, std=std, seed=seed)
    return model.eval()


def trained(steps: int = 80, seed: int = 0, **over):
    model = tiny(seed=seed, std=0.02, vocab_size=8, **over).train()
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


@torch.no_grad()
def test_cached_mtp_steps_equal_teacher_forcing():
    model = tiny(seed=2)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(9))
    h = model.hidden(ids)
    want = model.mtp_step(1, h[:, :-1], ids[:, 1:], 0)
    caches = model.new_mtp_cache(1, 32)
    got = torch.cat([model.mtp_step(1, h[:, a:b], ids[:, a + 1 : b + 1], a, caches) for a, b in ((0, 7), (7, 8), (8, 19))], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_greedy_speculative_equals_plain(monkeypatch):
    model = trained()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = pattern_batch(8, 1, int(torch.randint(2, 16, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(model, prompt, max_new_tokens=24).tokens
        for k in (1, 2, 3, 4, 5, 6, "auto"):
            assert mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k).tokens == want, k
    assert scripted_drafts_patterns(model, prompt, monkeypatch) == {"none", "some", "all"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_data import build_toy

    return build_toy(tmp_path_factory.mktemp("toy"))


def test_pretrain_heads_and_finetune_through_mtp_train(data, tmp_path):
    from mtp.train.trainer import train
    from test_train import cfg

    keys = {k: v for k, v in TINY.items() if k != "vocab_size"} | {"layer_types": TYPES}
    train(cfg(data, tmp_path / "pre", model={"model_type": "qwen3_next", **keys}, max_steps=2, eval_every=2))
    base = tmp_path / "pre" / "model"
    m = load(base)
    assert type(m.config) is Qwen3NextConfig and m.has_mtp
    train(cfg(data, tmp_path / "h", mode="heads", init=str(base), model={}, max_steps=3, lr=1e-2, eval_every=3))
    with read_tensors(base) as before, read_tensors(tmp_path / "h" / "model") as after:
        assert set(before) == set(after)
        for k in before:
            if not k.startswith("mtp."):
                assert torch.equal(before.tensor(k), after.tensor(k)), k
        assert any(not torch.equal(before.tensor(k), after.tensor(k)) for k in before if k.startswith("mtp."))
    train(cfg(data, tmp_path / "f", mode="finetune", init=str(base), model={}, max_steps=2, eval_every=2))
    assert names(tmp_path / "f" / "model") == names(base)


def test_heal_grafts_the_mtp_module_back(tmp_path):
    from mtp.train.heal import graft

    model = tiny(seed=6)
    for out in ("base", "ft"):
        mtp.save_model(model, tmp_path / out)
    f = tmp_path / "ft" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not k.startswith("mtp.")}, f)
    grafted = graft(tmp_path / "base", tmp_path / "ft", tmp_path / "out")
    assert set(grafted) == {k for k in names(tmp_path / "base") if k.startswith("mtp.")}
    assert names(tmp_path / "out") == names(tmp_path / "base")
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(load(tmp_path / "out").mtp_logits(ids)[0], model.mtp_logits(ids)[0], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- configs
QWEN3_NEXT_CONFIG = {  # Qwen3-Next-80B-A3B-Instruct's config.json, as shipped (no MTP count: 1 MTP layer)
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
    "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_real_config_round_trips_keeping_every_key(tmp_path):
    cfg = Qwen3NextConfig.from_hf_dict(QWEN3_NEXT_CONFIG)
    assert cfg.to_hf_dict() == QWEN3_NEXT_CONFIG
    assert cfg.mtp_num_hidden_layers == 1 and cfg.rotary_dim == 64 and cfg.layer_type(3) == "full_attention"
    assert all(cfg.is_moe_layer(i) for i in range(48)) and cfg.eos_token_ids == [151645]
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_CONFIG))
    assert type(mtp.model.config_from_json(tmp_path / "config.json")) is Qwen3NextConfig
    cfg.mtp_num_hidden_layers = 2  # what heal / the trainer may set
    assert cfg.to_hf_dict()["num_nextn_predict_layers"] == 2


@pytest.mark.parametrize("mutate, key", [
    (dict(linear_num_value_heads=33), "linear_num_key_heads"),
    (dict(mlp_only_layers=[48]), "mlp_only_layers"),
    (dict(num_experts_per_tok=513), "num_experts_per_tok"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(layer_types=["full_attention"] * 3), "layer_types"),
    (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
])
def test_bad_config_values_name_the_key(mutate, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        Qwen3NextConfig.from_hf_dict({**QWEN3_NEXT_CONFIG, **mutate})


def test_bad_mtp_tensors_are_named(reference, tmp_path):
    ref = reference("renormalised")
    shutil.copytree(ref.path, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(f)
    state.pop("mtp.fc.weight")
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(mtp.CheckpointError, match="missing tensor.*mtp.fc.weight"):
        mtp.load_model(tmp_path / "m")
    cfg = json.loads((ref.path / "config.json").read_text())
    shutil.copytree(ref.path, tmp_path / "two")
    (tmp_path / "two" / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    with pytest.raises(mtp.CheckpointError, match="'num_nextn_predict_layers' is 2"):
        mtp.load_model(tmp_path / "two")
