"""`auto`'s measurements kept across processes (`decode/policy_store.py`): a later process's first `auto` decoder starts
from what an earlier one measured with the same model files, preparation, setup and machine; a bad file is ignored
and replaced; nothing is kept for a model built in code."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch

import mtp
from conftest import trained_tiny_model
from mtp.decode import policy_store
from mtp.decode.decoder import Decoder
from mtp.decode.policy import Acceptance, RoundTimes
from mtp.model import native
from serve_support import ServerProcess, build_trained_model_dir

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store in a folder of this test's (and its own registry of files to write)."""
    monkeypatch.setenv("MTP_AUTO_STORE", "1")
    monkeypatch.setattr(policy_store, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(policy_store, "_open", {})
    return tmp_path / "cache" / "auto"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    mtp.save_model(trained_tiny_model(steps=60, seed=5), path)
    return path


def measured(model) -> tuple[dict, list]:
    """The decoder's view of what `auto` knows for a lone sequence: round times by (B, k), acceptance counts."""
    policy = Decoder(model, 1, 64, "auto").policy
    return dict(policy.rounds.samples), [(c.offered, c.accepted) for c in policy.counts.by_state]


def test_a_later_process_starts_from_what_an_earlier_one_measured(store, folder):
    first = mtp.load_model(folder)
    assert measured(first)[0] == {}  # nothing kept yet: auto starts from nothing
    policy = Decoder(first, 1, 64, "auto").policy  # (what it learns lives with the model: seeded so that, whatever
    policy.rounds.record((1, 2), 1.5e-3)  # this CPU's training of the tiny head made the rounds, some are kept)
    policy.counts.record([(2, 1)], [0])
    want = mtp.generate(first, PROMPT, max_new_tokens=80).tokens
    assert mtp.generate(first, PROMPT, max_new_tokens=80, draft_tokens="auto").tokens == want
    times, counts = measured(first)
    assert times and any(offered for offered, _ in counts)
    policy_store.save_all()  # (what the process does at exit)
    files = list(store.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["folder"] == str(folder.resolve())

    later = mtp.load_model(folder)  # another process's model: nothing in memory
    assert measured(later) == (times, counts)
    assert mtp.generate(later, PROMPT, max_new_tokens=80, draft_tokens="auto").tokens == want
    # a setup measured apart (another thread count) starts from nothing
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert measured(mtp.load_model(folder))[0] == {}
    finally:
        torch.set_num_threads(threads)


def test_what_is_kept_depends_on_the_files_and_their_preparation(folder, monkeypatch):
    monkeypatch.setenv("MTP_AUTO_STORE", "1")
    model = mtp.load_model(folder)
    setup = (False, 1, False, False, 1)
    key = policy_store.key(model, setup, None)
    assert key == policy_store.key(mtp.load_model(folder), setup, None)
    assert policy_store.path_for(key) != policy_store.path_for(policy_store.key(model, setup, 4))  # a draft vocabulary
    int8 = mtp.load_model(folder, quantize="int8")
    assert policy_store.path_for(key) != policy_store.path_for(policy_store.key(int8, setup, None))
    weights = folder / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the checkpoint written again
    try:
        assert policy_store.path_for(key) != policy_store.path_for(policy_store.key(model, setup, None))
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert policy_store.key(trained_tiny_model(steps=1), setup, None) is None  # built in code: nothing kept


@pytest.mark.parametrize("text, why", [
    ("{not json", "Expecting property name"),
    ('{"key": 1}', "another key"),
    ("samples", "round times in (0, 60) s"),
    ("acceptance", "0 <= accepted <= offered"),
])
def test_a_bad_file_is_ignored_and_replaced(store, folder, caplog, text, why):
    model = mtp.load_model(folder)
    key = policy_store.key(model, (False, torch.get_num_threads(), False, False, 1), None)  # (`Decoder`'s setup)
    rounds, counts = RoundTimes(), Acceptance()
    rounds.record((1, 2), 1.5e-3)
    counts.record([(2, 1)], [0])
    good = json.loads(policy_store.dump(key, rounds, counts))
    if text == "samples":
        good["rounds"]["samples"][0][2] = [-1.0]
        text = json.dumps(good)
    elif text == "acceptance":
        good["acceptance"][0]["accepted"][0] = good["acceptance"][0]["offered"][0] + 1
        text = json.dumps(good)
    path = policy_store.path_for(key)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="mtp.decode"):
        assert measured(model)[0] == {}
    assert why in caplog.text and str(path) in caplog.text
    want = mtp.generate(model, PROMPT, max_new_tokens=30).tokens
    assert mtp.generate(model, PROMPT, max_new_tokens=30, draft_tokens="auto").tokens == want
    policy_store.save_all()
    assert json.loads(path.read_text())["key"] == key  # replaced by what this process measured
    assert not list(store.glob(".*.tmp"))


def test_a_wide_servers_times_read_back(store, folder):
    """An eager round keys its time by its decoding rows: a server of 64 rows measures up to 64 x 9 (B, k) pairs, and
    its file reads back whole (a bound of 256 pairs had the next process ignore it)."""
    model = mtp.load_model(folder)
    key = policy_store.key(model, (False, torch.get_num_threads(), False, False, 64), None)
    rounds, counts = RoundTimes(), Acceptance()
    for b in range(1, 65):
        for k in range(9):
            rounds.record((b, k), (1.0 + 0.1 * b + 0.2 * b * k) * 1e-3)
    path = policy_store.path_for(key)
    path.parent.mkdir(parents=True)
    path.write_text(policy_store.dump(key, rounds, counts))
    again = RoundTimes()
    assert policy_store.load(key, again, Acceptance())
    assert again.samples == rounds.samples and len(again.samples) == 576


def test_switched_off(store, folder, monkeypatch):
    monkeypatch.setenv("MTP_AUTO_STORE", "0")
    model = mtp.load_model(folder)
    mtp.generate(model, PROMPT, max_new_tokens=30, draft_tokens="auto")
    policy_store.save_all()
    assert not store.exists()


def test_mtp_generate_keeps_what_it_measured_for_the_next_one(tmp_path):
    """Two `mtp generate` processes on the shipped model: the first writes the store at its exit, the second reads it
    (its first decoder starts from those round times) and writes what it added."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(native.kernels_dir().resolve(), target_is_directory=True)  # (no rebuild)
    env = dict(os.environ, MTP_CACHE=str(cache), MTP_AUTO_STORE="1")
    cmd = [sys.executable, "-m", "mtp.cli", "generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24",
           "--threads", "1", "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    files = list((cache / "auto").glob("*.json"))
    assert len(files) == 1
    kept = json.loads(files[0].read_text())
    assert kept["key"]["folder"].endswith("code-small")
    # a mark the second process cannot measure again (a lone generation never runs 2 rows): it survives only if read
    kept["rounds"]["samples"].append([2, 3, [0.0123]])
    files[0].write_text(json.dumps(kept))
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
    again = json.loads(files[0].read_text())
    assert again["key"] == kept["key"] and [2, 3, [0.0123]] in again["rounds"]["samples"]
    assert not list((cache / "auto").glob(".*.tmp"))


def test_the_store_keeps_the_latest_files(store, folder, monkeypatch):
    monkeypatch.setattr(policy_store, "MAX_FILES", 3)
    store.mkdir(parents=True)
    for i in range(4):
        (store / f"{i:024x}.json").write_text("{}")
        os.utime(store / f"{i:024x}.json", ns=(i * 10**9, i * 10**9))
    mtp.generate(mtp.load_model(folder), PROMPT, max_new_tokens=30, draft_tokens="auto")
    policy_store.save_all()
    left = sorted(f.name for f in store.glob("*.json"))
    assert len(left) == 3 and f"{0:024x}.json" not in left and f"{1:024x}.json" not in left


def test_a_failed_write_loses_nothing(store, folder, caplog):
    """A store folder that cannot be written: the process goes on (one warning), no temporary is left behind."""
    mtp.generate(mtp.load_model(folder), PROMPT, max_new_tokens=30, draft_tokens="auto")
    store.parent.mkdir(parents=True)
    store.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="mtp.decode"):
        policy_store.save_all()
    assert "could not keep auto's measurements" in caplog.text
    assert sorted(p.name for p in store.parent.iterdir()) == ["auto"]


def test_mtp_serve_keeps_what_it_measured_when_stopped(tmp_path, monkeypatch):
    """`mtp serve` ends by the SIGTERM uvicorn raises again (no atexit): its cleanup writes the store."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(native.kernels_dir().resolve(), target_is_directory=True)
    monkeypatch.setenv("MTP_CACHE", str(cache))
    monkeypatch.setenv("MTP_AUTO_STORE", "1")
    srv = ServerProcess(build_trained_model_dir(tmp_path / "model", steps=30), tmp_path / "serve.log")
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "model", "prompt": "def f(x):", "max_tokens": 24,
                                                           "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == -signal.SIGTERM
        srv.stop()
    files = list((cache / "auto").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["setup"][-1] == 8  # (the server's batch)
