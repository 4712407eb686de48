"""scripts/serve_loadtest.py's throughput table: one `mtp serve` per mode, a Markdown table, the sequential
comparison, --json OUT, and a non-zero exit when requests fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serve_support import build_model_dir

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "serve_loadtest.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("loadtest") / "tiny", chat_template=False)


def loadtest(model_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--model", str(model_dir), "--threads", "1", "--requests-per-client", "1",
                           *args], capture_output=True, text=True, timeout=600)


def test_table_per_mode_and_concurrency(model_dir, tmp_path):
    out = tmp_path / "rows.json"
    run = loadtest(model_dir, "--concurrency", "1,2", "--modes", "off,auto", "--max-tokens", "8", "--json", str(out),
                   "--repetition-penalty", "1.2")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert ("| mode | concurrency | requests | new tokens/s (total) | p50 latency (s) | p95 latency (s) | prompt tokens "
            "from the cache |") in lines
    rows = [line.split("|")[1:4] for line in lines if line.startswith("| ") and "mode" not in line]
    assert [[c.strip() for c in r] for r in rows] == [["off", "1", "1"], ["off", "2", "2"], ["auto", "1", "1"], ["auto", "2", "2"]]
    for mode in ("off", "auto"):
        assert any(line.startswith(f"- {mode}: 2 concurrent clients") and "the same 2 requests one after another" in line
                   for line in lines), run.stdout
    saved = json.loads(out.read_text())
    assert saved["repetition_penalty"] == 1.2 and "repetition penalty 1.2" in run.stdout
    assert [(r["mode"], r["concurrency"], r["failed"]) for r in saved["rows"]] == [("off", 1, 0), ("off", 2, 0), ("auto", 1, 0),
                                                                                   ("auto", 2, 0)]
    assert all(0 < r["new_tokens"] <= 8 * r["requests"] and r["tokens_per_s"] > 0 for r in saved["rows"])
    # the warm-up request sent prompt 0, and so does the 1-client level: the server's prompt cache holds it
    assert 0 < saved["rows"][0]["cached_tokens"] == saved["rows"][0]["prompt_tokens"]
    assert [(b["mode"], b["requests"], b["sequential"]) for b in saved["sequential"]] == [("off", 2, True), ("auto", 2, True)]


def test_failed_requests_fail_the_run(model_dir):
    run = loadtest(model_dir, "--concurrency", "1", "--modes", "off", "--max-tokens", "100000")  # over the context: 400s
    assert run.returncode == 1
    assert "failure: BadRequestError" in run.stdout
