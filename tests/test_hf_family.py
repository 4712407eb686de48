"""The generic family (`model/hf_causal.py`): any supported transformers causal LM behind the seam. Logits and greedy
output against transformers itself (saved with `save_pretrained`, loaded by `mtp.load_model`), lossless speculative
decoding with an attached MTP module, batched == solo, save/load, and the refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import mtp
from conftest import assert_greedy_agrees, scripted_drafts_patterns
from mtp.config import ConfigError
from mtp.model.families import config_from_dict

transformers = pytest.importorskip("transformers")

V = 96
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)
# model_type -> (transformers config class, extra keys): each an architecture the family lists as SUPPORTED.
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 7}),  # a window shorter than the sequences: it matters
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
    "gemma": ("GemmaConfig", {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                                  "logits_scaling": 4.0}),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
}
MAIN = ["llama", "qwen3", "mistral"]


def hf_config(arch: str, **over):
    cls, extra = ARCHS[arch]
    kw = {**COMMON, **extra, **over}
    return getattr(transformers, cls)(**kw)


def hf_model(arch: str, seed: int = 0, std: float = 0.1, **over):
    """A random transformers model (sdpa attention) with weights large enough for peaked logits."""
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **over), attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
            elif "norm" in name and arch != "gemma":
                p.uniform_(0.8, 1.2)
    return ref.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> (transformers model, folder it saved itself to)."""
    out = {}
    for arch in ARCHS:
        ref = hf_model(arch)
        path = tmp_path_factory.mktemp(arch)
        ref.save_pretrained(path)
        out[arch] = (ref, path)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.no_grad()
def test_logits_equal_transformers_prefill_and_cached(saved, arch):
    ref, path = saved[arch]
    model = mtp.load_model(path)
    assert type(model).__name__ == "HFCausalLM" and model.mtp is None
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    want = ref(ids).logits
    torch.testing.assert_close(model(ids), want, atol=1e-4, rtol=0)
    # prefill in pieces through the cache, then one token at a time: each position as the full forward gives it
    cache = model.new_cache(1, 64)
    got = [model(ids[:1, :9], cache), model(ids[:1, 9:13], cache)]
    got += [model(ids[:1, t : t + 1], cache) for t in range(13, 20)]
    torch.testing.assert_close(torch.cat(got, 1), want[:1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
@torch.no_grad()
def test_greedy_output_equals_transformers_generate(saved, arch):
    ref, path = saved[arch]
    model = mtp.load_model(path)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        prompt = torch.randint(0, V, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        ours = mtp.generate(model, prompt, max_new_tokens=24).tokens
        ids = torch.tensor([prompt])  # the mask given: generate would mask a prompt token equal to pad_token_id
        theirs = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert_greedy_agrees(model, prompt, ours, theirs)


def with_mtp(arch: str, layers: int = 1, seed: int = 0, steps: int = 40):
    """Our model of `arch` with `layers` MTP layers trained briefly (the backbone too) on a repeating pattern, so that
    drafts are accepted sometimes."""
    from conftest import pattern_batch

    d = hf_config(arch, vocab_size=8).to_dict()
    d["mtp_num_hidden_layers"] = layers
    config = config_from_dict(d)
    torch.manual_seed(seed)
    model = type_for(config)(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = pattern_batch(8, 8, 32, gen)
        h = model.hidden(ids)
        loss = torch.nn.functional.cross_entropy(model.head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        for dd, hd in enumerate(model.mtp_hidden_states(ids, hidden=h), start=1):
            loss = loss + torch.nn.functional.cross_entropy(model.mtp_head(hd[:, :-1], dd).flatten(0, 1),
                                                            ids[:, dd + 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def type_for(config):
    from mtp.model.families import model_class_for

    return model_class_for(config)


@pytest.mark.parametrize("arch, layers", [("llama", 1), ("qwen3", 2), ("mistral", 1)])
def test_greedy_speculative_equals_plain(arch, layers, monkeypatch):
    from conftest import pattern_batch

    model = with_mtp(arch, layers)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = pattern_batch(8, 1, int(torch.randint(2, 16, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(model, prompt, max_new_tokens=24).tokens
        for k in (1, 2, 3, 5, "auto"):
            assert mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k).tokens == want, k
    assert scripted_drafts_patterns(model, prompt, monkeypatch) == {"none", "some", "all"}


@pytest.mark.parametrize("draft_tokens", [None, 3])
def test_batched_equals_solo(draft_tokens):
    from test_batch import greedy_requests, run_batched

    model = with_mtp("mistral")
    requests = greedy_requests(8, 5, seed=3, max_prompt=40)
    for (prompt, max_new, _, _), s in zip(requests, run_batched(model, requests, draft_tokens)):
        assert s.new_tokens == mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=draft_tokens).tokens


def test_save_load_round_trip_and_transformers_reads_the_backbone(tmp_path):
    model = with_mtp("qwen3", layers=2, steps=2)
    with torch.no_grad():
        mtp.save_model(model, tmp_path / "m")
        cfg = json.loads((tmp_path / "m" / "config.json").read_text())
        assert cfg["model_type"] == "qwen3" and cfg["mtp_num_hidden_layers"] == 2
        back = mtp.load_model(tmp_path / "m")
        assert back.mtp is not None and back.mtp.num_layers == 2
        for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items()):
            assert n == m and torch.equal(a, b), n
        ids = torch.randint(0, 8, (1, 12))
        torch.testing.assert_close(back.mtp_logits(ids)[1], model.mtp_logits(ids)[1], atol=0, rtol=0)
        # transformers loads the same folder as a plain Qwen3 (our mtp.* tensors are unexpected keys it drops)
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
        torch.testing.assert_close(ref(ids).logits, model(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type, words", [("mixtral", "mixture-of-experts"), ("mamba", "recurrent"),
                                               ("jamba", "recurrent"), ("gemma2", "soft-capping"),
                                               ("bloom", "ALiBi"), ("totally_new", "supported:")])
def test_refused_architectures_say_why(tmp_path, model_type, words):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
    with pytest.raises(ConfigError, match=words):
        mtp.load_model(tmp_path)


def test_moe_keys_and_bad_values_are_refused():
    base = copy.deepcopy(hf_config("llama").to_dict())
    with pytest.raises(ConfigError, match="num_local_experts"):
        config_from_dict({**base, "num_local_experts": 8})
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_dict({**base, "hidden_size": "64"})
