"""Prometheus metrics on GET /metrics: the app in process (httpx's ASGI transport) with speculative decoding on;
the counters must move by exactly what the requests did."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mtp
from mtp.serve.app import create_app
from mtp.serve.engine import Engine
from mtp.serve.metrics import Metrics, finished_reason
from serve_support import build_trained_model_dir

NAME = "trained"
PROMPTS = ["abcabcabc", "cdcdcdcdc", "hgahgahga", "abdeabdeabde"]
MAX_TOKENS = 20
DRAFT_TOKENS = 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = mtp.load_model(build_trained_model_dir(tmp_path_factory.mktemp("metrics") / NAME))
    eng = Engine(model, draft_tokens=DRAFT_TOKENS, max_concurrency=4)
    yield eng
    eng.shutdown()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value of a Prometheus text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def drive(app, calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    """Send (method, path, json body) requests to the app in order."""
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.request(method, path, json=body) for method, path, body in calls]
    return asyncio.run(go())


def test_metrics_count_what_the_requests_did(engine):
    app = create_app(engine, NAME)
    body = {"model": NAME, "max_tokens": MAX_TOKENS, "temperature": 0}
    calls = [("POST", "/v1/completions", {**body, "prompt": p, "stream": i == 1, "stream_options": {"include_usage": True}})
             for i, p in enumerate(PROMPTS)]
    calls += [("POST", "/v1/completions", {**body, "model": "nope", "prompt": "x"}),  # 404: unknown model
              ("GET", "/v2/nothing", None),  # 404: no such route
              ("POST", "/v1/completions", {**body, "prompt": "x", "max_tokens": 10**6}),  # 400: over the context
              ("GET", "/metrics", None)]
    responses = drive(app, calls)
    assert [r.status_code for r in responses] == [200] * len(PROMPTS) + [404, 404, 400, 200]
    assert responses[-1].headers["content-type"].startswith("text/plain")

    usages = [r.json()["usage"] for r in responses[:len(PROMPTS)] if r.headers["content-type"] == "application/json"]
    stream = [line for line in responses[1].text.splitlines() if line.startswith("data: {")]
    usages.append(json.loads(stream[-1].removeprefix("data: "))["usage"])
    m = samples(responses[-1].text)
    assert value(m, "mtp:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert value(m, "mtp:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value(m, "mtp:request_success_total", finished_reason="length") + \
        value(m, "mtp:request_success_total", finished_reason="stop") == len(PROMPTS)
    assert value(m, "mtp:request_success_total", finished_reason="error") == 0
    assert value(m, "mtp:e2e_request_latency_seconds_count") == len(PROMPTS)
    assert value(m, "mtp:time_to_first_token_seconds_count") == len(PROMPTS)
    assert value(m, "mtp:num_requests_running") == 0 and value(m, "mtp:num_requests_waiting") == 0
    steps = value(m, "mtp:batch_size_count")
    assert steps >= len(PROMPTS) and value(m, "mtp:batch_size_sum") == steps  # one request per step today

    # speculative counters: exactly the rounds the decoder made for these prompts
    model = engine.model
    runs = [mtp.generate(model, model.tokenizer.encode(p), max_new_tokens=MAX_TOKENS, draft_tokens=DRAFT_TOKENS).stats
            for p in PROMPTS]
    rounds = [(k, n) for st in runs for k, n in zip(st.k_history, st.n_history) if k > 0]
    drafted, accepted = value(m, "mtp:spec_decode_num_draft_tokens_total"), value(m, "mtp:spec_decode_num_accepted_tokens_total")
    assert value(m, "mtp:spec_decode_num_drafts_total") == len(rounds)
    assert drafted == sum(k for k, _ in rounds) and accepted == sum(n for _, n in rounds)
    assert 0 < accepted < drafted
    per_pos = [value(m, "mtp:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(1, 9)]
    assert per_pos[0] >= per_pos[1] >= per_pos[2] and per_pos[0] > 0 and sum(per_pos) == accepted
    assert per_pos[0] == sum(st.accepted[0] for st in runs if st.accepted)

    http = {(dict(labels)["path"], dict(labels)["status"]): v for (name, labels), v in m.items() if name == "mtp:http_requests_total"}
    assert http[("/v1/completions", "200")] == len(PROMPTS)
    assert http[("/v1/completions", "404")] == 1 and http[("unmatched", "404")] == 1
    assert http[("/v1/completions", "400")] == 1
    assert engine.active == 0

    # a second app in the same process counts on its own (its own registry)
    again = samples(drive(create_app(engine, NAME), [("GET", "/metrics", None)])[0].text)
    assert value(again, "mtp:generation_tokens_total") == 0 and value(again, "mtp:spec_decode_num_drafts_total") == 0


def test_a_failed_generation_counts_once_as_an_error(engine, monkeypatch):
    from mtp.decode.decoder import Decoder as BatchDecoder

    real_step = BatchDecoder.step

    def failing_step(self):
        if any(s.decoding and s.session.new_tokens for s in self.rows):  # after the first token
            raise RuntimeError("simulated failure")
        return real_step(self)

    monkeypatch.setattr(BatchDecoder, "step", failing_step)
    app = create_app(engine, NAME)
    body = {"model": NAME, "prompt": "abc", "max_tokens": 5, "temperature": 0}
    responses = drive(app, [("POST", "/v1/completions", body), ("POST", "/v1/completions", {**body, "stream": True}),
                            ("GET", "/metrics", None)])
    assert [r.status_code for r in responses] == [500, 200, 200]
    m = samples(responses[-1].text)
    assert value(m, "mtp:request_success_total", finished_reason="error") == 2  # one per request, the stream counted once
    assert sum(value(m, "mtp:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")) == 0
    assert value(m, "mtp:generation_tokens_total") > 0 and value(m, "mtp:num_requests_running") == 0
    http = {(dict(labels)["path"], dict(labels)["status"]): v for (name, labels), v in m.items() if name == "mtp:http_requests_total"}
    assert http[("/v1/completions", "500")] == 1 and http[("/v1/completions", "200")] == 1


def test_speculative_round_and_reasons():
    met = Metrics()
    met.speculative_round(3, 2)
    met.speculative_round(3, 0)
    met.speculative_round(0, 0)  # a plain step drafted nothing
    met.speculative_round(1, 1)
    with pytest.raises(ValueError):
        met.speculative_round(2, 3)
    with pytest.raises(ValueError):
        met.request_finished("eos", 1, 1, 0.1, None)  # the decoder's reason must be mapped first
    m = samples(met.render()[0].decode())
    assert value(m, "mtp:spec_decode_num_drafts_total") == 3
    assert value(m, "mtp:spec_decode_num_draft_tokens_total") == 7
    assert value(m, "mtp:spec_decode_num_accepted_tokens_total") == 3
    assert [value(m, "mtp:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in (1, 2, 3)] == [2, 1, 0]
    assert [finished_reason(r) for r in ("eos", "stop", "length")] == ["stop", "stop", "length"]
    assert finished_reason(None, failed=True) == "error" and finished_reason(None) == "abort"
