"""`mtp retrofit --style masks` (`model/masks.py`, `decode/masks.py`, `train/masks.py`): k mask tokens, gated LoRA
and a sampler head on a frozen model. Ordinary tokens' logits are bit-identical with the adapter attached (in a full
forward and in a decode forward that carries a mask block); greedy decoding that drafts from the mask block equals
plain decoding for every acceptance pattern, solo and batched; the adapter saves beside the unchanged checkpoint and
reloads; a killed run resumes exactly; the CLI runs as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtp
from conftest import pattern_batch
from mtp.decode.masks import MaskDrafter
from mtp.io import read_tensors
from mtp.model.masks import MASKS_CONFIG, MASKS_FILE, MaskAdapter, MasksConfig
from mtp.train import masks as tm
from mtp.train.retrofit import retrofit_masks
from test_data import build_toy

transformers = pytest.importorskip("transformers")

V = 320
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)
RUN = dict(masks=3, rank=4, steps=6, lr=3e-3, seq_len=32, micro_batch=4, eval_seqs=8, eval_every=2, threads=1,
           device="cpu", cuts=4, progress=False)


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return build_toy(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON))
    path = tmp_path_factory.mktemp("llama")
    ref.save_pretrained(path)
    return path


def family_model(kind: str):
    """A random model of `kind`: a transformers Llama / Qwen3 through the generic family, or our own Qwen3.5
    (Gated DeltaNet + attention: a recurrent state the mask block must not advance)."""
    from mtp.model.families import config_from_dict, model_class_for

    if kind == "qwen3_5":
        from test_train import MODEL

        d = {**MODEL, "model_type": "qwen3_5_text", "vocab_size": V, "mtp_num_hidden_layers": 0}
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[kind]
        d = cls(**COMMON).to_dict()
    config = config_from_dict(d)
    torch.manual_seed(0)
    model = model_class_for(config)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.1)
    return model.eval()


def random_adapter(model, k: int = 3) -> MaskAdapter:
    """An attached adapter with every tensor random (B and fc2 too: a zero LoRA would leave even the masks unchanged)."""
    adapter = MaskAdapter.attach(model, MasksConfig(k, 4, 8.0, model.config.vocab_size))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return adapter


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5"])
@torch.no_grad()
def test_gated_lora_leaves_ordinary_token_logits_bit_identical(kind):
    model = family_model(kind)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = model(ids)
    adapter = random_adapter(model)
    assert torch.equal(model(ids), plain)                                # full forward, adapter attached
    # a decode forward that carries the mask block after the ordinary tokens, as a verify does
    model.prepare_for_inference()
    masks = torch.tensor(adapter.config.mask_ids)[None].expand(2, 3)

    def decode(x: torch.Tensor) -> torch.Tensor:  # x [2, T] at positions 16.. after the prompt ids[:, :16]
        cache = model.new_cache(2, 64)
        model.hidden(ids[:, :16], cache)
        at = model.decode_positions(16 + torch.arange(x.shape[1])[None].expand(2, -1), [16, 16])
        return model.decode(x, cache, at)[0]

    tail = ids[:, 16:]
    h_plain, h_mask = decode(tail), decode(torch.cat([tail, masks], 1))
    assert torch.equal(model.head(h_mask[:, :8]), model.head(h_plain))    # ordinary tokens: the same bits
    adapter.detach_from(model)
    h_off = decode(torch.cat([tail, masks.clamp(max=V - 1)], 1))
    assert torch.equal(h_off[:, :8], h_plain)
    assert not torch.equal(h_off[:, 8:], h_mask[:, 8:])                   # ... while the adapter acts on the masks


def prefilled(model, ids: torch.Tensor):
    """A batch cache holding ids [B, T] (prefilled in one forward: every row the same length)."""
    cache = model.new_cache(ids.shape[0], 64)
    model.hidden(ids, cache)
    return cache


@pytest.fixture(scope="module")
def pattern_model():
    """A Llama (generic family, vocab 8) trained briefly on repeating patterns, then an adapter trained onto it
    (frozen) with the retrofit's own objective (`train.masks.block_losses`): drafts are accepted sometimes."""
    import torch.nn.functional as F

    from mtp.model.families import config_from_dict, model_class_for

    config = config_from_dict(transformers.LlamaConfig(**{**COMMON, "vocab_size": 8}).to_dict())
    torch.manual_seed(0)
    model = model_class_for(config)(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        ids = pattern_batch(8, 8, 32, gen)
        loss = F.cross_entropy(model.head(model.hidden(ids)[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = MaskAdapter.attach(model, MasksConfig(4, 4, 8.0, 8))
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    for _ in range(40):
        ids = pattern_batch(8, 8, 32, gen)
        tm.block_losses(model, adapter, ids, tm.cut_points(32, 4, 4, gen), 1.0, train=True)
        opt.step()
        opt.zero_grad()
    return model


def test_masks_greedy_speculative_equals_plain(pattern_model):
    model = pattern_model
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(4):
        prompt = pattern_batch(8, 1, int(torch.randint(2, 16, (1,), generator=g)), g)[0].tolist()
        want = mtp.generate(model, prompt, max_new_tokens=30).tokens
        for k in (1, 2, 3, 4, "auto"):
            r = mtp.generate(model, prompt, max_new_tokens=30, draft_tokens=k)
            assert r.tokens == want, k
            accepted += sum(r.stats.accepted)
    assert accepted > 0  # the drafts from the mask block are used, not only verified away


@pytest.mark.parametrize("pattern", ["none", "all", "some", "mixed"])
def test_masks_scripted_acceptance_patterns_are_lossless(pattern_model, monkeypatch, pattern):
    """Drafts scripted from the plain output (right, wrong, right only first, runs of three) through the mask
    drafter: every acceptance pattern, and the block's validity after each, is exercised whatever the machine."""
    model = pattern_model
    prompt = pattern_batch(8, 1, 9, torch.Generator().manual_seed(4))[0].tolist()
    want = mtp.generate(model, prompt, max_new_tokens=30).tokens
    real = MaskDrafter.draft

    def scripted(self, model_, st, K, *a):
        drafts, q = real(self, model_, st, K, *a)
        drafts = drafts.clone()
        for j in range(1, K + 1):
            at = int(st.pos[0]) + j - len(prompt)
            right = want[at] if at < len(want) else 0
            good = {"none": False, "all": True, "some": j == 1, "mixed": (at // 3) % 2 == 0}[pattern]
            drafts[0, j - 1] = right if good else (right + 1) % 8
        return drafts, q

    seen = set()
    with monkeypatch.context() as m:
        m.setattr(MaskDrafter, "draft", scripted)
        for k in (1, 2, 4):
            r = mtp.generate(model, prompt, max_new_tokens=30, draft_tokens=k)
            assert r.tokens == want, (pattern, k)
            seen |= {"none" if n == 0 else "all" if n == kk else "some"
                     for kk, n in zip(r.stats.k_history, r.stats.n_history) if kk > 1}
            if pattern == "all":  # every block accepted whole: every round after the first drafts
                assert all(kk > 0 for kk in r.stats.k_history[1:-1]), r.stats.k_history
    assert seen == {"none": {"none"}, "all": {"all"}, "some": {"some"}, "mixed": {"none", "some", "all"}}[pattern]


@pytest.mark.parametrize("draft_tokens", [None, 3])
def test_masks_batched_equals_solo(pattern_model, draft_tokens):
    from test_batch import greedy_requests, run_batched

    model = pattern_model
    requests = greedy_requests(8, 6, seed=3, max_prompt=40)
    for (prompt, max_new, _, _), s in zip(requests, run_batched(model, requests, draft_tokens)):
        assert s.new_tokens == mtp.generate(model, prompt, max_new_tokens=max_new, draft_tokens=draft_tokens).tokens


def test_masks_refuse_compile(pattern_model):
    with pytest.raises(ValueError, match="eagerly"):
        mtp.generate(pattern_model, [1, 2, 3], max_new_tokens=4, draft_tokens=2, compile=True)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: f.tensor(n).clone() for k, (f, n) in read_tensors(path).items()}


def test_masks_retrofit_saves_beside_the_unchanged_checkpoint_and_reloads(data, base, tmp_path):
    report = retrofit_masks(str(base), str(data), tmp_path / "run", **RUN)
    assert report["style"] == "masks" and len(report["after"]["acceptance_per_position"]) == 3
    assert report["after"]["loss"] < report["before"]["untrained_adapter"]["loss"]
    assert json.loads((tmp_path / "run" / "report.json").read_text()) == report
    out = tmp_path / "run" / "model"
    assert (out / MASKS_FILE).exists() and json.loads((out / MASKS_CONFIG).read_text())["masks"] == 3
    before, now = tensors(base), tensors(out)
    assert before.keys() == now.keys() and all(torch.equal(before[k], now[k]) for k in before)  # base untouched

    model = mtp.load_model(out, dtype="float32")
    assert model.masks is not None and model.has_mtp
    saved = {k: v.float() for k, v in model.masks.state_dict().items()}
    trained = tensors(tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "latest").read_text().strip())
    assert trained.keys() == saved.keys()
    assert all(torch.equal(trained[k], saved[k]) for k in saved)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (10,), generator=g).tolist()
    want = mtp.generate(model, prompt, max_new_tokens=16).tokens
    assert mtp.generate(model, prompt, max_new_tokens=16, draft_tokens=3).tokens == want
    # transformers reads the folder as the plain model it was; saving again keeps the adapter
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(torch.tensor([prompt])).logits, model(torch.tensor([prompt])), atol=1e-5, rtol=0)
    mtp.save_model(model, tmp_path / "again")
    again = mtp.load_model(tmp_path / "again", dtype="float32")
    assert all(torch.equal(a, b) for a, b in zip(again.masks.state_dict().values(), model.masks.state_dict().values()))


def test_bad_adapter_files_name_the_file(base, tmp_path):
    model = mtp.load_model(base, dtype="float32")
    folder = tmp_path / "m"
    mtp.save_model(model, folder)
    (folder / MASKS_CONFIG).write_text(json.dumps({"masks": 0, "rank": 4, "alpha": 8.0, "vocab_size": V}))
    with pytest.raises(ValueError, match=f"{MASKS_CONFIG}.*'masks'"):
        mtp.load_model(folder)
    (folder / MASKS_CONFIG).write_text(json.dumps({"masks": 3, "rank": 4, "alpha": 8.0, "vocab_size": V}))
    adapter = MaskAdapter.attach(model, MasksConfig(3, 8, 8.0, V))  # rank 8: does not fit a rank-4 config
    adapter.save(folder)
    adapter.detach_from(model)
    (folder / MASKS_CONFIG).write_text(json.dumps({"masks": 3, "rank": 4, "alpha": 8.0, "vocab_size": V}))
    with pytest.raises(ValueError, match=MASKS_FILE):
        mtp.load_model(folder)


def test_masks_retrofit_resumes_exactly_after_a_kill(data, base, tmp_path, monkeypatch):
    full = tmp_path / "full"
    retrofit_masks(str(base), str(data), full, **RUN)
    real, calls = tm.block_losses, []

    def die_at_step_6(*a, **kw):
        if kw.get("train", a[5] if len(a) > 5 else False):  # a training step (not a held-out evaluation)
            calls.append(1)
            if len(calls) == 6:  # step 6 never happens: a kill after step 5 (last checkpoint: step 4)
                raise Killed
        return real(*a, **kw)

    killed = tmp_path / "killed"
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(tm, "block_losses", die_at_step_6)
        retrofit_masks(str(base), str(data), killed, **RUN)
    assert (killed / "latest").read_text().strip() == "step-000004"
    retrofit_masks(str(base), str(data), killed, **RUN)
    rows = [[{k: v for k, v in r.items() if k != "tok_s"} for r in map(json.loads, (p / "metrics.jsonl").read_text().splitlines())]
            for p in (full, killed)]
    assert [r["step"] for r in rows[1] if r["split"] == "train"] == list(range(1, 7))
    assert rows[0] == rows[1]  # losses and held-out acceptance: bit-exact
    a, b = tensors(full / "model"), tensors(killed / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ma = mtp.load_model(full / "model").masks.state_dict()
    mb = mtp.load_model(killed / "model").masks.state_dict()
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)   # bit-exact


def test_cli_retrofit_masks_real_process(data, base, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "mtp.cli", "retrofit", "--base", str(base), "--data", str(data), "--out", str(out),
           "--style", "masks", "--masks", "2", "--lora-rank", "4", "--steps", "2", "--seq-len", "32", "--micro-batch",
           "2", "--eval-seqs", "4", "--eval-every", "2", "--threads", "1", "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["style"] == "masks" and len(report["after"]["acceptance_per_position"]) == 2
    assert mtp.load_model(out / "model").masks.config.masks == 2


def test_masks_retrofit_keeps_a_bf16_base_in_bf16(data, base, tmp_path):
    ref = transformers.AutoModelForCausalLM.from_pretrained(base).to(torch.bfloat16)
    ref.save_pretrained(tmp_path / "bf16")
    retrofit_masks(str(tmp_path / "bf16"), str(data), tmp_path / "run", **{**RUN, "steps": 2})
    before, now = tensors(tmp_path / "bf16"), tensors(tmp_path / "run" / "model")
    assert all(now[k].dtype == torch.bfloat16 and torch.equal(before[k], now[k]) for k in before)
    assert all(t.dtype == torch.float32 for t in tensors_file(tmp_path / "run" / "model" / MASKS_FILE).values())
    model = mtp.load_model(tmp_path / "run" / "model")  # bf16, the adapter cast to it
    want = mtp.generate(model, [5, 6, 7, 8], max_new_tokens=12).tokens
    assert mtp.generate(model, [5, 6, 7, 8], max_new_tokens=12, draft_tokens=3).tokens == want


def tensors_file(path: Path) -> dict[str, torch.Tensor]:
    from mtp.io.safetensors_mmap import SafetensorsFile

    with SafetensorsFile(path) as f:
        return {k: f.tensor(k).clone() for k in f.keys()}
