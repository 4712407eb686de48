"""MiMo-V2-Flash: backbone parity with transformers' `MiMoV2FlashForCausalLM` (prefill, cached prefill chunks and
decode forwards, contexts many times the sliding window; global and sliding-window layers with sinks, dense and MoE
layers, grouped and plain routing), the three MTP layers against their equations around transformers' own decoder
layers, saves that keep every name and load in transformers, lossless speculative decoding with a window smaller
than the context (so rolled-back rounds cross the window edge), heads-only training, heal, configs and bad input.

The reference checkpoint is written by transformers: the backbone as `save_pretrained` writes it (per-expert
tensors, `self_attn.attention_sink_bias`), plus the MTP layers under the release's names, `model.mtp.layers.{i}.*`:
the decoder weights of a second transformers model's sliding-window dense layers (`post_attention_layernorm` saved
as `pre_mlp_layernorm`) and `enorm`, `hnorm`, `eh_proj`, `final_layernorm`. transformers ignores `model.mtp.*`."""

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
from mtp.config import ConfigError, MiMoV2FlashConfig
from mtp.io import read_tensors
from mtp.model import config_from_dict
from mtp.model.families import model_class_for

L, N_MTP, WINDOW = 4, 3, 5
TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
MLPS = ["dense", "sparse", "sparse", "sparse"]
ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=L, num_attention_heads=4,
            num_key_value_heads=1, head_dim=12, v_head_dim=8, max_position_embeddings=256, moe_intermediate_size=16,
            n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.5, sliding_window=WINDOW,
            attention_value_scale=0.707, rms_norm_eps=1e-6, tie_word_embeddings=False)
VARIANTS = {"plain-routing": {}, "grouped-raw": {"n_group": 2, "topk_group": 1, "norm_topk_prob": False}}


def hf_transformers():
    return pytest.importorskip("transformers")


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def window_mask(n: int) -> torch.Tensor:
    """transformers' additive sliding-window causal mask [1, 1, n, n]: key j seen by query i iff i - WINDOW < j <= i."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    return torch.zeros(n, n).masked_fill(~((j <= i) & (j > i - WINDOW)), float("-inf"))[None, None]


@dataclass
class Reference:
    path: object
    hf: object  # transformers' backbone loaded from `path`
    mtp_ref: object  # transformers model whose layers hold the MTP layers' decoder weights


def build_reference(path, seed: int = 0, **over) -> Reference:
    transformers = hf_transformers()
    kw = {**TINY, **over, "rope_parameters": ROPE}
    torch.manual_seed(seed)
    backbone = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(
        **kw, layer_types=TYPES, mlp_layer_types=MLPS)).eval()
    mtp_ref = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(
        **{**kw, "num_hidden_layers": N_MTP}, layer_types=["sliding_attention"] * N_MTP,
        mlp_layer_types=["dense"] * N_MTP)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in (backbone, mtp_ref):
            for name, p in m.named_parameters():
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
            for layer in m.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=g))
    backbone.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    for name, t in mtp_ref.model.layers.state_dict().items():
        i, rest = name.split(".", 1)
        rest = rest.replace("post_attention_layernorm", "pre_mlp_layernorm")
        rest = rest.replace("self_attn.sinks", "self_attn.attention_sink_bias")
        state[f"model.mtp.layers.{i}.{rest}"] = t.clone()
    H = kw["hidden_size"]
    for i in range(N_MTP):
        for name in ("enorm", "hnorm", "final_layernorm"):
            state[f"model.mtp.layers.{i}.{name}.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
        state[f"model.mtp.layers.{i}.eh_proj.weight"] = 0.2 * torch.randn(H, 2 * H, generator=g)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.MiMoV2FlashForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Reference(path, hf, mtp_ref)


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
def test_backbone_logits_match_transformers_prefill_cached_and_decode(reference, name):
    ref = reference(name)
    ours = load(ref.path)
    assert type(ours).__name__ == "MiMoV2FlashForCausalLM" and ours.has_mtp and ours.mtp.num_layers == N_MTP
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["MLP", "DeepseekMoE", "DeepseekMoE", "DeepseekMoE"]
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, WINDOW, WINDOW, None]
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))  # 8 windows long
    want = ref.hf(ids).logits
    torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
    cache = ours.new_cache(2, 64)  # a prefill, a chunk after it, then single tokens
    cached = torch.cat([ours(ids[:, :17], cache), ours(ids[:, 17:23], cache)] + [ours(ids[:, i : i + 1], cache)
                                                                                 for i in range(23, 40)], 1)
    torch.testing.assert_close(cached, want, atol=1e-4, rtol=0)
    # decode forwards (positions in tensors): rows at different positions, widths 1 and 4, eager rows and masked
    for starts in (True, False):
        cache = ours.new_cache(2, 64, rows=True)
        ours.prepare_decode(64)
        got = []
        for a, b in ((0, 12), (12, 13), (13, 17), (17, 40)):
            index = torch.arange(a, b)[None].expand(2, -1)
            pos = ours.decode_positions(index, [a, a] if starts else None)
            h, _ = ours.decode(ids[:, a:b], cache, pos)
            got.append(ours.head(h))
        torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-4, rtol=0)


@torch.no_grad()
def reference_mtp_logits(ref: Reference, ids: torch.Tensor) -> list[torch.Tensor]:
    """MTP logits of depths 1..3 for ids [1, T] by the equations, around transformers' sliding-window decoder layers
    (holding MTP layer d's weights): the embedding of the token d ahead first, h the backbone's post-norm state, the
    post-norm output fed back, layer d for depth d, the shared embedding and lm_head. List of [T - d, V]."""
    with read_tensors(ref.path) as t:
        sd = {k: t.tensor(k).clone() for k in t}
    T = ids.shape[1]
    prev = ref.hf.model(ids).last_hidden_state[0]
    out_logits = []
    for d in range(1, N_MTP + 1):
        n, p = T - d, f"model.mtp.layers.{d - 1}."
        e = sd["model.embed_tokens.weight"][ids[0, d:]]
        x = torch.cat([rms(e, sd[p + "enorm.weight"]), rms(prev[:n], sd[p + "hnorm.weight"])], -1) @ sd[p + "eh_proj.weight"].T
        pe = ref.mtp_ref.model.rotary_emb(x[None], torch.arange(n)[None], "sliding_attention")  # slot i at position i
        out = ref.mtp_ref.model.layers[d - 1](x[None], attention_mask=window_mask(n), position_embeddings=pe)
        out = out[0] if isinstance(out, tuple) else out
        prev = rms(out[0], sd[p + "final_layernorm.weight"])
        out_logits.append(prev @ sd["lm_head.weight"].T)
    return out_logits


@pytest.mark.parametrize("name", list(VARIANTS))
@torch.no_grad()
def test_three_mtp_layers_follow_the_equations(reference, name):
    ref = reference(name)
    ours = load(ref.path)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))  # MTP contexts > the window
    got = ours.mtp_logits(ids, N_MTP)
    assert len(got) == N_MTP
    for d, want in enumerate(reference_mtp_logits(ref, ids), start=1):
        torch.testing.assert_close(got[d - 1][0], want, atol=1e-4, rtol=0)
    assert [ours.mtp.layer_for_depth(d) for d in range(1, 7)] == [0, 1, 2, 0, 1, 2]  # own layers, then reused


# ---------------------------------------------------------------------- saves
@torch.no_grad()
def test_save_keeps_every_name_and_loads_in_transformers(reference, tmp_path):
    ref = reference("plain-routing")
    ours = load(ref.path)
    mtp.save_model(ours, tmp_path)
    assert names(tmp_path) == names(ref.path)
    assert {"model.mtp.layers.2.pre_mlp_layernorm.weight", "model.mtp.layers.2.self_attn.attention_sink_bias",
            "model.layers.1.mlp.experts.7.down_proj.weight"} <= names(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "mimo_v2_flash" and "num_nextn_predict_layers" not in written  # absent as read
    transformers = hf_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf2 = transformers.MiMoV2FlashForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(hf2(ids).logits, ref.hf(ids).logits, atol=1e-5, rtol=0)
    again = load(tmp_path)
    torch.testing.assert_close(again.mtp_logits(ids, 3)[2], ours.mtp_logits(ids, 3)[2], atol=0, rtol=0)


# ---------------------------------------------------------------------- decoding and training
def tiny(seed: int = 0, std: float = 0.2, **over):
    config = config_from_dict({"model_type": "mimo_v2_flash", **TINY, "layer_types": TYPES, "mlp_layer_types": MLPS,
                               "rope_parameters": ROPE, **over})
    model = model_class_for(config)(config)
    mtp.model.init_weights_(model, std=std, seed=seed)
    return model.eval()


def trained(steps: int = 60, seed: int = 0, **over):
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
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(9))
    h = model.hidden(ids)
    for d in (1, 3):  # depth d reads layer d's cache
        want = model.mtp_step(d, h[:, :-d], ids[:, d:], 0)
        caches = model.new_mtp_cache(1, 32)
        chunks = ((0, 7), (7, 8), (8, 24 - d))
        got = torch.cat([model.mtp_step(d, h[:, a:b], ids[:, a + d : b + d], a, caches) for a, b in chunks], 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert caches[d - 1].k.abs().sum() > 0 and all(caches[j].k.abs().sum() == 0 for j in range(3) if j != d - 1)


def test_greedy_speculative_equals_plain(monkeypatch):
    """Contexts up to 40 tokens with a window of 5: every round's rejected suffix is written into sliding-window
    caches and must be invisible afterwards. k = 4..6 reuse the three layers past depth 3."""
    model = trained()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = pattern_batch(8, 1, int(torch.randint(2, 16, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(model, prompt, max_new_tokens=24).tokens
        for k in (1, 2, 3, 4, 5, 6, "auto"):
            assert mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k).tokens == want, k
    assert scripted_drafts_patterns(model, prompt, monkeypatch) == {"none", "some", "all"}
    model.to(torch.bfloat16).prepare_for_inference()  # bf16 kernels on the same decode path
    want = mtp.generate(model, prompt, max_new_tokens=24).tokens
    for k in (1, 3, 6, "auto"):
        assert mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k).tokens == want, ("bf16", k)


def test_batched_decoding_equals_solo():
    """Rows at different positions in one round (staggered arrivals): each gets what it gets alone."""
    from test_batch import greedy_requests, run_batched

    model = trained(steps=20, seed=1)
    requests = greedy_requests(8, 5, seed=3, max_prompt=30)
    for (prompt, max_new, _, _), s in zip(requests, run_batched(model, requests, 3)):
        assert s.new_tokens == mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=3).tokens


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_data import build_toy

    return build_toy(tmp_path_factory.mktemp("toy"))


def test_pretrain_heads_and_finetune_through_mtp_train(data, tmp_path):
    from mtp.train.trainer import train
    from test_train import cfg

    keys = {k: v for k, v in TINY.items() if k != "vocab_size"} | {"layer_types": TYPES, "mlp_layer_types": MLPS,
                                                                   "rope_parameters": ROPE}
    train(cfg(data, tmp_path / "pre", model={"model_type": "mimo_v2_flash", **keys}, max_steps=2, eval_every=2))
    base = tmp_path / "pre" / "model"
    m = load(base)
    assert type(m.config) is MiMoV2FlashConfig and m.has_mtp and m.mtp.num_layers == N_MTP
    train(cfg(data, tmp_path / "h", mode="heads", init=str(base), model={}, max_steps=3, lr=1e-2, eval_every=3))
    with read_tensors(base) as before, read_tensors(tmp_path / "h" / "model") as after:
        assert set(before) == set(after)
        for k in before:
            if not k.startswith("model.mtp."):
                assert torch.equal(before.tensor(k), after.tensor(k)), k
        for i in range(N_MTP):  # every depth trained
            assert not torch.equal(before.tensor(f"model.mtp.layers.{i}.eh_proj.weight"),
                                   after.tensor(f"model.mtp.layers.{i}.eh_proj.weight")), i
    train(cfg(data, tmp_path / "f", mode="finetune", init=str(base), model={}, max_steps=2, eval_every=2))
    assert names(tmp_path / "f" / "model") == names(base)


def test_heal_grafts_the_mtp_layers_back(tmp_path):
    from mtp.train.heal import graft

    model = tiny(seed=6)
    for out in ("base", "ft"):
        mtp.save_model(model, tmp_path / out)
    f = tmp_path / "ft" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not k.startswith("model.mtp.")}, f)
    with pytest.warns(mtp.MissingMTPWarning, match="model.mtp.layers"):
        assert not mtp.load_model(tmp_path / "ft").has_mtp
    grafted = graft(tmp_path / "base", tmp_path / "ft", tmp_path / "out")
    assert set(grafted) == {k for k in names(tmp_path / "base") if k.startswith("model.mtp.")}
    assert names(tmp_path / "out") == names(tmp_path / "base")
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(load(tmp_path / "out").mtp_logits(ids)[2], model.mtp_logits(ids)[2], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- configs
# A config.json in the release's spelling (the keys SGLang and vLLM read), with the values transformers' defaults give
# as the release's (the hub file itself is not reachable from the tests).
RELEASED = {
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "vocab_size": 152576, "hidden_size": 4096,
    "intermediate_size": 16384, "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 192, "v_head_dim": 128, "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192,
    "swa_v_head_dim": 128, "rope_theta": 5000000, "swa_rope_theta": 10000, "partial_rotary_factor": 0.334,
    "attention_value_scale": 0.707, "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
    "sliding_window_size": 128, "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)],
    "moe_layer_freq": [0] + [1] * 47, "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": None, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": None, "max_position_embeddings": 262144, "layernorm_epsilon": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def test_released_config_round_trips_and_matches_transformers_reading(tmp_path):
    cfg = MiMoV2FlashConfig.from_hf_dict(RELEASED)
    assert cfg.to_hf_dict() == RELEASED
    assert cfg.window == 129 and cfg.attention_shape("sliding_attention") == (64, 8) and cfg.rotary_dim("full_attention") == 64
    assert [cfg.layer_type(i) for i in (0, 1, 5, 11, 47, 48)] == ["full_attention"] + ["sliding_attention"] + \
        ["full_attention"] * 3 + ["sliding_attention"]
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1) and not cfg.is_moe_layer(48) and cfg.mtp_num_hidden_layers == 3
    transformers = hf_transformers()
    theirs = transformers.MiMoV2FlashConfig()  # transformers' defaults are the release's shapes
    assert theirs.layer_types == [cfg.layer_type(i) for i in range(48)] and theirs.sliding_window == cfg.window
    assert theirs.mlp_layer_types == ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(48)]
    for kind in ("full_attention", "sliding_attention"):
        assert theirs.rope_parameters[kind]["rope_theta"] == cfg.rope_for(kind)["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(RELEASED))
    assert type(mtp.model.config_from_json(tmp_path / "config.json")) is MiMoV2FlashConfig
    cfg.mtp_num_hidden_layers = 2  # what heal / the trainer may set: the file lacked it, the tensors tell it
    assert "num_nextn_predict_layers" not in cfg.to_hf_dict()


@pytest.mark.parametrize("mutate, key", [
    (dict(swa_num_key_value_heads=4), "swa_num_key_value_heads"),
    (dict(swa_head_dim=128), "swa_head_dim"),
    (dict(add_full_attention_sink_bias=True), "add_full_attention_sink_bias"),
    (dict(add_swa_attention_sink_bias=False), "add_swa_attention_sink_bias"),
    (dict(hybrid_layer_pattern=[0, 1]), "hybrid_layer_pattern"),
    (dict(moe_layer_freq=[0] + [2] * 47), "moe_layer_freq"),
    (dict(layer_types=["full_attention"] * 48), "layer_types"),
    (dict(n_shared_experts=1), "n_shared_experts"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(num_experts_per_tok=257), "num_experts_per_tok"),
    (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
    (dict(rms_norm_eps=1e-6), "layernorm_epsilon"),
    (dict(partial_rotary_factor=0.001), "partial_rotary_factor"),
])
def test_bad_config_values_name_the_key(mutate, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        MiMoV2FlashConfig.from_hf_dict({**RELEASED, **mutate})


def test_bad_mtp_tensors_are_named(reference, tmp_path):
    ref = reference("plain-routing")
    shutil.copytree(ref.path, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(f)
    state.pop("model.mtp.layers.1.eh_proj.weight")
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(mtp.CheckpointError, match="missing tensor.*model.mtp.layers.1.eh_proj.weight"):
        mtp.load_model(tmp_path / "m")
    shutil.copytree(ref.path, tmp_path / "fewer")  # no count in the file: the checkpoint's MTP layers decide
    f = tmp_path / "fewer" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not k.startswith("model.mtp.layers.2.")}, f, metadata={"format": "pt"})
    assert load(tmp_path / "fewer").mtp.num_layers == 2
    cfg = json.loads((ref.path / "config.json").read_text())
    shutil.copytree(ref.path, tmp_path / "two")
    (tmp_path / "two" / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    with pytest.raises(mtp.CheckpointError, match="'num_nextn_predict_layers' is 2"):
        mtp.load_model(tmp_path / "two")


def test_fp8_release_loads_exactly_and_decodes_losslessly(tmp_path, monkeypatch):
    """Block-wise FP8 (as the release ships), the MTP layers quantized too: every tensor loads as its codes times its
    scales, and greedy speculative decoding equals plain."""
    from test_quantized import assert_loads_as, close_logits, greedy_spec_equals_plain, release_fp8

    src = tiny(std=0.02).to(torch.bfloat16)
    mtp.save_model(src, tmp_path)
    reference = release_fp8(tmp_path, (16, 16), exclude=["lm_head"])
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.mtp.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.self_attn.attention_sink_bias"].dtype == torch.bfloat16
    model = mtp.load_model(tmp_path)
    assert model.has_mtp and model.mtp.num_layers == N_MTP
    assert_loads_as(model, reference)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    assert close_logits(model, src, ids) < 0.1
    greedy_spec_equals_plain(model, monkeypatch, 64)
