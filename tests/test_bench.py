"""`mtp bench`: report structure, the identical-output check, the cost model's formula (never speed)."""

from __future__ import annotations

import json

import pytest
import torch

import mtp
from conftest import tiny_model
from mtp.bench.costmodel import cost_model_speedup, expected_tokens, measure_costs
from mtp.bench.measure import Run, check_identical
from mtp.bench.prompts import DEFAULT_PROMPTS, cut_code_prompt, load_prompts
from mtp.cli import main
from mtp.decode.draft_vocab import DraftVocab
from mtp.model import step


def byte_tokenizer(vocab_size: int = 300):
    """A byte-level BPE (any text encodes) with a few merges, trained on a tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "The river cuts its valley."] * 20, trainer)
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_model")
    mtp.save_model(tiny_model(seed=3, vocab_size=300), path)
    byte_tokenizer(300).save(str(path / "tokenizer.json"))
    counts = torch.arange(300, 0, -1).tolist()  # token frequencies for --draft-vocab: low ids most frequent
    (path / "token_frequencies.json").write_text(json.dumps({"split": "train", "tokens": sum(counts), "counts": counts}))
    return path


def test_shipped_prompts_have_both_kinds():
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert {p.kind for p in prompts} == {"code", "text"}
    assert all(p.source for p in prompts)


def test_cut_code_prompt_ends_after_a_signature():
    text = "import os\n\n" + "X = 1\n" * 100 + 'def f(a, b):\n    """Add."""\n    return a + b\n'
    cut = cut_code_prompt(text, max_chars=300, min_chars=100)
    assert cut.endswith('def f(a, b):\n    """Add."""\n') and len(cut) <= 300


def test_expected_tokens_and_cost_model_speedup():
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([], 2) == 1.0
    assert cost_model_speedup([1.0, 1.0], 2, 0.0, {3: 1.0}) == 3.0
    assert cost_model_speedup([0.5], 1, 0.5, {2: 1.0}) == pytest.approx(1.5 / 1.5)
    assert cost_model_speedup([0.5], 4, 0.5, {2: 1.0}) is None


def test_check_identical_reports_the_first_difference():
    runs = [Run("mtp plain", 0, 0, [1, 2, 3], 1.0, 0.0), Run("mtp k=2", 0, 0, [1, 2, 3], 1.0, 0.0),
            Run("transformers", 0, 1, [1, 9, 3], 1.0, 0.0)]
    problems = check_identical(runs)
    assert len(problems) == 1 and "transformers" in problems[0] and "new token 1" in problems[0]


def test_measure_costs_structure():
    costs = measure_costs(tiny_model(seed=1), q_max=3, context=8, iters=1, warmup=0)
    assert set(costs["c_verify"]) == {1, 2, 3} and set(costs["c_chunked"]) == {2}
    assert costs["c_draft"] > 0 and costs["t1_s"] > 0


def test_the_automatic_draft_vocabulary_makes_its_share_of_the_counted_tokens(model_dir, tmp_path):
    """`--draft-vocab auto`: the fewest most frequent tokens making 95% of the counts, rounded up to a multiple of 64;
    None where the folder has no counts or the share needs more than 3/4 of the vocabulary."""
    model = mtp.load_model(model_dir)
    counts = torch.arange(300, 0, -1)  # the fixture's: ids 0.. most frequent
    made = counts.cumsum(0)
    n = int((made < 0.95 * made[-1]).sum()) + 1
    assert made[n - 1] >= 0.95 * made[-1] > made[n - 2]
    want = -(-n // 64) * 64
    assert DraftVocab.auto_size(model) == (want if want <= 225 else None)
    skewed = [10_000] * 70 + [1] * 230
    (model_dir / "token_frequencies.json").write_text(json.dumps({"split": "train", "tokens": 1, "counts": skewed}))
    try:
        assert DraftVocab.auto_size(model) == 128
    finally:
        (model_dir / "token_frequencies.json").write_text(
            json.dumps({"split": "train", "tokens": int(made[-1]), "counts": counts.tolist()}))
    model.source_path = str(tmp_path)  # (no counts there)
    assert DraftVocab.auto_size(model) is None


def test_draft_vocab_restricts_the_head_and_maps_back_to_full_ids():
    model = tiny_model(seed=2)
    ids = [5, 17, 40]
    vocab = DraftVocab(ids, model.config.vocab_size)
    h = torch.randn(model.config.hidden_size)
    full = model.mtp_head(h, 1)
    torch.testing.assert_close(vocab.logits(model, h, 1), full[ids])
    spread = vocab.full_logits(model, h[None], 1)[0]
    assert int(spread.argmax()) == ids[int(full[ids].argmax())] == int(vocab.argmax(model, h[None], 1)[0])
    assert torch.isinf(spread[[i for i in range(model.config.vocab_size) if i not in ids]]).all()
    counts = torch.zeros(model.config.vocab_size)
    counts[3], counts[9] = 5, 7
    assert DraftVocab.from_counts(counts, 2).ids.tolist() == [3, 9]
    assert DraftVocab.from_counts(counts, 2, always=[0]).ids.tolist() == [0, 9]  # EOS kept, then the most frequent


def test_a_models_draft_vocabulary_is_made_once_and_follows_its_head(model_dir):
    """`DraftVocab.for_model` gives one vocabulary per model and size (each generate made and prepared its own), and
    its head rows are taken again when the head's weight changes in place (training, healing)."""
    model = mtp.load_model(model_dir)
    vocab = DraftVocab.for_model(model, 64)
    assert DraftVocab.for_model(model, 64) is vocab and DraftVocab.for_model(model, 128) is not vocab
    h = torch.randn(model.config.hidden_size)
    with torch.inference_mode():
        before = vocab.logits(model, h, 1)
    with torch.no_grad():
        model.mtp_head_module(1).weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(vocab.logits(model, h, 1), model.mtp_head(h, 1)[vocab.ids])
        assert not torch.allclose(vocab.logits(model, h, 1), before)


def test_bench_quick_writes_report(model_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(model_dir), "--quick", "--out", str(out), "--threads", "1"])
    report = json.loads((out / "report.json").read_text())
    assert rc == 0, report["mismatches"]
    assert report["identical_outputs"] is True and report["mismatches"] == []
    summary = report["summary"]
    assert set(summary) == {"code", "text", "all"}
    code = summary["code"]
    assert "mtp plain" in code and code["mtp plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    for fig in code.values():
        assert fig["tokens_per_s"] > 0 and fig["peak_rss_mb"] > 0 and fig["peak_extra_mb"] >= 0 and fig["new_tokens"] == 24
    cfgs = report["meta"]["draft_tokens"]
    assert cfgs == [1, 3, "auto"]
    assert report["failed"] == {}
    for k in cfgs:  # every speculative configuration ran
        name = f"mtp k={k}"
        assert len(code[name]["acceptance_per_position"]) >= 1 and "time_split" in code[name]
    assert "transformers" in code  # the test extra installs it
    # transformers has no MTP for Qwen3.5: no use_mtp configuration, a note saying why
    assert "transformers use_mtp" not in code and "num_mtp_layers" in report["meta"]["notes"]["transformers use_mtp"]
    assert report["best_fixed_k"]["code"]["config"] in code
    assert report["cost_model"]["c_verify"]["1"] > 0
    prof = report["round_profile"]  # where a round's time goes: plain and k=3, eager
    assert set(prof) == {"mtp plain", "mtp k=3"}
    for p in prof.values():
        assert p["ms_per_round"] > 0 and p["ops_per_round"] > 10 and p["graph_calls_per_round"] == 0
        assert 0 < p["linear_ms_per_round"] <= p["ms_per_round"] * 1.5
        if step.LIBRARY.available():  # the C kernels ran (not with MTP_NATIVE=0, nor on a machine without a compiler)
            assert p["c_calls_per_round"] > 0 and 0 < p["c_ms_per_round"] <= p["ms_per_round"] * 1.5
        else:
            assert p["c_calls_per_round"] == 0
        assert p["host_ms_per_round"] >= 0
    assert prof["mtp k=3"]["tokens_per_round"] >= 1 and prof["mtp plain"]["tokens_per_round"] == 1
    assert prof["mtp k=3"]["ops_per_round"] > prof["mtp plain"]["ops_per_round"]  # the round also drafts
    assert "where a round's time goes" in (out / "report.md").read_text()
    assert (out / "report.md").exists()
    assert (out / "acceptance_by_position.png").exists() and (out / "speedup_vs_k.png").exists()
    printed = capsys.readouterr().out
    assert "| configuration | tokens/s |" in printed


def test_bench_fails_loudly_when_outputs_differ(model_dir, tmp_path, monkeypatch):
    import mtp.bench.measure as measure

    real = measure.make_generate_fn

    def corrupt(model, hf_model, cfg, max_new_tokens, pad):
        fn = real(model, hf_model, cfg, max_new_tokens, pad)
        if cfg.name != "mtp k=1":
            return fn
        def wrong(ids):
            tokens, stats, k = fn(ids)
            return [(tokens[0] + 1) % 300] + tokens[1:], stats, k
        return wrong

    monkeypatch.setattr(measure, "make_generate_fn", corrupt)
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(model_dir), "--quick", "--out", str(out), "--no-transformers",
               "--no-cost-model", "--draft-tokens", "1", "--max-new-tokens", "4", "--repeats", "1"])
    report = json.loads((out / "report.json").read_text())
    assert rc == 1 and report["identical_outputs"] is False and report["mismatches"]


def test_bench_reports_a_failing_configuration_as_failed(model_dir, tmp_path, monkeypatch):
    import mtp.bench.measure as measure

    real = measure.make_generate_fn

    def broken(model, hf_model, cfg, max_new_tokens, pad):
        fn = real(model, hf_model, cfg, max_new_tokens, pad)
        if cfg.name != "mtp k=1":
            return fn
        def fail(ids):
            raise NotImplementedError("drafting is broken")
        return fail

    monkeypatch.setattr(measure, "make_generate_fn", broken)
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(model_dir), "--quick", "--out", str(out), "--no-transformers",
               "--no-cost-model", "--draft-tokens", "1", "--max-new-tokens", "4", "--repeats", "1"])
    report = json.loads((out / "report.json").read_text())
    assert rc == 1 and report["failed"] == {"mtp k=1": "NotImplementedError: drafting is broken"}
    assert report["identical_outputs"] is False


def test_bench_variants_are_checked_against_their_own_plain_decoding(model_dir, tmp_path):
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(model_dir), "--quick", "--out", str(out), "--no-transformers", "--no-cost-model",
               "--draft-tokens", "2", "--max-new-tokens", "8", "--repeats", "1", "--variants", "bf16,int8+vocab64,int4",
               "--no-profile"])
    report = json.loads((out / "report.json").read_text())
    assert rc == 0, report["mismatches"]
    code = report["summary"]["code"]
    assert {"mtp plain", "mtp k=2", "mtp bf16 plain", "mtp bf16 k=2", "mtp int8+vocab64 plain", "mtp int8+vocab64 k=2"} <= set(code)
    assert code["mtp int8+vocab64 k=2"]["variant"] == "int8+vocab64"
    assert {"mtp int4 plain", "mtp int4 k=2"} <= set(code)
    assert report["best_fixed_k"]["code"]["config"] == "mtp k=2"  # the default variant's


def test_bench_says_what_auto_started_from(model_dir, tmp_path, monkeypatch):
    """The report notes whether `auto` started from what an earlier process kept (decode/policy_store.py)."""
    from mtp.decode import policy_store

    monkeypatch.setenv("MTP_AUTO_STORE", "1")
    monkeypatch.setattr(policy_store, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(policy_store, "_open", {})
    monkeypatch.setattr(policy_store, "_read", set())
    args = ["bench", "--model", str(model_dir), "--quick", "--no-transformers", "--no-cost-model", "--draft-tokens",
            "auto", "--max-new-tokens", "8", "--repeats", "1"]
    notes = []
    for run in range(2):
        out = tmp_path / f"bench{run}"
        assert main([*args, "--out", str(out)]) == 0
        notes.append(json.loads((out / "report.json").read_text())["meta"]["notes"]["auto"])
        policy_store.save_all()  # (the process's exit)
        policy_store._open.clear()  # (a new process)
    assert notes[0].startswith("started from nothing")
    assert notes[1].startswith("started from the measurements an earlier process kept") and "cache/auto/" in notes[1]
