"""Bounded load test for a running `mtp serve`: C concurrent clients x R requests each, through the
official `openai` client (no retries, so every failure counts), cycling through completions and chat,
streaming and not. Prints requests/s and latency percentiles; exits 1 if any request failed or the
server is not healthy (and idle) afterwards.

    mtp serve --model models/code-small --port 8000 &
    python scripts/serve_loadtest.py --base-url http://127.0.0.1:8000/v1 --clients 8 --requests 20
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx
import openai


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def one_request(client: openai.OpenAI, model: str, i: int, prompt: str, max_tokens: int) -> int:
    """Request number i (kind = i mod 4); returns the completion tokens."""
    kind = i % 4
    common = dict(model=model, max_tokens=max_tokens, temperature=0)
    if kind == 0:
        return client.completions.create(prompt=prompt, **common).usage.completion_tokens
    if kind == 1:
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True}, **common))
        return chunks[-1].usage.completion_tokens
    messages = [{"role": "user", "content": prompt}]
    if kind == 2:
        return client.chat.completions.create(messages=messages, **common).usage.completion_tokens
    chunks = list(client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True},
                                                 **common))
    return chunks[-1].usage.completion_tokens


def run(base_url: str, api_key: str, clients: int, requests: int, max_tokens: int, prompt: str) -> dict:
    probe = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = probe.models.list().data[0].id
    latencies: list[float] = []
    failures: list[str] = []
    tokens = [0]
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
        for r in range(requests):
            t = time.perf_counter()
            try:
                n = one_request(client, model, c + r, prompt, max_tokens)
            except Exception as e:  # a failed request is the measurement, not a crash of the load test
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                latencies.append(time.perf_counter() - t)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10).json()
    return {"model": model, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
            "requests": clients * requests, "ok": len(latencies), "failed": len(failures), "failures": failures[:5],
            "wall_s": round(wall, 3), "requests_per_s": round(len(latencies) / wall, 2),
            "completion_tokens_per_s": round(tokens[0] / wall, 1),
            "latency_p50_s": round(percentile(latencies, 50), 4) if latencies else None,
            "latency_p95_s": round(percentile(latencies, 95), 4) if latencies else None,
            "latency_max_s": round(max(latencies), 4) if latencies else None,
            "health_after": health}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=20, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args()
    out = run(args.base_url, args.api_key, args.clients, args.requests, args.max_tokens, args.prompt)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['ok']}/{out['requests']} ok ({out['clients']} clients x {out['requests_per_client']}, max_tokens "
              f"{out['max_tokens']}) in {out['wall_s']}s: {out['requests_per_s']} req/s, "
              f"{out['completion_tokens_per_s']} tok/s; latency p50 {out['latency_p50_s']}s p95 {out['latency_p95_s']}s "
              f"max {out['latency_max_s']}s; health after: {out['health_after']}")
        for f in out["failures"]:
            print("  failure:", f)
    healthy = out["health_after"].get("status") == "ok" and out["health_after"].get("active") == 0
    return 0 if out["failed"] == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
