"""Qwen3.5-MoE: parity with transformers in both expert layouts and both prefixes, the MoE MTP layer against its
equations, lossless decoding, training (aux loss, heads-only, resume), layout-keeping saves, and bad input."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import mtp
from conftest import MOE, pattern_batch, scripted_drafts_patterns, tiny_model
from mtp.io import read_tensors
from test_mtp_module import norm


def hf_transformers():
    """transformers, for the tests that compare with it (the module's other tests run without it)."""
    return pytest.importorskip("transformers")

MOE_CFG = dict(MOE, num_hidden_layers=4, full_attention_interval=2)


def moe_model(seed: int = 0, **kw):
    return tiny_model(seed=seed, **{**MOE_CFG, **kw})


def write(model, path, backbone: str = "per_expert", mtp_layout: str = "per_expert", multimodal: bool = False):
    """Save in a chosen expert layout for the backbone and the MTP layer, optionally with the multimodal prefix."""
    prefixes = [n[: -len(".gate_up_proj")] for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    model.checkpoint_layout = {p: (mtp_layout if p.startswith("mtp.") else backbone) for p in prefixes}
    mtp.save_model(model, path)
    model.checkpoint_layout = {}
    if multimodal:
        f = path / "model.safetensors"
        state = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in load_file(f).items()}
        state["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
        save_file(state, f)
        text = json.loads((path / "config.json").read_text())
        text["model_type"] = "qwen3_5_moe_text"
        cfg = {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False),
               "vision_config": {"depth": 1}, "architectures": ["Qwen3_5MoeForConditionalGeneration"]}
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def names(path):
    return set(read_tensors(path))


@pytest.mark.parametrize("backbone, mtp_layout", [("per_expert", "per_expert"), ("fused", "fused"),
                                                  ("per_expert", "fused"), ("fused", "per_expert")])
@torch.no_grad()
def test_logits_match_transformers_in_every_layout(tmp_path, backbone, mtp_layout):
    model = moe_model(seed=3, tie_word_embeddings=False)
    write(model, tmp_path, backbone, mtp_layout)
    keys = names(tmp_path)
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == (backbone == "fused")
    assert ("mtp.layers.0.mlp.experts.3.up_proj.weight" in keys) == (mtp_layout == "per_expert")
    ours = mtp.load_model(tmp_path)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    transformers = hf_transformers()
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ref = hf(ids).logits
    torch.testing.assert_close(ours(ids), ref, atol=1e-4, rtol=0)
    cache = ours.new_cache(2, 64)
    cached = torch.cat([ours(ids[:, :30], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(30, 40)], 1)
    torch.testing.assert_close(cached, ref, atol=1e-4, rtol=0)
    # written back in the layout it was read in: the same tensor names, and transformers still agrees
    mtp.save_model(ours, tmp_path / "again")
    assert names(tmp_path / "again") == keys
    hf2 = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    torch.testing.assert_close(hf2(ids).logits, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(mtp.load_model(tmp_path / "again").mtp_logits(ids)[0], ours.mtp_logits(ids)[0], atol=0, rtol=0)


@torch.no_grad()
def test_multimodal_layout_loads(tmp_path):
    model = moe_model(seed=4)
    write(model, tmp_path / "text")
    write(model, tmp_path / "mm", backbone="fused", multimodal=True)
    a, b = mtp.load_model(tmp_path / "text"), mtp.load_model(tmp_path / "mm")
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(a(ids), b(ids), atol=0, rtol=0)
    torch.testing.assert_close(a.mtp_logits(ids)[0], b.mtp_logits(ids)[0], atol=0, rtol=0)


@torch.no_grad()
def test_checkpoint_written_by_transformers_loads(tmp_path):
    cfg = moe_model().config
    transformers = hf_transformers()
    hf_cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(hf_cfg).eval()
    for n, p in hf.named_parameters():
        if "norm" in n or "gate" in n:
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    with pytest.warns(mtp.MissingMTPWarning, match="mtp"):  # transformers drops the MTP layer: we warn and decode plainly
        ours = mtp.load_model(tmp_path)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
    with pytest.warns(UserWarning, match="falling back to plain decoding"):
        spec = mtp.generate(ours, [1, 2, 3], max_new_tokens=5, draft_tokens=2).tokens
    assert spec == mtp.generate(ours, [1, 2, 3], max_new_tokens=5).tokens


def moe_block(sd, p, x, cfg):
    """The sparse MoE block written out token by token: softmax router, top-k renormalised, SwiGLU experts, gated
    shared expert."""
    out = []
    for t in x:
        probs = torch.softmax(sd[p + "mlp.gate.weight"] @ t, -1)
        w, idx = torch.topk(probs, cfg.num_experts_per_tok)
        w = w / w.sum()
        y = torch.zeros_like(t)
        inter = cfg.moe_intermediate_size
        for wj, e in zip(w, idx.tolist()):
            gu = sd[p + "mlp.experts.gate_up_proj"][e]
            y = y + wj * (sd[p + "mlp.experts.down_proj"][e] @ (F.silu(gu[:inter] @ t) * (gu[inter:] @ t)))
        s = sd[p + "mlp.shared_expert.down_proj.weight"] @ (F.silu(sd[p + "mlp.shared_expert.gate_proj.weight"] @ t)
                                                             * (sd[p + "mlp.shared_expert.up_proj.weight"] @ t))
        out.append(y + torch.sigmoid(sd[p + "mlp.shared_expert_gate.weight"] @ t) * s)
    return torch.stack(out)


@torch.no_grad()
def test_depth_one_mtp_logits_follow_the_equations():
    """h^1_i = norm(L(fc([norm(embed(t_{i+1})); norm(h_i)]))) with L a gated-attention layer whose MLP is the MoE
    block; logits = lm_head(h^1_i). The attention part is checked against the dense reference in test_mtp_module."""
    from test_mtp_module import attention_layer

    model = moe_model(seed=5, tie_word_embeddings=False)
    cfg, sd = model.config, model.state_dict()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    h0 = model.hidden(ids)[0]
    e = norm(sd["model.embed_tokens.weight"][ids[0, 1:]], sd["mtp.pre_fc_norm_embedding.weight"])
    h = norm(h0[:-1], sd["mtp.pre_fc_norm_hidden.weight"])
    x = torch.cat([e, h], -1) @ sd["mtp.fc.weight"].T
    p = "mtp.layers.0."
    # the dense reference layer's attention half, then the MoE MLP
    attn_only = {**sd, p + "mlp.gate_proj.weight": torch.zeros(1, x.shape[-1]),
                 p + "mlp.up_proj.weight": torch.zeros(1, x.shape[-1]), p + "mlp.down_proj.weight": torch.zeros(x.shape[-1], 1)}
    x = attention_layer(attn_only, p, x, cfg)
    x = x + moe_block(sd, p, norm(x, sd[p + "post_attention_layernorm.weight"]), cfg)
    want = norm(x, sd["mtp.norm.weight"]) @ sd["lm_head.weight"].T
    torch.testing.assert_close(model.mtp_logits(ids, 1)[0][0], want, atol=1e-4, rtol=0)


@torch.no_grad()
def test_decode_and_verify_touch_only_the_chosen_experts(monkeypatch):
    from mtp.model.moe import Experts

    model = moe_model(seed=6)
    used = []
    real = Experts._expert
    monkeypatch.setattr(Experts, "_expert", lambda self, e, x: used.append((e, x.shape[0])) or real(self, e, x))
    cache = model.new_cache(1, 32)
    model(torch.tensor([[1, 2, 3]]), cache)
    model.prepare_decode(32)
    used.clear()
    model.decode(torch.tensor([[4]]), cache, model.decode_positions(torch.tensor([[3]]), [3]))  # one plain step
    k, layers = MOE["num_experts_per_tok"], model.config.num_hidden_layers
    assert len(used) == k * layers and all(rows == 1 for _, rows in used)  # top-k experts per layer, one row each
    used.clear()
    # a verify of 4: each chosen expert once, with all its rows
    model.decode(torch.tensor([[5, 6, 7, 8]]), cache, model.decode_positions(torch.arange(3, 7)[None], [3]))
    assert sum(rows for _, rows in used) == 4 * k * layers  # every (token, choice) computed once
    assert len(used) <= min(4 * k, MOE["num_experts"]) * layers and len({e for e, _ in used}) < len(used)


def trained_moe(steps: int = 80, seed: int = 0, **kw):
    model = moe_model(seed=seed, std=0.02, vocab_size=8, **kw).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = pattern_batch(8, 8, 32, gen)
        h = model.hidden(ids)
        loss = F.cross_entropy(model.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        for d, hd in enumerate(model.mtp_hidden_states(ids, 1, hidden=h), start=1):
            loss = loss + F.cross_entropy(model.mtp_head(hd[:, :-1], d).flatten(0, 1), ids[:, d + 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    return trained_moe()


def test_greedy_speculative_equals_plain(trained, monkeypatch):
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        prompt = pattern_batch(8, 1, int(torch.randint(2, 16, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(trained, prompt, max_new_tokens=24).tokens
        for k in (1, 2, 3, 4, 5, 6, "auto"):
            r = mtp.generate(trained, prompt, max_new_tokens=24, draft_tokens=k)
            assert r.tokens == want, k
    # every acceptance pattern, forced by scripted drafts (what a trained head produces depends on the CPU)
    assert scripted_drafts_patterns(trained, prompt, monkeypatch) == {"none", "some", "all"}


def test_speculative_sampling_matches_the_target_distribution_on_moe():
    import test_sampling_stats as stats

    model = moe_model(seed=11, std=0.15, vocab_size=4)
    assert stats.chi2_pvalue(model, stats.SamplingParams(temperature=1.0), 2) > 1e-3


def test_aux_loss_is_transformers_load_balancing_loss():
    hf_transformers()
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    from mtp.model.moe import load_balancing_loss

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(12, 8, generator=g) for _ in range(3)]
    want = load_balancing_loss_func(tuple(logits), 8, 2)
    torch.testing.assert_close(load_balancing_loss(logits, 8, 2), want)
    model = moe_model()
    ids = torch.randint(0, 64, (2, 16), generator=g)
    routers = []
    model.hidden(ids, router_logits=routers)
    assert len(routers) == model.config.num_hidden_layers and routers[0].shape == (32, 8)
    from mtp.train.loss import mtp_objective

    out = mtp_objective(model, ids, [0.3])
    mtp_routers = []
    list(model.mtp_hidden_states(ids, 1, router_logits=mtp_routers))
    expect = 0.001 * (load_balancing_loss(routers, 8, 2) + load_balancing_loss(mtp_routers, 8, 2))
    torch.testing.assert_close(out.aux, expect.detach())
    assert math.isfinite(float(out.loss.detach()))


MODEL = dict(hidden_size=32, num_hidden_layers=2, full_attention_interval=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
             max_position_embeddings=256, rope_theta=10000.0, mtp_num_hidden_layers=1, model_type="qwen3_5_moe_text",
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def test_training_modes_on_moe(tmp_path, monkeypatch):
    from conftest import Killed, kill_after_step
    from mtp.train.trainer import train
    from test_data import build_toy
    from test_train import cfg, rows

    data = build_toy(tmp_path / "data")
    train(cfg(data, tmp_path / "a", model=MODEL, max_steps=4))
    assert all("aux" in r and r["aux"] > 0 for r in rows(tmp_path / "a"))
    base = mtp.load_model(tmp_path / "a" / "model")
    assert type(base.config).__name__ == "Qwen35MoeConfig" and base.has_mtp
    # heads only: the backbone is bit-identical afterwards
    train(cfg(data, tmp_path / "h", mode="heads", init=str(tmp_path / "a" / "model"), max_steps=3))
    before, after = read_tensors(tmp_path / "a" / "model"), read_tensors(tmp_path / "h" / "model")
    assert before.keys() == after.keys()
    for k in before:
        if not k.startswith("mtp."):
            assert torch.equal(before.tensor(k), after.tensor(k)), k
    assert any(not torch.equal(before.tensor(k), after.tensor(k)) for k in before if k.startswith("mtp."))
    # exact resume after a kill
    train(cfg(data, tmp_path / "full", model=MODEL, max_steps=6))
    with monkeypatch.context() as m, pytest.raises(Killed):
        kill_after_step(m, 3)
        train(cfg(data, tmp_path / "killed", model=MODEL, max_steps=6))
    train(cfg(data, tmp_path / "killed", model=MODEL, max_steps=6))
    assert [r["main"] for r in rows(tmp_path / "full")] == [r["main"] for r in rows(tmp_path / "killed")]
    # finetune runs on a checkpoint and keeps every tensor name
    train(cfg(data, tmp_path / "f", mode="finetune", init=str(tmp_path / "a" / "model"), max_steps=2))
    assert names(tmp_path / "f" / "model") == names(tmp_path / "a" / "model")


def test_heal_keeps_the_base_layout(tmp_path):
    from mtp.train.heal import graft

    model = moe_model(seed=7)
    write(model, tmp_path / "base", backbone="per_expert", mtp_layout="fused")
    write(model, tmp_path / "ft", backbone="per_expert")
    f = tmp_path / "ft" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not k.startswith("mtp.")}, f)
    grafted = graft(tmp_path / "base", tmp_path / "ft", tmp_path / "out")
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in grafted
    assert names(tmp_path / "out") == names(tmp_path / "base")
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(mtp.load_model(tmp_path / "out").mtp_logits(ids)[0], model.mtp_logits(ids)[0], atol=1e-6, rtol=0)


def break_it(path, fn):
    f = path / "model.safetensors"
    state = load_file(f)
    fn(state)
    save_file(state, f)


def test_bad_expert_tensors_name_the_tensor_and_the_key(tmp_path):
    model = moe_model(seed=8)
    cases = {
        "missing": (lambda s: s.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
                    "missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight'"),
        "mixed": (lambda s: s.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 32, 32)}),
                  "model.layers.0.mlp.experts mixes fused and per-expert"),
        "count": (lambda s: s.update({"model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(16, 32)}),
                  "expert 8 but config key 'num_experts' is 8"),
        "width": (lambda s: s.update({"model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(32, 12)}),
                  "disagrees with config key 'moe_intermediate_size' \\(16\\)"),
    }
    for name, (fn, msg) in cases.items():
        path = write(model, tmp_path / name)
        break_it(path, fn)
        with pytest.raises(mtp.CheckpointError, match=msg):
            mtp.load_model(path)
    fused = write(model, tmp_path / "fused-count", backbone="fused")
    break_it(fused, lambda s: s.update({"model.layers.1.mlp.experts.down_proj": torch.zeros(6, 32, 16)}))
    with pytest.raises(mtp.CheckpointError, match="holds 6 experts but config key 'num_experts' is 8"):
        mtp.load_model(fused)
    no_mtp = write(model, tmp_path / "no-mtp")
    break_it(no_mtp, lambda s: [s.pop(k) for k in [k for k in s if k.startswith("mtp.")]])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = mtp.load_model(no_mtp)
    assert not m.has_mtp and any("holds no MTP tensors" in str(x.message) for x in w)


def test_quantized_moe_keeps_its_routers_on_onednn_and_its_mtp_fc_native():
    """Under int8 the kept bf16 layers split by what reads them: the MTP's `fc` runs qmatmul's bf16 product (the
    one-call draft's bits, `native_bf16`), the routers what bf16 layers run (`bf16_kernel`: oneDNN's where it packs
    bf16 weights, faster over a prompt's rows)."""
    from mtp.model import qmatmul
    from mtp.model.linear import FastLinear, bf16_kernel

    model = moe_model().to(torch.bfloat16)
    model.prepare_for_inference("int8")
    kept = {n: m.kernel for n, m in model.named_modules() if isinstance(m, FastLinear) and m.kernel.startswith("bf16")}
    routers = [k for n, k in kept.items() if n.endswith("mlp.gate")]
    assert routers and all(k == bf16_kernel() for k in routers)
    assert kept["mtp.fc"] == ("bf16-native" if qmatmul.available() else "bf16")
