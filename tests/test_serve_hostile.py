"""Hostile input against `mtp serve` as a real process on a loopback port (issue 22): a chat template that loops, one
whose output is huge or allocates without end, a 10 MB prompt, oversized bodies, lone surrogates, loose types,
and SIGTERM with requests in flight (streaming and not). Each answer is a clear OpenAI error, the server stays
responsive (its /health answers) and SIGTERM still stops it. The figures before and after: scripts/serve_hostile.py
and docs/decisions.md."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import mtp
from serve_support import CHAT_TEMPLATE, CONTEXT, ServerProcess, build_model_dir

NAME = "hostile"
TEMPLATE_TIMEOUT_S = 2
# One template, four behaviours, chosen by the last message: the server under test needs one process for all.
HOSTILE_TEMPLATE = (
    "{%- set ask = messages[-1]['content'] -%}"
    "{%- if ask == 'loops' -%}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{%- elif ask == 'huge' -%}{{ 'x' * 10**7 }}"
    "{%- elif ask == 'memory' -%}{{ 'x' | center(10**10) }}"
    "{%- elif ask == 'surrogate' -%}{{ '\\ud800' }}"
    "{%- else -%}" + CHAT_TEMPLATE + "{%- endif -%}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("hostile") / NAME, chat_template=HOSTILE_TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "server.log", "--chat-template-timeout",
                        str(TEMPLATE_TIMEOUT_S))
    try:
        yield srv
    finally:
        srv.stop()


def post(server, path: str, body, client: httpx.Client | None = None, **kw) -> httpx.Response:
    data = body if isinstance(body, str | bytes) or hasattr(body, "__next__") else json.dumps(body)
    return (client or httpx).post(server.url + path, content=data, headers={"Content-Type": "application/json"},
                                  timeout=60, **kw)


def chat(server, content: str) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": content}],
                                                 "max_tokens": 2, "temperature": 0})


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_a_template_that_loops_is_stopped_at_its_time_limit(server):
    with ThreadPoolExecutor(1) as pool:
        looping = pool.submit(chat, server, "loops")
        time.sleep(0.5)  # let the render start: the server must answer meanwhile
        assert server.health()["status"] == "ok"
        err = error(looping.result(timeout=60), 400)
    assert err["param"] == "messages" and err["code"] == "chat_template_limit"
    assert err["message"] == f"the chat template exceeded the time limit of {TEMPLATE_TIMEOUT_S} s"
    assert chat(server, "hello").status_code == 200  # the next render is served as usual


@pytest.mark.parametrize("ask,words", [("huge", "output exceeded the limit of {limit} characters"),
                                       ("memory", "exceeded the memory limit of 1024 MiB"),
                                       ("surrogate", "not valid Unicode text")])
def test_a_template_past_its_output_or_memory_limit_is_a_400(server, model_dir, ask, words):
    limit = (CONTEXT - 1) * mtp.io.Tokenizer.from_dir(model_dir).max_chars_per_token
    err = error(chat(server, ask), 400)
    assert err["param"] == "messages" and words.format(limit=limit) in err["message"], err
    assert server.health()["status"] == "ok"


def test_a_10mb_prompt_is_refused_before_it_is_tokenized(server):
    err = error(post(server, "/v1/completions", {"model": NAME, "prompt": "x " * 5 * 10**6}), 413)
    assert err["code"] == "request_too_large" and "exceeds the limit of 1048576 bytes" in err["message"]
    err = error(post(server, "/v1/completions", {"model": NAME, "prompt": "x" * 10**6}), 400)  # fits the body limit
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "the prompt has 1000000 characters, more than can fit the context of 4096 tokens" in err["message"]
    assert server.health()["status"] == "ok"


def test_oversized_bodies_get_413_declared_or_chunked(server):
    body = json.dumps({"model": NAME, "prompt": "x", "user": "u" * 10**7}).encode()
    err = error(post(server, "/v1/completions", body), 413)
    assert f"the request body ({len(body)} bytes) exceeds the limit" in err["message"]
    chunks = (body[i: i + 65536] for i in range(0, len(body), 65536))  # no Content-Length: counted as it comes
    err = error(post(server, "/v1/completions", chunks), 413)
    assert "the request body (more than 1048576 bytes) exceeds the limit" in err["message"]
    assert server.health()["status"] == "ok"


SURROGATES = [  # raw JSON: "\ud800" is legal JSON for a lone surrogate, which is not text
    ("/v1/completions", '{"model": "hostile", "prompt": "a\\ud800b"}', "prompt", "'prompt'"),
    ("/v1/chat/completions", '{"model": "hostile", "messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages",
     "'messages[0].content'"),
    ("/v1/chat/completions", '{"model": "hostile", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\ud83d"}]}]}', "messages", "'messages[0].content[0].text'"),
    ("/v1/completions", '{"model": "hostile", "prompt": "a", "stop": ["\\ud800"]}', "stop", "'stop[0]'"),
    ("/v1/completions", '{"model": "hostile", "prompt": "a", "user": "\\ud800"}', "user", "'user'"),
    ("/v1/completions", '{"model": "hostile\\ud800", "prompt": "a"}', "model", "'model'"),
]


@pytest.mark.parametrize("path,body,param,where", SURROGATES, ids=[s[3] for s in SURROGATES])
def test_lone_surrogates_are_a_400_and_the_connection_keeps_working(server, path, body, param, where):
    with httpx.Client() as client:  # one keep-alive connection for both requests
        err = error(post(server, path, body, client), 400)
        assert err["param"] == param and f"{where} is not valid Unicode text: it holds the lone surrogate" in err["message"]
        ok = post(server, "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 1}, client)
        assert ok.status_code == 200, ok.text


def test_a_body_that_is_not_utf8_is_a_400(server):
    err = error(post(server, "/v1/completions", b'{"model": "hostile", "prompt": "\xff\xfe"}'), 400)
    assert "not valid UTF-8" in err["message"]


LOOSE = [  # (fields or raw JSON, param, words): the OpenAI API's types, strictly
    ({"max_tokens": "8"}, "max_tokens", "Invalid type for 'max_tokens': expected an integer, but got a string instead."),
    ({"max_tokens": True}, "max_tokens", "expected an integer, but got a boolean instead"),
    ({"max_tokens": 8.0}, "max_tokens", "expected an integer, but got a number instead"),
    ({"stream": "yes"}, "stream", "Invalid type for 'stream': expected a boolean, but got a string instead."),
    ({"stream": 1}, "stream", "expected a boolean, but got a number instead"),
    ('{"model": "hostile", "prompt": "a", "repetition_penalty": Infinity}', "repetition_penalty",
     "Invalid value for 'repetition_penalty': expected a finite number, but got Infinity."),
    ('{"model": "hostile", "prompt": "a", "temperature": NaN}', "temperature",
     "Invalid value for 'temperature': expected a finite number, but got NaN."),
    ({"temperature": "0.5"}, "temperature", "expected a number, but got a string instead"),
    ({"seed": 1.5}, "seed", "expected an integer, but got a number instead"),
    ({"prompt": [1, True]}, "prompt", "Invalid type for 'prompt[1]': expected an integer, but got a boolean instead."),
    ({"prompt": 5}, "prompt", "expected a string or an array of integers, but got a number instead"),
    ({"stop": 5}, "stop", "expected a string or an array of strings, but got a number instead"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options", "'stream_options.include_usage': expected a boolean"),
    ({"model": 7}, "model", "expected a string, but got a number instead"),
]


@pytest.mark.parametrize("fields,param,words", LOOSE, ids=[str(f)[:40] for f, *_ in LOOSE])
def test_loose_types_are_refused_naming_the_field(server, fields, param, words):
    body = fields if isinstance(fields, str) else {"model": NAME, "prompt": "a", "max_tokens": 1, **fields}
    err = error(post(server, "/v1/completions", body), 400)
    assert err["param"] == param and words in err["message"], err


def test_chat_types_are_strict_too(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": 5}]}
    err = error(post(server, "/v1/chat/completions", body), 400)
    assert err["param"] == "messages" and "Invalid type for 'messages[0].content': expected a string or an array of " \
        "content parts, but got a number instead." in err["message"], err


def test_null_means_not_given_and_integers_are_numbers(server):
    nulls = {"temperature": None, "top_p": None, "max_tokens": None, "stream": None, "n": None, "stop": None,
             "seed": None, "presence_penalty": None, "logprobs": None, "user": None, "stream_options": None}
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "a", **nulls, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 2, "temperature": 1, "top_p": 1})
    assert r.status_code == 200, r.text


def test_sigterm_ends_requests_in_flight_with_errors_and_logs_them(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--shutdown-grace", "1")
    body = {"model": NAME, "prompt": "a", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    whole: list[httpx.Response] = []
    streams: list[list[str]] = [[], []]

    def ask():
        whole.append(post(srv, "/v1/completions", body))

    def stream(events):
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    threads = [threading.Thread(target=ask) for _ in range(2)] + [threading.Thread(target=stream, args=(e,)) for e in streams]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not (srv.health()["active"] == 4 and all(streams)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.health()["active"] == 4 and all(streams), "the four requests did not start"
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert srv.proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn ends as the signal would, after the drain
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(srv.url + "/health", timeout=5)
    finally:
        srv.stop()
    assert len(whole) == 2
    for r in whole:
        err = error(r, 503)
        assert err["type"] == "server_error" and err["code"] == "server_shutdown" and "grace period" in err["message"]
    for events in streams:
        assert events[-1] == "[DONE]" and len(events) >= 3, events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "server_shutdown"
        assert all("choices" in json.loads(e) for e in events[:-2])
    log = srv.log_path.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    ended = [e for e in srv.request_logs() if e["path"] == "/v1/completions"]
    assert sorted(e["status"] for e in ended) == [200, 200, 503, 503]
    assert all(e["finish_reason"] == "shutdown" and 0 < e["completion_tokens"] < 3000 for e in ended), ended
