"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention): backbone parity with transformers in both regimes (contexts
shorter than index_topk: dense attention; longer: a few keys per query), the MTP layer (with its own indexer) against
its equations over transformers' decoder layer, the key-selection rule (ties), decode forwards that equal plain steps
bit for bit, lossless speculative decoding and batching, names, training, heal and configs.

Reference checkpoints are written by transformers as in tests/test_families.py: a model with one layer more than the
backbone is saved, its last decoder layer (indexer included) becomes the MTP layer's decoder layer, the MTP-only
tensors are added under the checkpoint's names and config.json says the backbone's layer count."""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import mtp
from conftest import pattern_batch, scripted_drafts_patterns
from mtp.config import ConfigError, DeepseekV32Config, GlmMoeDsaConfig
from mtp.decode.prompt_cache import PromptCache
from mtp.io import read_tensors
from mtp.model import config_from_dict
from mtp.model.dsa import IndexedKVCache, SparseMLAttention, select_keys
from mtp.model.families import model_class_for
from mtp.model.linear import row_invariant


def hf_transformers():
    return pytest.importorskip("transformers")


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=256)
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8)
YARN = {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.7, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}
# 8 indexer heads: a key scores exactly 0 (all its heads relu'd away) about 1 time in 256, so transformers' topk -
# whose order among equal scores is unspecified - meets no tie at the k-th score in these tests.
INDEX = dict(index_head_dim=8, index_n_heads=8)


@dataclass
class Family:
    model_type: str
    hf_config: str
    hf_model: str
    kw: dict
    ours: dict = field(default_factory=dict)


FAMILIES = {
    "v32-sparse": Family("deepseek_v32", "DeepseekV32Config", "DeepseekV32ForCausalLM",
                         {**TINY, **MOE, **MLA, **INDEX, "index_topk": 8, "n_group": 4, "topk_group": 2,
                          "rope_theta": 10000.0, "rope_scaling": YARN}),
    "v32-dense": Family("deepseek_v32", "DeepseekV32Config", "DeepseekV32ForCausalLM",
                        {**TINY, **MOE, **MLA, **INDEX, "index_topk": 256, "n_group": 2, "topk_group": 1,
                         "rope_theta": 5000.0, "attention_bias": True}),
    "glm5-sparse": Family("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                          {**TINY, **MOE, **MLA, **INDEX, "num_hidden_layers": 4, "index_topk": 6, "n_group": 1,
                           "topk_group": 1, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
                           "indexer_types": ["full", "shared", "full", "shared"]}),
    "glm5-dense": Family("glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                         {**TINY, **MOE, **MLA, **INDEX, "index_topk": 512, "n_group": 1, "topk_group": 1,
                          "rope_theta": 10000.0}),
}
MAIN = ["v32-sparse", "glm5-sparse"]
LISTS = ("layer_types", "mlp_layer_types", "indexer_types")  # per-layer config lists


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def mtp_only_tensors(H: int, V: int) -> dict[str, tuple[int, ...]]:
    return {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H), "shared_head.norm.weight": (H,),
            "shared_head.head.weight": (V, H), "embed_tokens.weight": (V, H)}


@dataclass
class Reference:
    path: object
    hf: object  # transformers' backbone
    mtp_layer: object  # transformers' decoder layer holding the MTP layer's decoder weights (its indexer included)
    rotary: object
    config: object


def build_reference(fam: Family, path, seed: int = 0) -> Reference:
    L = fam.kw["num_hidden_layers"]
    transformers = hf_transformers()
    hf_cfg_cls, hf_cls = getattr(transformers, fam.hf_config), getattr(transformers, fam.hf_model)
    big_kw = {**fam.kw, "num_hidden_layers": L + 1}
    if "indexer_types" in fam.kw:
        big_kw["indexer_types"] = fam.kw["indexer_types"] + ["full"]  # the MTP layer has its own indexer
    torch.manual_seed(seed)
    big = hf_cls(hf_cfg_cls(**big_kw)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in big.named_parameters():  # norm weights near 1, the rest (the indexers' LayerNorm bias too) near 0
            p.copy_((n.endswith("norm.weight")) + 0.2 * torch.randn(p.shape, generator=g))
        for n, b in big.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    big.save_pretrained(path / "big")
    state = load_file(path / "big" / "model.safetensors")
    prefix = f"model.layers.{L}."
    for name, shape in mtp_only_tensors(fam.kw["hidden_size"], fam.kw["vocab_size"]).items():
        state[prefix + name] = ("norm" in name) + 0.2 * torch.randn(shape, generator=g)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "big" / "config.json").read_text())
    cfg["num_hidden_layers"] = L
    for key in LISTS:
        if key in cfg:
            cfg[key] = cfg[key][:L]
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


def decode_steps(model, ids: torch.Tensor, start: int, eager: bool) -> torch.Tensor:
    """Logits of ids[:, start:] by 1-token decode forwards after a prefill of ids[:, :start] ([B, T-start, V]);
    eager: attention row by row (`pos.starts`), else the masked form a compiled graph runs."""
    B, T = ids.shape
    model.prepare_decode(T + 8)
    cache = model.new_cache(B, T + 8)
    model(ids[:, :start], cache)
    out = []
    for p in range(start, T):
        index = torch.full((B, 1), p)
        hidden, _ = model.decode(ids[:, p : p + 1], cache, model.decode_positions(index, [p] * B if eager else None))
        out.append(model.head(hidden))
    return torch.cat(out, 1)


# ---------------------------------------------------------------------- backbone parity
@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_backbone_logits_match_transformers_prefill_and_cached(reference, name):
    fam, ref = FAMILIES[name], reference(name)
    ours = load(ref.path)
    assert type(ours).__name__ == {"deepseek_v32": "DeepseekV32ForCausalLM",
                                   "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[fam.model_type] and ours.has_mtp
    ids = torch.randint(0, 64, (2, 90), generator=torch.Generator().manual_seed(1))  # past YaRN's original 64
    want = ref.hf(ids).logits
    torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
    cache = ours.new_cache(2, 128)  # prefill chunks, then one token at a time (the prefill path after cached tokens)
    cached = torch.cat([ours(ids[:, :70], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(70, 90)], 1)
    torch.testing.assert_close(cached, want, atol=1e-4, rtol=0)
    for eager in (True, False):  # the decode forwards the decoder runs (eager rows; the compiled graph's masked form)
        torch.testing.assert_close(decode_steps(ours, ids, 70, eager), want[:, 70:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["v32-sparse", "glm5-sparse"])
@torch.no_grad()
def test_dense_below_topk_and_sparse_above(reference, name, tmp_path):
    """Contexts of at most index_topk keys are dense attention: the same logits as DeepSeek-V3 with the indexers
    dropped. Longer ones are not (the indexer's choice matters)."""
    ref = reference(name)
    ours = load(ref.path)
    k = ours.config.index_topk
    dense_dir = tmp_path / "dense"
    dense_dir.mkdir()
    state = {n: t for n, t in load_file(ref.path / "model.safetensors").items() if ".indexer." not in n}
    save_file(state, dense_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((ref.path / "config.json").read_text())
    cfg = {k_: v for k_, v in cfg.items() if k_ not in LISTS and not k_.startswith("index")}
    (dense_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3",
                                                       "architectures": ["DeepseekV3ForCausalLM"]}))
    dense = load(dense_dir)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours(ids[:, :k]), dense(ids[:, :k]), atol=1e-5, rtol=0)
    assert (ours(ids) - dense(ids))[0, k:].abs().max() > 1e-2


# ---------------------------------------------------------------------- the selection rule
def test_selection_keeps_the_k_best_earliest_first_whatever_the_slots():
    scores = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 2.0, 5.0])
    assert select_keys(scores, None, 4).tolist() == [True, False, True, True, False, False, True]  # ties: earliest
    assert select_keys(scores, None, 7).all() and select_keys(scores, None, 9).all()  # at most k keys: dense
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        S, k = int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        s = torch.randint(0, 4, (S,), generator=g).float()  # many ties
        order = torch.sort(-s, stable=True).indices[:k]  # a stable descending sort
        want = torch.zeros(S, dtype=torch.bool)
        want[order] = True
        assert torch.equal(select_keys(s, None, k), want)
        # the same keys among junk slots that are not allowed, and as one row of a batch
        pad = torch.randint(0, 9, (7,), generator=g).float()
        allowed = torch.cat([torch.ones(S, dtype=torch.bool), torch.zeros(7, dtype=torch.bool)])
        batch = torch.stack([torch.cat([s, pad]), torch.rand(S + 7, generator=g)])
        got = select_keys(batch, torch.stack([allowed, torch.ones(S + 7, dtype=torch.bool)]), k)
        assert torch.equal(got[0, :S], want) and not got[0, S:].any()


# ---------------------------------------------------------------------- the MTP layer, written out
@pytest.mark.parametrize("name", MAIN)
@torch.no_grad()
def test_mtp_logits_follow_the_equations(reference, name):
    """Depths 1 and 2 by hand over transformers' decoder layer with the MTP layer's weights, its indexer included (it
    chooses keys over the MTP's own positions: the sequences here are longer than index_topk)."""
    fam, ref = FAMILIES[name], reference(name)
    ours = load(ref.path)
    L, eps = fam.kw["num_hidden_layers"], ref.config.rms_norm_eps
    with read_tensors(ref.path) as t:
        sd = {k: t.tensor(k).clone() for k in t}
    p = f"model.layers.{L}."
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(3))
    T = ids.shape[1]
    h = ref.hf.model(ids).last_hidden_state
    got = ours.mtp_logits(ids, 2)
    prev = h[0]
    for d in (1, 2):
        n = T - d
        e = sd[p + "embed_tokens.weight"][ids[0, d:]]
        x = torch.cat([rms(e, sd[p + "enorm.weight"], eps), rms(prev[:n], sd[p + "hnorm.weight"], eps)], -1) \
            @ sd[p + "eh_proj.weight"].T
        pe = ref.rotary(x[None], torch.arange(n)[None])
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        out = ref.mtp_layer(x[None], attention_mask=causal, position_embeddings=pe, position_ids=torch.arange(n)[None])
        out = out[0] if isinstance(out, tuple) else out  # GLM-5's layer also returns its top-k
        prev = rms(out[0], sd[p + "shared_head.norm.weight"], eps)
        torch.testing.assert_close(got[d - 1][0], prev @ sd[p + "shared_head.head.weight"].T, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_saved_checkpoint_keeps_every_name_and_loads_in_transformers(reference, name, tmp_path):
    fam, ref = FAMILIES[name], reference(name)
    ours = load(ref.path)
    mtp.save_model(ours, tmp_path)
    assert names(tmp_path) == names(ref.path)
    L = fam.kw["num_hidden_layers"]
    assert f"model.layers.{L}.self_attn.indexer.wq_b.weight" in names(tmp_path)  # the MTP layer's own indexer
    if "indexer_types" in fam.kw:  # IndexShare layers hold no indexer
        shared = [i for i, t in enumerate(fam.kw["indexer_types"]) if t == "shared"]
        assert shared and not any(f"model.layers.{i}.self_attn.indexer" in k for i in shared for k in names(tmp_path))
    hf_cls = getattr(hf_transformers(), fam.hf_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf2 = hf_cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(hf2(ids).logits, ref.hf(ids).logits, atol=1e-5, rtol=0)
    again = load(tmp_path)
    torch.testing.assert_close(again.mtp_logits(ids, 2)[1], ours.mtp_logits(ids, 2)[1], atol=0, rtol=0)


# ---------------------------------------------------------------------- decoding
def tiny_config(name: str, **over):
    """Our config of a family's tiny shape; no EOS token (decoding runs to its length)."""
    fam = FAMILIES[name]
    kw = {k: v for k, v in fam.kw.items() if k != "rope_scaling"}
    return config_from_dict({"model_type": fam.model_type, **kw, **fam.ours, "num_nextn_predict_layers": 1,
                             "eos_token_id": None, **over})


def tiny(name: str, seed: int = 0, std: float = 0.2, **over):
    config = tiny_config(name, **over)
    model = model_class_for(config)(config)
    mtp.model.init_weights_(model, std=std, seed=seed)
    return model.eval()


@pytest.mark.parametrize("name", MAIN)
@pytest.mark.parametrize("n_keep", [0, 1, 3, 5])
@torch.no_grad()
def test_verify_rows_equal_plain_steps_and_keep_leaves_plain_caches(name, n_keep):
    """A decode forward of 5 tokens computes each position bit for bit as its plain step (bf16, row-invariant
    kernels), in eager rows and in the compiled graph's masked form, and its caches (K/V and index keys) after keeping
    n equal n plain steps'. The context (40 + 5) is far past index_topk, so the choices are sparse."""
    model = copy.deepcopy(tiny(name, seed=1)).to(torch.bfloat16)
    model.prepare_for_inference()
    prompt = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(5))
    block = torch.tensor([[5, 1, 7, 2, 9]])
    P, S = prompt.shape[1], 64
    model.prepare_decode(S)
    with row_invariant():  # as the decoder runs its rounds (the MoE experts row by row)
        for eager in (True, False):
            spec = model.new_cache(1, S)
            model(prompt, spec)
            at = model.decode_positions(torch.arange(P, P + 5)[None], [P] if eager else None)
            hidden, steps = model.decode(block, spec, at)
            spec.keep_at(steps, torch.tensor([n_keep]))
            plain = model.new_cache(1, S)
            model(prompt, plain)
            for i in range(n_keep):
                h, _ = model.decode(block[:, i : i + 1], plain, model.decode_positions(torch.tensor([[P + i]]),
                                                                                       [P + i] if eager else None))
                assert torch.equal(h[0, 0], hidden[0, i]), (eager, i)
            for a, b in zip(spec.layers, plain.layers):
                assert torch.equal(a.k[:, :, : P + n_keep], b.k[:, :, : P + n_keep])
                assert torch.equal(a.v[:, :, : P + n_keep], b.v[:, :, : P + n_keep])
                if isinstance(a, IndexedKVCache):
                    assert torch.equal(a.ik[:, : P + n_keep], b.ik[:, : P + n_keep])


def trained(name: str, steps: int = 60, seed: int = 0, **over):
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


@pytest.mark.parametrize("name", MAIN)
def test_greedy_speculative_equals_plain(name, monkeypatch):
    """Contexts of 20-60 tokens against index_topk 6-8: almost every position attends sparsely."""
    model = trained(name)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = pattern_batch(8, 1, int(torch.randint(2, 30, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(model, prompt, max_new_tokens=30).tokens
        for k in (1, 2, 3, 4, 5, 6, "auto"):
            assert mtp.generate(model, prompt, max_new_tokens=30, draft_tokens=k).tokens == want, k
    assert scripted_drafts_patterns(model, prompt, monkeypatch) == {"none", "some", "all"}


@pytest.mark.parametrize("name", MAIN)
def test_batched_greedy_equals_solo(name):
    from test_batch import greedy_requests, run_batched

    model = trained(name, seed=1)
    requests = greedy_requests(8, 6, seed=3, max_prompt=40)
    for draft_tokens in (None, 3):
        sessions = run_batched(model, requests, draft_tokens)
        for (prompt, max_new, _, _), s in zip(requests, sessions):
            assert s.new_tokens == mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=draft_tokens).tokens


def test_tied_scores_choose_the_earliest_keys_in_every_path():
    """With the indexers' query projections zeroed every index score is 0: all keys tie and each query keeps its
    index_topk earliest keys. The attention then equals dense attention over those keys only (checked by hand on a
    layer), and decoding with ties stays lossless."""
    model = trained("v32-sparse", steps=20, seed=2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SparseMLAttention) and m.indexer is not None:
                m.indexer.wq_b.weight.zero_()
        k = model.config.index_topk
        attn = model.model.layers[0].self_attn
        x = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(6))
        pos = model.positions(0, 20)
        out, _ = attn(x, pos)
        chosen = pos.key_selection[0][0]
        want = torch.ones(20, 20, dtype=torch.bool).tril()
        want[k:, k:] = False  # queries past k keep keys 0..k-1
        assert torch.equal(chosen, want)
        q, kk, v, _ = attn.project(x, pos)
        by_hand = F.scaled_dot_product_attention(q, kk, v, attn_mask=want, scale=attn.scale)
        torch.testing.assert_close(out, attn.o_proj(by_hand.transpose(1, 2).reshape(1, 20, -1)), atol=1e-6, rtol=0)
    prompt = list(range(8)) * 3
    want_tokens = mtp.generate(model, prompt, max_new_tokens=20).tokens
    for kd in (2, 5):
        assert mtp.generate(model, prompt, max_new_tokens=20, draft_tokens=kd).tokens == want_tokens


# ---------------------------------------------------------------------- training, heal
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_data import build_toy

    return build_toy(tmp_path_factory.mktemp("toy"))


@pytest.mark.parametrize("name", MAIN)
def test_pretrain_heads_and_finetune_through_mtp_train(data, tmp_path, name):
    from mtp.train.trainer import train
    from test_train import cfg, rows

    fam = FAMILIES[name]
    model_keys = {k: v for k, v in fam.kw.items() if k not in ("vocab_size", "rope_scaling")}
    train(cfg(data, tmp_path / "pre", model={"model_type": fam.model_type, **model_keys, "num_nextn_predict_layers": 1},
              max_steps=2, eval_every=2))
    base = tmp_path / "pre" / "model"
    m = load(base)
    assert type(m.config).model_types[0] == fam.model_type and m.has_mtp
    train(cfg(data, tmp_path / "h", mode="heads", init=str(base), model={}, max_steps=3, lr=1e-2, eval_every=3))
    is_mtp = lambda k: type(m).is_mtp_tensor(k, m.config)  # noqa: E731
    with read_tensors(base) as before, read_tensors(tmp_path / "h" / "model") as after:
        assert set(before) == set(after)
        for k in before:
            if not is_mtp(k):
                assert torch.equal(before.tensor(k), after.tensor(k)), k
        assert any(not torch.equal(before.tensor(k), after.tensor(k)) for k in before if is_mtp(k))
    assert all(len(r["mtp"]) == 1 for r in rows(tmp_path / "h"))
    train(cfg(data, tmp_path / "f", mode="finetune", init=str(base), model={}, max_steps=2, eval_every=2))
    assert names(tmp_path / "f" / "model") == names(base)


@pytest.mark.parametrize("name", MAIN)
def test_heal_grafts_the_mtp_layer_back(tmp_path, name):
    from mtp.train.heal import graft

    model = tiny(name, seed=6)
    L = model.config.num_hidden_layers
    for out in ("base", "ft"):
        mtp.save_model(model, tmp_path / out)
    f = tmp_path / "ft" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not type(model).is_mtp_tensor(k, model.config)}, f)
    grafted = graft(tmp_path / "base", tmp_path / "ft", tmp_path / "out")
    assert set(grafted) == {k for k in names(tmp_path / "base") if k.startswith(f"model.layers.{L}.")}
    assert f"model.layers.{L}.self_attn.indexer.weights_proj.weight" in grafted
    assert names(tmp_path / "out") == names(tmp_path / "base")
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(load(tmp_path / "out").mtp_logits(ids)[0], model.mtp_logits(ids)[0], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- configs
DEEPSEEK_V32_CONFIG = {  # DeepSeek-V3.2-Exp's config.json keys (bf16 weights: no quantization_config)
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168,
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
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
}
GLM5_CONFIG = {  # GLM-5's config.json keys (bf16 weights)
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": False,
    "attention_dropout": 0.0, "pad_token_id": 154820, "eos_token_id": [154820, 154827, 154829], "bos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 6144, "head_dim": 192, "intermediate_size": 12288, "index_head_dim": 128,
    "index_n_heads": 32, "index_topk": 2048, "kv_lora_rank": 512, "max_position_embeddings": 202752,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64, "num_nextn_predict_layers": 1,
    "q_lora_rank": 2048, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_interleave": True, "indexer_rope_interleave": True, "rope_parameters": {"rope_theta": 1000000,
                                                                                  "rope_type": "default"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_method": "noaux_tc",
    "dtype": "bfloat16", "v_head_dim": 256, "vocab_size": 154880,
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75,
}


@pytest.mark.parametrize("cls, data", [(DeepseekV32Config, DEEPSEEK_V32_CONFIG), (GlmMoeDsaConfig, GLM5_CONFIG)])
def test_real_configs_round_trip_keeping_every_key(cls, data, tmp_path):
    cfg = cls.from_hf_dict(data)
    assert cfg.to_hf_dict() == data
    assert cfg.mtp_num_hidden_layers == 1 and cfg.index_topk == 2048
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert type(mtp.model.config_from_json(tmp_path / "config.json")) is cls
    assert all(cfg.indexer_type(i) == "full" for i in range(cfg.num_hidden_layers + 1))
    assert [cfg.is_moe_layer(i) for i in (2, 3, cfg.num_hidden_layers)] == [False, True, True]
    assert cfg.indexer_rope_interleave == (cls is GlmMoeDsaConfig)


def test_indexshare_schedules_match_transformers():
    transformers = hf_transformers()
    for kw in ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, {"index_topk_pattern": "FSSFSFFS"},
               {"index_topk_freq": 2}):
        ours = GlmMoeDsaConfig(num_hidden_layers=8, **kw)
        hf = transformers.GlmMoeDsaConfig(num_hidden_layers=8, **kw)
        assert [ours.indexer_type(i) for i in range(8)] == hf.indexer_types, kw


@pytest.mark.parametrize("cls, data, mutate, key", [
    (DeepseekV32Config, DEEPSEEK_V32_CONFIG, dict(q_lora_rank=None), "q_lora_rank"),
    (DeepseekV32Config, DEEPSEEK_V32_CONFIG, dict(index_topk=0), "index_topk"),
    (DeepseekV32Config, DEEPSEEK_V32_CONFIG, dict(index_head_dim=32), "index_head_dim"),
    (DeepseekV32Config, DEEPSEEK_V32_CONFIG, dict(mlp_layer_types=["dense"] * 60), "mlp_layer_types"),
    (DeepseekV32Config, DEEPSEEK_V32_CONFIG, dict(layer_types=["full_attention"] * 61), "layer_types"),
    (GlmMoeDsaConfig, GLM5_CONFIG, dict(indexer_types=["shared"] + ["full"] * 77), "indexer_types"),
    (GlmMoeDsaConfig, GLM5_CONFIG, dict(indexer_types=["full", "both"] + ["full"] * 76), "indexer_types"),
    (GlmMoeDsaConfig, GLM5_CONFIG, dict(index_topk_pattern="FX" + "F" * 76), "index_topk_pattern"),
    (GlmMoeDsaConfig, GLM5_CONFIG, dict(index_topk_pattern="F" * 77), "index_topk_pattern"),
    (GlmMoeDsaConfig, GLM5_CONFIG, dict(index_topk_freq=0), "index_topk_freq"),
])
def test_bad_config_values_name_the_key(cls, data, mutate, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        cls.from_hf_dict({**data, **mutate})


@pytest.mark.parametrize("name", MAIN)
def test_missing_indexer_tensor_is_named(reference, tmp_path, name):
    ref = reference(name)
    shutil.copytree(ref.path, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(f)
    state.pop("model.layers.0.self_attn.indexer.k_norm.bias")
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(mtp.CheckpointError, match="missing tensor.*model.layers.0.self_attn.indexer.k_norm.bias"):
        mtp.load_model(tmp_path / "m")


@pytest.mark.parametrize("name", MAIN)
def test_prompts_from_the_cache_decode_as_cold_reads(name):
    """The sparse-attention layers' index keys come with a prompt-cache snapshot (`IndexedKVCache.snapshot`)."""
    from test_prompt_cache import decode_one_by_one, requests

    model = trained(name, seed=2, max_position_embeddings=1024)
    reqs = requests(model.config.vocab_size)
    for draft_tokens in (None, 3):
        cold = decode_one_by_one(model, reqs, draft_tokens, None)
        warm = decode_one_by_one(model, reqs, draft_tokens, PromptCache(1 << 30))
        assert [w.new_tokens for w in warm] == [c.new_tokens for c in cold]
        assert warm[2].stats.prompt_cached == len(reqs[2][0])
