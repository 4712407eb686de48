"""Meta's multi-token prediction checkpoints: `mtp convert` on a tiny release written exactly in the released format
(`consolidated.pth` with the release's tensor names, `params.json` with its keys, `tokenizer.model` beside the
checkpoint folder), then the converted model against the release's own forward, written out below from its published
equations (`MetaReference`: Meta's pair-wise complex RoPE, the trunk = `layers[:-1]`, every head on the trunk's
output, the shared norm and output) and against transformers' `LlamaForCausalLM` (which reads the converted folder);
lossless speculative decoding with parallel drafting, training, heal, the tokenizer, and bad releases.

The Llama family (`model/llama.py`) is tested here too: it is what a converted release loads as."""

from __future__ import annotations

import json
import math
import pickle
import random
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import mtp
from conftest import pattern_batch, scripted_drafts_patterns
from mtp.config import ConfigError, LlamaConfig
from mtp.io import read_tensors
from mtp.model import config_from_dict
from mtp.model.families import model_class_for

sentencepiece = pytest.importorskip("sentencepiece")

PARAMS = {"dim": 32, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "vocab_size": -1, "multiple_of": 16,
          "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 10000.0, "n_future_tokens": 4}


def hf_transformers():
    return pytest.importorskip("transformers")


# ---------------------------------------------------------------------- the release's model, from its equations
class MetaBlock(nn.Module):
    """A release `TransformerBlock`: attention (wq/wk/wv/wo, RoPE on adjacent pairs, GQA) and SwiGLU (w1/w2/w3),
    each after an RMSNorm (attention_norm / ffn_norm), with residuals."""

    def __init__(self, p: dict, hidden: int):
        super().__init__()
        dim, heads, kv = p["dim"], p["n_heads"], p["n_kv_heads"]
        D = dim // heads
        self.heads, self.kv, self.D, self.eps = heads, kv, D, p["norm_eps"]
        self.attention = nn.Module()
        for name, shape in (("wq", (heads * D, dim)), ("wk", (kv * D, dim)), ("wv", (kv * D, dim)), ("wo", (dim, heads * D))):
            self.attention.add_module(name, nn.Linear(shape[1], shape[0], bias=False))
        self.feed_forward = nn.Module()
        for name, shape in (("w1", (hidden, dim)), ("w2", (dim, hidden)), ("w3", (hidden, dim))):
            self.feed_forward.add_module(name, nn.Linear(shape[1], shape[0], bias=False))
        self.attention_norm = nn.Module()
        self.attention_norm.weight = nn.Parameter(torch.ones(dim))
        self.ffn_norm = nn.Module()
        self.ffn_norm.weight = nn.Parameter(torch.ones(dim))

    def rms(self, x, w):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * w

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        a = self.attention
        h = self.rms(x, self.attention_norm.weight)
        q = a.wq(h).view(B, T, self.heads, self.D)
        k = a.wk(h).view(B, T, self.kv, self.D)
        v = a.wv(h).view(B, T, self.kv, self.D)
        # Meta's RoPE: each adjacent pair (x_{2i}, x_{2i+1}) is a complex number turned by e^{i t theta_i}
        rot = lambda t: torch.view_as_real(torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))  # noqa: E731
                                           * freqs_cis[None, :, None, :]).flatten(3).type_as(t)
        q, k = rot(q), rot(k)
        rep = self.heads // self.kv
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(2, 3) / math.sqrt(self.D)
        scores = scores + torch.full((T, T), float("-inf")).triu(1)
        out = (F.softmax(scores.float(), dim=-1).type_as(q) @ v).transpose(1, 2).reshape(B, T, -1)
        h = x + a.wo(out)
        f = self.feed_forward
        g = self.rms(h, self.ffn_norm.weight)
        return h + f.w2(F.silu(f.w1(g)) * f.w3(g))


class MetaReference(nn.Module):
    """The release's `Transformer`: `tok_embeddings`, `layers` (n_layers - n_future_tokens + 1), `extra_heads`
    (n_future_tokens - 1), `norm`, `output`; forward returns logits [B, T, n_future_tokens, V] (all heads)."""

    def __init__(self, p: dict, vocab: int):
        super().__init__()
        n = p["n_future_tokens"]
        hidden = int(2 * 4 * p["dim"] / 3)
        hidden = int(p["ffn_dim_multiplier"] * hidden) if p["ffn_dim_multiplier"] else hidden
        hidden = p["multiple_of"] * ((hidden + p["multiple_of"] - 1) // p["multiple_of"])
        self.p = p
        self.tok_embeddings = nn.Embedding(vocab, p["dim"])
        self.layers = nn.ModuleList([MetaBlock(p, hidden) for _ in range(p["n_layers"] - n + 1)])
        self.extra_heads = nn.ModuleList([MetaBlock(p, hidden) for _ in range(n - 1)])
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(p["dim"]))
        self.output = nn.Linear(p["dim"], vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        D = self.p["dim"] // self.p["n_heads"]
        freqs = 1.0 / (self.p["rope_theta"] ** (torch.arange(0, D, 2)[: D // 2].float() / D))
        freqs_cis = torch.polar(torch.ones(T, D // 2), torch.outer(torch.arange(T).float(), freqs))
        h = self.tok_embeddings(tokens)
        for layer in self.layers[:-1]:
            h = layer(h, freqs_cis)
        trunk = h
        latents = torch.stack([layer(trunk, freqs_cis) for layer in [self.layers[-1], *self.extra_heads]], dim=-2)
        x = latents.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.p["norm_eps"])).type_as(latents) * self.norm.weight
        return self.output(x).float()


def train_sentencepiece(prefix, vocab_size: int = 320) -> str:
    """A tiny SentencePiece BPE model with Llama 2's settings (byte fallback, a dummy prefix, identity
    normalization, spaces kept, digits split), trained here on standard-library text."""
    import textwrap

    lines = open(textwrap.__file__).read().splitlines() + open(json.__file__).read().splitlines()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, character_coverage=0.99, num_threads=1, minloglevel=2, allow_whitespace_only_pieces=True)
    return str(prefix) + ".model"


def write_release(root, params: dict = PARAMS, seed: int = 0, dtype=torch.float32, vocab: int | None = None):
    """A release as Meta ships it: root/tokenizer.model and root/7B_tiny/{consolidated.pth, params.json}."""
    root.mkdir(parents=True, exist_ok=True)
    sp_file = train_sentencepiece(root / "tokenizer")
    (root / "tokenizer.vocab").unlink()
    V = vocab or sentencepiece.SentencePieceProcessor(model_file=sp_file).get_piece_size()
    torch.manual_seed(seed)
    ref = MetaReference(params, V).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(("norm" in n) + (0.1 if "norm" in n else 0.3) * torch.randn(p.shape))
    ckpt = root / "7B_tiny"
    ckpt.mkdir()
    torch.save({k: v.to(dtype) for k, v in ref.state_dict().items()}, ckpt / "consolidated.pth")
    (ckpt / "params.json").write_text(json.dumps(params))
    return ckpt, ref


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mtp.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta")
    ckpt, ref = write_release(root / "release")
    out = root / "converted"
    proc = run_cli("convert", str(ckpt), str(out))
    assert proc.returncode == 0, proc.stderr
    assert "3 parallel MTP heads" in proc.stdout
    return ckpt, ref, out


def load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error", mtp.MissingMTPWarning)
        return mtp.load_model(path, **kw)


def names(path) -> set[str]:
    with read_tensors(path) as t:
        return set(t)


# ---------------------------------------------------------------------- conversion
def test_converted_layout_config_and_names(release):
    _, _, out = release
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 3 and cfg["mtp_num_hidden_layers"] == 3
    # SwiGLU width: int(2 * 4 * 32 / 3) = 85, x 1.3 = 110, rounded up to a multiple of 16
    assert cfg["mtp_style"] == "parallel" and cfg["intermediate_size"] == 112 and cfg["num_key_value_heads"] == 2
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2 and cfg["rms_norm_eps"] == 1e-5
    keys = names(out)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.2.self_attn.q_proj.weight",
            "mtp.layers.2.mlp.down_proj.weight"} <= keys
    assert not any(k.startswith("model.layers.3.") or k.startswith("mtp.layers.3.") for k in keys)
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()


@torch.no_grad()
def test_every_head_equals_the_release_forward(release):
    """Backbone = the release's next-token head, MTP depth d = its head d + 1 (extra_heads[d - 1]), at every position."""
    _, ref, out = release
    ours = load(out)
    assert type(ours).__name__ == "LlamaForCausalLM" and ours.mtp.num_layers == 3 and ours.mtp.style == "parallel"
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    want = ref(ids)  # [B, T, 4, V]
    torch.testing.assert_close(ours(ids), want[:, :, 0], atol=1e-4, rtol=0)
    for d, got in enumerate(ours.mtp_logits(ids, 3), start=1):
        torch.testing.assert_close(got, want[:, : 40 - d, d], atol=1e-4, rtol=0)


@torch.no_grad()
def test_backbone_matches_transformers_prefill_and_cached(release):
    _, _, out = release
    transformers = hf_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers reports the mtp.* tensors it does not use
        hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load(out)
    ids = torch.randint(0, ours.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(2))
    want = hf(ids).logits
    torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
    cache = ours.new_cache(2, 64)
    cached = torch.cat([ours(ids[:, :45], cache)] + [ours(ids[:, i : i + 1], cache) for i in range(45, 60)], 1)
    torch.testing.assert_close(cached, want, atol=1e-4, rtol=0)


def test_tokenizer_encodes_and_decodes_as_sentencepiece(release):
    ckpt, _, out = release
    sp = sentencepiece.SentencePieceProcessor(model_file=str(ckpt.parent / "tokenizer.model"))
    tok = load(out).tokenizer
    samples = ["def fibonacci(n):\n    return n", "  two  spaces   and\ttabs", "héllo wörld \u2713 日本語 1234567",
               " leading", "trailing ", "", "a", "\n\n\n"] + random.Random(0).sample(open(json.__file__).read().splitlines(), 60)
    for s in samples:
        ids = sp.encode(s)
        assert tok.encode(s) == ids, repr(s)
        assert tok.decode(ids) == sp.decode(ids), repr(s)
    assert tok.eos_token_id == sp.eos_id() == 2


def test_bf16_release_stays_bf16(tmp_path):
    ckpt, ref = write_release(tmp_path / "r", dtype=torch.bfloat16, seed=3)
    assert run_cli("convert", str(ckpt), str(tmp_path / "out")).returncode == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    ours = mtp.load_model(tmp_path / "out")
    assert ours.dtype == torch.bfloat16
    ids = torch.randint(0, ours.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # against the release's forward in fp32 on the same (bf16-rounded) weights: bf16's rounding
        for prm in ref.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
        want = ref(ids)[:, :19, 1]
        got = ours.mtp_logits(ids, 1)[0].float()
        assert float((got - want).norm() / want.norm()) < 0.05  # measured 0.025; a wrong head or order: ~1.4


# ---------------------------------------------------------------------- decoding
def test_greedy_speculative_equals_plain_with_parallel_drafting(release, monkeypatch):
    _, _, out = release
    model = load(out)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, model.config.vocab_size, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        want = mtp.generate(model, prompt, max_new_tokens=20).tokens
        for k in (1, 2, 3, "auto"):  # parallel heads draft at most one token per head: 3
            assert mtp.generate(model, prompt, max_new_tokens=20, draft_tokens=k).tokens == want, k
    with pytest.raises(ValueError, match="1..3"):
        mtp.generate(model, prompt, max_new_tokens=4, draft_tokens=4)
    assert scripted_drafts_patterns(model, prompt, monkeypatch, ks=(1, 2, 3)) == {"none", "some", "all"}



def test_batched_greedy_equals_solo(release):
    """Rows of one batch carry their [norm(h_L) | z] states (2H wide) between rounds: each row decodes what it does alone."""
    from test_batch import greedy_requests, run_batched

    _, _, out = release
    model = load(out)
    requests = greedy_requests(model.config.vocab_size, 5, seed=3, max_prompt=40)
    for k in (None, 3, "auto"):
        for (prompt, max_new, _, _), s in zip(requests, run_batched(model, requests, k, max_batch=3)):
            assert s.new_tokens == mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=k).tokens, k

TINY = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, mtp_num_hidden_layers=3, mtp_style="parallel")


def tiny(seed: int = 0, std: float = 0.2, **over):
    config = config_from_dict({"model_type": "llama", **TINY, **over})
    model = model_class_for(config)(config)
    mtp.model.init_weights_(model, std=std, seed=seed)
    return model.eval()


def trained(steps: int = 80, seed: int = 0):
    model = tiny(seed=seed, std=0.02).train()
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


def test_trained_heads_are_accepted_and_lossless():
    model = trained()
    g = torch.Generator().manual_seed(1)
    accepted = 0
    for _ in range(3):
        prompt = pattern_batch(8, 1, int(torch.randint(4, 16, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(model, prompt, max_new_tokens=24).tokens
        for k in (1, 2, 3, "auto"):
            r = mtp.generate(model, prompt, max_new_tokens=24, draft_tokens=k)
            assert r.tokens == want, k
            accepted += sum(r.stats.n_history)
    assert accepted > 0  # the heads draft something the backbone keeps (what else is accepted depends on the CPU)


@torch.no_grad()
def test_cached_head_steps_equal_teacher_forcing():
    model = tiny(seed=2, vocab_size=64)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(9))
    h = model.hidden(ids)
    assert h.shape[-1] == model.hidden_width == 64
    for d in (1, 3):
        want = model.mtp_step(d, h[:, :-d], None, 0)
        caches = model.new_mtp_cache(1, 32)
        got = torch.cat([model.mtp_step(d, h[:, a:b], None, a, caches) for a, b in ((0, 7), (7, 8), (8, 20 - d))], 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- training, heal, saves
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_data import build_toy

    return build_toy(tmp_path_factory.mktemp("toy"))


def test_pretrain_heads_and_finetune_through_mtp_train(data, tmp_path):
    from mtp.train.trainer import train
    from test_train import cfg

    keys = {k: v for k, v in TINY.items() if k != "vocab_size"}
    train(cfg(data, tmp_path / "pre", model={"model_type": "llama", **keys}, max_steps=2, eval_every=2, mtp_depth=3))
    base = tmp_path / "pre" / "model"
    m = load(base)
    assert type(m.config) is LlamaConfig and m.mtp.num_layers == 3
    train(cfg(data, tmp_path / "h", mode="heads", init=str(base), model={}, max_steps=3, lr=1e-2, eval_every=3, mtp_depth=3))
    with read_tensors(base) as before, read_tensors(tmp_path / "h" / "model") as after:
        assert set(before) == set(after)
        for k in before:
            if not k.startswith("mtp."):
                assert torch.equal(before.tensor(k), after.tensor(k)), k
        for d in range(3):  # every head moved
            assert any(not torch.equal(before.tensor(k), after.tensor(k)) for k in before if k.startswith(f"mtp.layers.{d}."))
    train(cfg(data, tmp_path / "f", mode="finetune", init=str(base), model={}, max_steps=2, eval_every=2, mtp_depth=3))
    assert names(tmp_path / "f" / "model") == names(base)


def test_heal_grafts_the_heads_back(tmp_path):
    from mtp.train.heal import graft

    model = tiny(seed=6, vocab_size=64)
    for out in ("base", "ft"):
        mtp.save_model(model, tmp_path / out)
    f = tmp_path / "ft" / "model.safetensors"
    save_file({k: v for k, v in load_file(f).items() if not k.startswith("mtp.")}, f)
    grafted = graft(tmp_path / "base", tmp_path / "ft", tmp_path / "out")
    assert set(grafted) == {k for k in names(tmp_path / "base") if k.startswith("mtp.")}
    assert names(tmp_path / "out") == names(tmp_path / "base")
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(load(tmp_path / "out").mtp_logits(ids)[2], model.mtp_logits(ids)[2], atol=1e-6, rtol=0)


def test_save_round_trip_keeps_every_name(release, tmp_path):
    _, _, out = release
    ours = load(out)
    mtp.save_model(ours, tmp_path)
    assert names(tmp_path) == names(out)
    ids = torch.randint(0, ours.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(load(tmp_path).mtp_logits(ids)[2], ours.mtp_logits(ids)[2], atol=0, rtol=0)


def test_a_plain_llama_loads_warns_and_decodes_plainly(tmp_path):
    transformers = hf_transformers()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)).eval()
    hf.save_pretrained(tmp_path)
    ours = mtp.load_model(tmp_path)  # no mtp keys: a plain Llama
    assert ours.mtp is None
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- bad releases
def edit_params(ckpt, **kw):
    p = json.loads((ckpt / "params.json").read_text())
    p.update(kw)
    (ckpt / "params.json").write_text(json.dumps(p))


def edit_state(ckpt, fn):
    state = torch.load(ckpt / "consolidated.pth", weights_only=True)
    fn(state)
    torch.save(state, ckpt / "consolidated.pth")


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    ckpt, _ = write_release(tmp_path_factory.mktemp("bad") / "release", seed=9)
    return ckpt


@pytest.mark.parametrize("case, message", [
    ("unknown key", "key 'use_scaled_rope' is not one of the release's params"),
    ("n_future too large", "'n_future_tokens' \\(7\\) must be in 1..n_layers \\(6\\)"),
    ("fewer layers", "unexpected tensor 'layers.2.attention.wk.weight' \\(params say 2 'layers' and 3 'extra_heads'"),
    ("missing head", "missing tensor 'extra_heads.2.feed_forward.w2.weight'"),
    ("wrong shape", "tensor 'layers.1.attention.wk.weight' has shape \\[32, 32\\], expected \\[16, 32\\]"),
    ("vocab mismatch", "'vocab_size' is 999"),
    ("rope.freqs", "tensor 'rope.freqs' does not match params 'rope_theta'"),
    ("pickle with code", "cannot read as a PyTorch state dict"),
    ("two shards", "model-parallel shards are not supported"),
    ("no params", "no params.json"),
])
def test_bad_releases_are_one_line_errors_naming_the_key_or_tensor(pristine, tmp_path, case, message):
    import shutil

    ckpt = tmp_path / "release" / "7B_tiny"
    shutil.copytree(pristine.parent, tmp_path / "release")
    if case == "unknown key":
        edit_params(ckpt, use_scaled_rope=True)
    elif case == "n_future too large":
        edit_params(ckpt, n_future_tokens=7)
    elif case == "fewer layers":
        edit_params(ckpt, n_layers=5)
    elif case == "missing head":
        edit_state(ckpt, lambda s: s.pop("extra_heads.2.feed_forward.w2.weight"))
    elif case == "wrong shape":
        edit_state(ckpt, lambda s: s.update({"layers.1.attention.wk.weight": torch.zeros(32, 32)}))
    elif case == "vocab mismatch":
        edit_params(ckpt, vocab_size=999)
    elif case == "rope.freqs":
        edit_state(ckpt, lambda s: s.update({"rope.freqs": torch.ones(4)}))
    elif case == "pickle with code":
        with open(ckpt / "consolidated.pth", "wb") as f:
            pickle.dump({"tok_embeddings.weight": Evil()}, f)
    elif case == "two shards":
        (ckpt / "consolidated.pth").rename(ckpt / "consolidated.00.pth")
        shutil.copy(ckpt / "consolidated.00.pth", ckpt / "consolidated.01.pth")
    elif case == "no params":
        (ckpt / "params.json").unlink()
    proc = run_cli("convert", str(ckpt), str(tmp_path / "out"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "pwned" not in proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert __import__("re").search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


def test_rope_freqs_that_match_are_accepted_and_dropped(pristine, tmp_path):
    import shutil

    shutil.copytree(pristine.parent, tmp_path / "release")
    ckpt = tmp_path / "release" / "7B_tiny"
    edit_state(ckpt, lambda s: s.update({"rope.freqs": 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))}))
    assert run_cli("convert", str(ckpt), str(tmp_path / "out")).returncode == 0
    assert "rope.freqs" not in names(tmp_path / "out")


def test_tokenizer_that_disagrees_with_the_embedding_is_refused(tmp_path):
    ckpt, _ = write_release(tmp_path / "r", vocab=500)
    proc = run_cli("convert", str(ckpt), str(tmp_path / "out"))
    assert proc.returncode != 0 and "tokenizer.model: 320 tokens, but tensor 'tok_embeddings.weight'" in proc.stderr
    assert run_cli("convert", "--no-tokenizer", str(ckpt), str(tmp_path / "out")).returncode == 0
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_llama_configs_name_the_key():
    with pytest.raises(ConfigError, match="'mtp_style'"):
        LlamaConfig.from_hf_dict({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 8,
                                  "mtp_style": "sequential"})
    with pytest.raises(ConfigError, match="rope_type"):
        LlamaConfig.from_hf_dict({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 8,
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ConfigError, match="'attention_bias'"):
        LlamaConfig.from_hf_dict({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 8,
                                  "attention_bias": True})
