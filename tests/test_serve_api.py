"""`mtp serve` as a real process on a loopback port, driven by the official `openai` client (completions
and chat, streaming and not) and by raw HTTP for the failure cases. Greedy answers through the server
(speculative decoding on) must equal `model.generate` with plain decoding and `mtp generate --json`."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import mtp
from serve_support import EOS, ServerProcess, build_model_dir

KEY = "test-key-123"
NAME = "tiny-chat"
MAX_CONCURRENCY = 8
# Prompts whose greedy continuation by the test model ends with EOS early ("ending") or runs past 200
# tokens ("long"); picked from candidates at fixture time so that a numerical change in the model cannot
# silently change what a test exercises. The 3000-token requests also set `ignore_eos`.
CANDIDATES = ["def add(a, b):", "Hello", "for i in range(10):", "import torch", "The quick brown fox", "x", "Héllo wörld"]
PROMPTS: dict[str, str] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("serve") / NAME, chat_template=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return mtp.load_model(model_dir)


@pytest.fixture(scope="module", autouse=True)
def prompts(model):
    for text in CANDIDATES:
        r = mtp.generate(model, model.tokenizer.encode(text), max_new_tokens=200)
        if r.finish_reason == "eos" and len(r.tokens) <= 60:
            PROMPTS.setdefault("ending", text)
        elif r.finish_reason == "length":
            PROMPTS.setdefault("long", text)
    assert {"ending", "long"} <= PROMPTS.keys(), f"no suitable prompts among {CANDIDATES}"


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "server.log", "--api-key", KEY,
                        "--max-concurrency", str(MAX_CONCURRENCY), "--draft-tokens", "auto")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def reference(model, prompt_ids: list[int], **kw):
    """What the server must answer: plain decoding (the NTP reference); its text never holds the EOS."""
    r = mtp.generate(model, prompt_ids, draft_tokens=None, **kw)
    assert EOS not in r.text
    return r, r.text


def raw(server, path: str, body=None, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is None:
        return httpx.get(server.url + path, headers=headers, timeout=30, **kw)
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={**headers, "Content-Type": "application/json"},
                      timeout=30, **kw)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    h = server.health()
    assert h["status"] == "ok" and h["model"] == NAME and h["context"] == 4096 and h["draft_tokens"] == "auto"


def test_greedy_completion_equals_generate_and_cli(client, model, model_dir):
    r, text = reference(model, model.tokenizer.encode(PROMPTS["ending"]), max_new_tokens=64)
    assert r.finish_reason == "eos" and len(r.tokens) < 64
    out = client.completions.create(model=NAME, prompt=PROMPTS["ending"], max_tokens=64, temperature=0)
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == "stop"  # EOS maps to OpenAI's "stop"
    assert out.usage.prompt_tokens == len(model.tokenizer.encode(PROMPTS["ending"]))
    assert out.usage.completion_tokens == len(r.tokens)
    spec = out.usage.model_extra["speculative"]
    assert spec["draft_tokens"] == "auto" and spec["mean_accepted_length"] >= 1.0
    assert all(0.0 <= a <= 1.0 for a in spec["acceptance_per_position"])
    assert spec["tokens_per_second"] > 0  # completion tokens over the time from admission to the last token
    cli = subprocess.run([sys.executable, "-m", "mtp.cli", "generate", "--model", str(model_dir), "--prompt", PROMPTS["ending"],
                          "--max-new-tokens", "64", "--temperature", "0", "--draft-tokens", "0", "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(cli.stdout)["tokens"] == r.tokens


def test_streaming_completion_adds_up_to_the_same_text(client, model):
    _, text = reference(model, model.tokenizer.encode(PROMPTS["long"]), max_new_tokens=40)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS["long"], max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 40 and "speculative" in chunks[-1].usage.model_extra


def test_chat_uses_the_template_and_equals_generate(client, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}]
    prompt = model.tokenizer.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\nbe brief<|im_end|>")
    ids = model.tokenizer.encode(prompt)
    _, text = reference(model, ids, max_new_tokens=30)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == text
    assert out.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=30, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_streaming_or_not(client, model):
    _, full = reference(model, model.tokenizer.encode(PROMPTS["long"]), max_new_tokens=40)
    stop = full[15:18]
    cut = full[: full.find(stop)]
    out = client.completions.create(model=NAME, prompt=PROMPTS["long"], max_tokens=40, temperature=0, stop=[stop, "never-seen"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    chunks = [c.choices[0].text for c in client.completions.create(model=NAME, prompt=PROMPTS["long"], max_tokens=40,
                                                                     temperature=0, stop=stop, stream=True)]
    assert "".join(chunks) == cut


def test_sampling_with_a_seed_is_reproducible(client):
    kw = dict(model=NAME, prompt=PROMPTS["long"], max_tokens=20, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 50, "repetition_penalty": 1.1})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == b.usage.completion_tokens


def test_api_key_is_required(server, model_dir):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="x", max_tokens=1)
    r = raw(server, "/v1/models", key=None)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert server.health()["status"] == "ok"


BAD_REQUESTS = [  # (path, body, status, param, words in the message)
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature", "greater than or equal"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 2}, 400, "n", "n=1"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "best_of": 3}, 400, "best_of", "best_of=1"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "repetition_penalty"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "frobnicate": True}, 400, "frobnicate", "Unrecognized"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "top_p": 1.5}, 400, "top_p", "less than or equal"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("/v1/completions", {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 99999]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt", "at least one token"),
    ("/v1/completions", {"model": NAME}, 400, "prompt", "required"),
    ("/v1/completions", {"model": NAME, "prompt": "x " * 4200}, 400, "prompt", "context of 4096"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "exceeds the context"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "not served"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "seed": 2**70}, 400, "seed", "less than or equal"),
    ("/v1/completions", '{"model": "tiny-chat", "prompt": ', 400, None, "not valid JSON"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "messages[0].role"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400, "tools",
     "tool calling"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "messages[0].content"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD_REQUESTS, ids=[f"{b}"[:60] for _, b, *_ in BAD_REQUESTS])
def test_bad_requests_get_a_clear_error_and_the_server_stays_up(server, path, body, status, param, words):
    r = raw(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert server.health()["status"] == "ok"


def aborted_count(server) -> float:
    """mtp:request_success_total{finished_reason="abort"} on the server's /metrics."""
    line = next(line for line in raw(server, "/metrics").text.splitlines()
                if line.startswith('mtp:request_success_total{finished_reason="abort"}'))
    return float(line.split()[-1])


def test_busy_server_answers_429_and_disconnected_streams_stop(server, client):
    body = {"model": NAME, "prompt": PROMPTS["long"], "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
    aborted = aborted_count(server)
    readers = []  # keep each line iterator alive: dropping one closes its connection
    with contextlib.ExitStack() as streams:
        for _ in range(MAX_CONCURRENCY):  # fill every slot with a long stream, each past its first chunk
            r = streams.enter_context(httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                                                   headers={"Authorization": f"Bearer {KEY}"}))
            readers.append(r.iter_lines())
            assert r.status_code == 200 and next(readers[-1]).startswith("data: ")
        assert server.health()["active"] == MAX_CONCURRENCY
        busy = raw(server, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1})
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert "max-concurrency" in busy.json()["error"]["message"]
    # the clients hung up: their generations must stop long before 3000 tokens
    deadline = time.monotonic() + 15
    while server.health()["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.health()["active"] == 0
    out = client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    time.sleep(0.2)  # the log line of a stream is written as its task winds down
    gone = [e for e in server.request_logs() if e.get("finish_reason") == "disconnected"]
    assert len(gone) == MAX_CONCURRENCY and all(e["completion_tokens"] < 3000 for e in gone)
    assert aborted_count(server) == aborted + MAX_CONCURRENCY  # each request's end counted once


def test_a_client_giving_up_on_a_whole_answer_stops_its_generation(server):
    body = {"model": NAME, "prompt": PROMPTS["long"], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    deadline = time.monotonic() + 15
    while server.health()["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.health()["active"] == 0
    time.sleep(0.2)
    last = [e for e in server.request_logs() if e["path"] == "/v1/completions"][-1]
    assert last["status"] == 499 and last["finish_reason"] == "disconnected" and last["completion_tokens"] < 3000


def test_request_log_is_one_json_line_per_request(server, client):
    client.completions.create(model=NAME, prompt="x", max_tokens=3, temperature=0)
    raw(server, "/v1/models", key="wrong")
    bad = raw(server, "/v1/completions", {"model": NAME, "prompt": "x", "n": 3})
    time.sleep(0.2)
    logs = server.request_logs()
    assert [e["status"] for e in logs if e["request_id"] == bad.headers["x-request-id"]] == [400]
    last = [e for e in logs if e["path"] == "/v1/completions" and e["status"] == 200][-1]
    for key in ("request_id", "ts", "duration_s", "prompt_tokens", "completion_tokens", "finish_reason",
                "time_to_first_token_s", "mean_accepted_length", "acceptance_per_position", "draft_tokens"):
        assert key in last, key
    assert any(e["status"] == 401 for e in logs) and any(e["status"] == 400 and "error" in e for e in logs)


@pytest.mark.slow
def test_load_8_clients_x_20_requests(server):
    """The bounded load test (scripts/serve_loadtest.py): no failed request, the server healthy and idle after."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "serve_loadtest.py"
    run = subprocess.run([sys.executable, str(script), "--base-url", server.url + "/v1", "--api-key", KEY, "--clients", "8",
                          "--requests", "20", "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=120)
    out = json.loads(run.stdout)
    print(json.dumps({k: v for k, v in out.items() if k != "health_after"}))
    assert run.returncode == 0 and out["failed"] == 0 and out["ok"] == 160, out
    assert out["health_after"]["status"] == "ok" and out["health_after"]["active"] == 0
