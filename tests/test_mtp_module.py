"""`mtp_logits` against a straightforward re-computation of the equations of docs/reference.md ("The MTP module")."""

import math

import pytest
import torch

from conftest import tiny_model


def norm(x, w, eps=1e-6):  # zero-centred RMSNorm
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x, pos, rot, theta):  # x [T, D] for one head, positions [T]
    out = x.clone()
    half = rot // 2
    for t in range(x.shape[0]):
        for i in range(half):
            ang = pos[t] / theta ** (2 * i / rot)
            a, b = x[t, i], x[t, i + half]
            out[t, i] = a * math.cos(ang) - b * math.sin(ang)
            out[t, i + half] = b * math.cos(ang) + a * math.sin(ang)
    return out


def attention_layer(sd, p, x, cfg):
    """A gated full-attention decoder layer written out per head, causal over x [T, H]."""
    T = x.shape[0]
    A, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = norm(x, sd[p + "input_layernorm.weight"])
    qg = (h @ sd[p + "self_attn.q_proj.weight"].T).view(T, A, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(T, K, D)
    v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(T, K, D)
    heads = []
    for a in range(A):
        kv = a // (A // K)
        qa = rope(norm(q[:, a], sd[p + "self_attn.q_norm.weight"]), range(T), cfg.rotary_dim, cfg.rope_theta)
        ka = rope(norm(k[:, kv], sd[p + "self_attn.k_norm.weight"]), range(T), cfg.rotary_dim, cfg.rope_theta)
        scores = qa @ ka.T / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        heads.append((scores.softmax(-1) @ v[:, kv]) * torch.sigmoid(gate[:, a]))
    x = x + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
    m = norm(x, sd[p + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
    return x + act @ sd[p + "mlp.down_proj.weight"].T


@pytest.mark.parametrize("layers, depth, tied", [(1, 1, True), (1, 3, False), (2, 2, True)])
@torch.no_grad()
def test_sequential_mtp_logits_follow_the_equations(layers, depth, tied):
    model = tiny_model(seed=7, mtp_num_hidden_layers=layers, tie_word_embeddings=tied)
    cfg, sd = model.config, model.state_dict()
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    T = ids.shape[1]
    head = sd["lm_head.weight"] if not tied else sd["model.embed_tokens.weight"]
    got = model.mtp_logits(ids, depth)
    assert [g.shape for g in got] == [(1, T - d, cfg.vocab_size) for d in range(1, depth + 1)]
    prev = model.hidden(ids)[0]  # h^0: the backbone's hidden AFTER its final norm
    for d in range(1, depth + 1):
        n = T - d
        e = norm(sd["model.embed_tokens.weight"][ids[0, d:]], sd["mtp.pre_fc_norm_embedding.weight"])
        h = norm(prev[:n], sd["mtp.pre_fc_norm_hidden.weight"])
        x = torch.cat([e, h], -1) @ sd["mtp.fc.weight"].T  # embedding first
        x = attention_layer(sd, f"mtp.layers.{(d - 1) % layers}.", x, cfg)
        prev = norm(x, sd["mtp.norm.weight"])
        torch.testing.assert_close(got[d - 1][0], prev @ head.T, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_parallel_heads_are_independent_layers_on_h0():
    model = tiny_model(seed=8, mtp_style="parallel", mtp_num_hidden_layers=3)
    cfg, sd = model.config, model.state_dict()
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    h0 = model.hidden(ids)[0]
    got = model.mtp_logits(ids, 3)
    for d in range(1, 4):
        x = attention_layer(sd, f"mtp.layers.{d - 1}.", h0[: 10 - d], cfg)
        want = norm(x, sd["mtp.norm.weight"]) @ sd["model.embed_tokens.weight"].T
        torch.testing.assert_close(got[d - 1][0], want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="depth"):
        model.mtp_logits(ids, 4)


@torch.no_grad()
def test_dedicated_embeddings_use_their_own_tables():
    model = tiny_model(seed=9, mtp_use_dedicated_embeddings=True)
    names = {k for k in model.state_dict() if k.startswith("mtp.")}
    assert {"mtp.embed_tokens.weight", "mtp.lm_head.weight"} <= names
    ids = torch.randint(0, 64, (1, 8))
    before = model.mtp_logits(ids)[0]
    backbone = model(ids)
    model.mtp.lm_head.weight.data.mul_(2)  # the MTP's own head ...
    torch.testing.assert_close(model.mtp_logits(ids)[0], 2 * before)
    torch.testing.assert_close(model(ids), backbone)  # ... is not the backbone's
    model.mtp.embed_tokens.weight.data.normal_()  # and the MTP reads its own embedding table
    assert not torch.allclose(model.mtp_logits(ids)[0], 2 * before)
    torch.testing.assert_close(model(ids), backbone)


@pytest.mark.parametrize("style,dtype,drafts", [("sequential", torch.float32, None), ("sequential", torch.bfloat16, None),
                                                ("sequential", torch.bfloat16, "int8"), ("sequential", torch.bfloat16, "int4"),
                                                ("parallel", torch.bfloat16, None)])
def test_reading_a_prompt_writes_the_caches_a_full_step_writes(style, dtype, drafts):
    """The decoder reads a prompt into the MTP's caches with `mtp_fill` (the layer's keys and values, no attention, no
    MLP; the key and value projections alone, not the fused one): the entries equal, bit for bit, those of the full
    `mtp_step`, so the drafts after it are the same."""
    from mtp.model.linear import prompt_products

    model = tiny_model(mtp_style=style, mtp_num_hidden_layers=2 if style == "parallel" else 1).to(dtype)
    model.prepare_for_inference()
    if drafts:
        model.quantize_drafts(drafts)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 90), generator=g)
    with torch.inference_mode():
        hidden = model.hidden(ids, model.new_cache(1, 96))
        for T in (89, 70, 9):  # rows on the bf16 tiles (>= 64) and not, where the build has them
            full, filled = model.new_mtp_cache(1, 96), model.new_mtp_cache(1, 96)
            with prompt_products():
                for d in range(1, 2 if style == "sequential" else 3):
                    nxt = ids[:, 1 : T + 1] if style == "sequential" else None
                    model.mtp_step(d, hidden[:, :T], nxt, 0, full)
                    model.mtp_fill(d, hidden[:, :T], nxt, 0, filled)
            for a, b in zip(full, filled):
                assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
            assert any(a.k[:, :, :T].abs().sum() > 0 for a in filled)
