"""Numerical parity with transformers' Qwen3_5ForCausalLM (the executable reference), both directions."""

import pytest
import torch

import mtp
from conftest import assert_greedy_agrees, tiny_model

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "hybrid-tied": dict(),
    "hybrid-untied": dict(tie_word_embeddings=False),
    "all-attention": dict(full_attention_interval=1),
    "hybrid-hv-eq-hk": dict(linear_num_value_heads=2, num_key_value_heads=4),
    "mostly-linear": dict(num_hidden_layers=5, full_attention_interval=5, linear_conv_kernel_dim=3),
}


def hf_cached_logits(hf, ids, split):
    out = hf(ids[:, :split], use_cache=True)
    cache, logits = out.cache, [out.logits]
    for i in range(split, ids.shape[1]):
        out = hf(ids[:, i : i + 1], cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_logits_match_transformers_prefill_and_cached(name, tmp_path):
    model = tiny_model(seed=3, **CONFIGS[name])
    mtp.save_model(model, tmp_path)  # written by mtp, read by transformers
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    torch.testing.assert_close(model(ids), ref, atol=1e-4, rtol=0)
    cache = model.new_cache(2, 128)
    ours = torch.cat([model(ids[:, :70], cache)] + [model(ids[:, i : i + 1], cache) for i in range(70, 90)], 1)
    torch.testing.assert_close(ours, hf_cached_logits(hf, ids, 70), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
@torch.no_grad()
def test_checkpoint_written_by_transformers_loads(tied, tmp_path):
    cfg = tiny_model(tie_word_embeddings=tied).config
    hf_cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures",)})
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # transformers initialises norms to 0: randomise so a wrong norm cannot hide
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    with pytest.warns(mtp.MissingMTPWarning):  # transformers drops mtp.* - exactly the case we warn about
        ours = mtp.load_model(tmp_path)
    assert not ours.has_mtp
    ids = torch.randint(0, cfg.vocab_size, (1, 50), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["hybrid-tied", "all-attention"])
def test_greedy_generate_matches_transformers(name, tmp_path):
    model = tiny_model(seed=5, vocab_size=16, **CONFIGS[name])
    mtp.save_model(model, tmp_path)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for s in range(4):
        ids = torch.randint(0, 16, (1, 6 + 5 * s), generator=torch.Generator().manual_seed(s))
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        plain = mtp.generate(model, ids, max_new_tokens=30).tokens
        assert_greedy_agrees(model, ids[0].tolist(), plain, want)  # two implementations: equal up to a near-tie
        assert mtp.generate(model, ids, max_new_tokens=30, draft_tokens=3).tokens == plain  # ours: equal, bit for bit
