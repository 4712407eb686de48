"""Bounded load test for `mtp serve`, two ways.

Against a running server: C concurrent clients x R requests each, through the official `openai` client
(no retries, so every failure counts), cycling through completions and chat, streaming and not. Prints
requests/s and latency percentiles; exits 1 if any request failed or the server is not healthy (and idle)
afterwards.

    mtp serve --model models/code-small --port 8000 &
    python scripts/serve_loadtest.py --base-url http://127.0.0.1:8000/v1 --clients 8 --requests 20

A throughput table: with --model, one `mtp serve` per mode (off = plain decoding, on = 3 drafts, auto, or a
number of drafts) on a free loopback port; at each concurrency level, that many clients send greedy
completions of the shipped code prompts. Prints a Markdown table (total new tokens/s, latency p50/p95) and,
per mode, C concurrent clients against the same C requests sent one after another. Exits 1 on any failed
request. (--concurrency without --model: the same table for the server at --base-url.)

    python scripts/serve_loadtest.py --model models/code-small --concurrency 1,2,4,8,16 --modes off,on,auto \
        --max-tokens 96 --requests-per-client 2 --json loadtest.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


# greedy without the model's default repetition penalty (generation_config.json), so every mode decodes the same text
PURE_GREEDY = {"repetition_penalty": 1.0}


def one_request(client: openai.OpenAI, model: str, i: int, prompt: str, max_tokens: int) -> int:
    """Request number i (kind = i mod 4); returns the completion tokens."""
    kind = i % 4
    common = dict(model=model, max_tokens=max_tokens, temperature=0, extra_body=PURE_GREEDY)
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


class Tally:
    """Latency, failure and completion-token counts of requests sent from several threads."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0  # prompt tokens the server took from its prompt cache
        self.lock = threading.Lock()

    def send(self, request) -> None:
        """Time `request()` (which returns its completion tokens, or (completion, prompt, cached prompt) tokens) and
        count it."""
        t = time.perf_counter()
        try:
            n = request()
        except Exception as e:  # a failed request is the measurement, not a crash of the load test
            with self.lock:
                self.failures.append(f"{type(e).__name__}: {e}")
            return
        n, prompt, cached = (n, 0, 0) if isinstance(n, int) else n
        with self.lock:
            self.latencies.append(time.perf_counter() - t)
            self.tokens += n
            self.prompt_tokens += prompt
            self.cached_tokens += cached

    def latency(self, q: float) -> float | None:
        return round(percentile(self.latencies, q), 4) if self.latencies else None


def openai_clients(base_url: str, api_key: str, n: int, timeout: float) -> list[openai.OpenAI]:
    """n clients, made before a level's clock starts: making one takes 15-35 ms of Python here, and 8 made inside the
    timed threads (under one GIL) held back the last clients' first requests by ~150 ms, 12% of an 8-client level's
    wall time, which the sequential baseline (one client) did not pay (docs/decisions.md, 2026-12-06 seventh session)."""
    return [openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout) for _ in range(n)]


def in_threads(clients: int, loop) -> float:
    """Run loop(c) for c in range(clients), one thread each; returns the wall time."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(c,)) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def run(base_url: str, api_key: str, clients: int, requests: int, max_tokens: int, prompt: str) -> dict:
    probe = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = probe.models.list().data[0].id
    tally = Tally()

    made = openai_clients(base_url, api_key, clients, 120)

    def client_loop(c: int) -> None:
        for r in range(requests):
            tally.send(lambda: one_request(made[c], model, c + r, prompt, max_tokens))  # noqa: B023 - called at once

    wall = in_threads(clients, client_loop)
    health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10).json()
    ok = len(tally.latencies)
    return {"model": model, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
            "requests": clients * requests, "ok": ok, "failed": len(tally.failures), "failures": tally.failures[:5],
            "wall_s": round(wall, 3), "requests_per_s": round(ok / wall, 2),
            "completion_tokens_per_s": round(tally.tokens / wall, 1),
            "latency_p50_s": tally.latency(50), "latency_p95_s": tally.latency(95),
            "latency_max_s": round(max(tally.latencies), 4) if tally.latencies else None,
            "health_after": health}


# ---- the throughput table ------------------------------------------------------------------------------
MODES = {"off": "0", "on": "3", "auto": "auto"}  # mode -> the server's --draft-tokens (a number 0..8 is itself)
COMPARE_AT = 8  # "8 concurrent clients" vs "the same 8 requests one after another" (the largest level if 8 is not run)


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def code_prompts(path: str | None) -> list[str]:
    """The code prompts ("kind": "code") of a bench prompt file (default: the shipped set)."""
    from mtp.bench.prompts import load_prompts

    prompts = [p.text for p in load_prompts(path) if p.kind == "code"]
    if not prompts:
        raise SystemExit(f"no code prompts in {path or 'the shipped prompt set'}")
    return prompts


class Server:
    """`python -m mtp.cli serve` on a free loopback port for one mode; its output goes to `log_path`."""

    def __init__(self, model: str, draft_tokens: str, extra: list[str], log_path: Path, startup_timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "mtp.cli", "serve", "--model", model, "--port", str(self.port),
               "--draft-tokens", draft_tokens, "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"mtp serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url.removesuffix("/v1") + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mtp serve did not answer /health in {startup_timeout}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


def completion(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, temperature: float = 0.0,
               penalty: float = 1.0) -> tuple[int, int, int]:
    """One completion, greedy or sampled at `temperature` (no seed), with repetition penalty `penalty` (1: none);
    returns its completion tokens, prompt tokens and the prompt tokens the server took from its prompt cache."""
    usage = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                      extra_body={"repetition_penalty": penalty}).usage
    details = usage.prompt_tokens_details
    return usage.completion_tokens, usage.prompt_tokens, (details.cached_tokens or 0) if details else 0


def level(base_url: str, api_key: str, model: str, prompts: list[str], clients: int, per_client: int, max_tokens: int,
          sequential: bool = False, temperature: float = 0.0, penalty: float = 1.0) -> dict:
    """`clients` clients x `per_client` requests (request i = r * clients + c sends prompt i mod len(prompts)), all at
    once, or with `sequential` one after another in request order. Returns the row of figures."""
    tally = Tally()

    def send(client: openai.OpenAI, i: int) -> None:
        tally.send(lambda: completion(client, model, prompts[i % len(prompts)], max_tokens, temperature, penalty))

    made = openai_clients(base_url, api_key, 1 if sequential else clients, 600)

    def client_loop(c: int) -> None:
        for r in range(per_client):
            send(made[c], r * clients + c)

    if sequential:
        t0 = time.perf_counter()
        for i in range(clients * per_client):
            send(made[0], i)
        wall = time.perf_counter() - t0
    else:
        wall = in_threads(clients, client_loop)
    health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10).json()
    if health.get("status") != "ok" or health.get("active") != 0:
        tally.failures.append(f"server not healthy and idle after the level: {health}")
    return {"concurrency": 1 if sequential else clients, "sequential": sequential, "requests": clients * per_client,
            "ok": len(tally.latencies), "failed": len(tally.failures), "failures": tally.failures[:5],
            "new_tokens": tally.tokens, "prompt_tokens": tally.prompt_tokens, "cached_tokens": tally.cached_tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tally.tokens / wall, 2),
            "latency_p50_s": tally.latency(50), "latency_p95_s": tally.latency(95)}


def sweep(base_url: str, api_key: str, mode: str, prompts: list[str], levels: list[int], per_client: int,
          max_tokens: int, temperature: float = 0.0, penalty: float = 1.0) -> tuple[list[dict], dict | None]:
    """One server: a warm-up request, each concurrency level, then the sequential baseline (requests greedy, or
    sampled at `temperature`; repetition penalty `penalty`). Returns (rows, baseline); a failed warm-up is the only row
    (and no baseline)."""
    model = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600).models.list().data[0].id
    warm = level(base_url, api_key, model, prompts, 1, 1, max_tokens, True, temperature, penalty)  # (first-call costs)
    if warm["failed"]:
        return [{"mode": f"{mode} (warm-up)", **warm}], None
    rows = []
    for c in levels:
        row = {"mode": mode, **level(base_url, api_key, model, prompts, c, per_client, max_tokens, False, temperature,
                                     penalty)}
        print(f"  {mode}: {c} clients: {row['ok']}/{row['requests']} ok, {row['tokens_per_s']} tok/s", file=sys.stderr, flush=True)
        rows.append(row)
    compare = COMPARE_AT if COMPARE_AT in levels else max(levels)
    baseline = {"mode": mode, **level(base_url, api_key, model, prompts, compare, 1, max_tokens, True, temperature,
                                      penalty)}
    return rows, baseline


def cell(value) -> str:
    return "-" if value is None else str(value)


def markdown_table(rows: list[dict]) -> str:
    lines = ["| mode | concurrency | requests | new tokens/s (total) | p50 latency (s) | p95 latency (s) | prompt tokens "
             "from the cache |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']} | "
                     f"{cell(r['latency_p50_s'])} | {cell(r['latency_p95_s'])} | {cached_share(r)} |")
    return "\n".join(lines)


def cached_share(row: dict) -> str:
    """The share of a row's prompt tokens the server did not read (its prompt cache held them)."""
    return f"{row['cached_tokens'] / row['prompt_tokens']:.0%}" if row.get("prompt_tokens") else "-"


def comparison(rows: list[dict], baseline: dict) -> str:
    """One line: C concurrent clients' total throughput against the same C requests one after another."""
    c = baseline["requests"]
    conc = next(r for r in rows if r["mode"] == baseline["mode"] and r["concurrency"] == c)
    ratio = conc["tokens_per_s"] / baseline["tokens_per_s"] if baseline["tokens_per_s"] else float("nan")
    return (f"- {baseline['mode']}: {c} concurrent clients {conc['tokens_per_s']} tok/s total vs the same {c} requests one "
            f"after another {baseline['tokens_per_s']} tok/s ({ratio:.2f}x; prompt tokens from the cache "
            f"{cached_share(conc)} / {cached_share(baseline)})")


def parse_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def table_main(args) -> int:
    """The throughput table (see the module docstring); 1 if any request failed."""
    levels = sorted({int(c) for c in parse_list(args.concurrency or "1,2,4,8,16")})
    if not levels or levels[0] < 1:
        raise SystemExit("--concurrency: positive integers, e.g. 1,2,4,8")
    per_client = args.requests or 2
    prompts = code_prompts(args.prompts)
    rows: list[dict] = []
    baselines: list[dict | None] = []
    if args.model:
        modes = parse_list(args.modes)
        for m in modes:
            if m not in MODES and not (m.isdigit() and 0 <= int(m) <= 8):
                raise SystemExit(f"--modes: each one of {', '.join(MODES)} or a number of drafts 0..8, got {m!r}")
        extra = ["--max-concurrency", str(max(levels)), "--dtype", args.dtype, "--device", args.device]
        if args.threads:
            extra += ["--threads", str(args.threads)]
        if args.prompt_cache_mb is not None:
            extra += ["--prompt-cache-mb", str(args.prompt_cache_mb)]
        with tempfile.TemporaryDirectory(prefix="mtp-loadtest-") as tmp:
            for m in modes:
                print(f"mode {m}: starting mtp serve --draft-tokens {MODES.get(m, m)}", file=sys.stderr, flush=True)
                try:
                    server = Server(args.model, MODES.get(m, m), extra, Path(tmp) / f"serve-{m}.log", args.startup_timeout)
                except RuntimeError as e:
                    print(f"mode {m}: {e}", file=sys.stderr)
                    return 1
                try:
                    r, b = sweep(server.url, "none", m, prompts, levels, per_client, args.max_tokens, args.temperature,
                                 args.repetition_penalty)
                finally:
                    server.stop()
                rows += r
                baselines.append(b)
                if b is None or any(x["failed"] for x in [*r, b]):
                    print(f"mode {m}: the server's log ends:\n{server.log_tail()}", file=sys.stderr)
    else:
        health = httpx.get(args.base_url.removesuffix("/v1") + "/health", timeout=10).json()
        mode = f"draft_tokens={health.get('draft_tokens')}"
        rows, b = sweep(args.base_url, args.api_key, mode, prompts, levels, per_client, args.max_tokens, args.temperature,
                        args.repetition_penalty)
        baselines.append(b)

    how = "greedy" if args.temperature == 0 else f"sampled at temperature {args.temperature} (no seed)"
    if args.repetition_penalty != 1.0:
        how += f", repetition penalty {args.repetition_penalty}"
    print(f"max_tokens {args.max_tokens}, {per_client} request(s) per client, {how}, {len(prompts)} code prompts\n")
    print(markdown_table(rows))
    print()
    baselines = [b for b in baselines if b is not None]
    for b in baselines:
        print(comparison(rows, b))
    failed = [f for x in rows + baselines for f in x["failures"]]
    for f in failed[:10]:
        print("  failure:", f)
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps({"max_tokens": args.max_tokens, "temperature": args.temperature,
                                               "repetition_penalty": args.repetition_penalty,
                                               "requests_per_client": per_client,
                                               "rows": rows, "sequential": baselines}, indent=1))
    elif args.json:
        print(json.dumps({"rows": rows, "sequential": baselines}))
    return 1 if any(x["failed"] for x in rows + baselines) else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="a running server (without --model)")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (against --base-url, without --concurrency)")
    p.add_argument("--requests", "--requests-per-client", dest="requests", type=int, default=None,
                   help="requests per client (default: 20 against --base-url; 2 per level for the table)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="def fibonacci(n):", help="the prompt against --base-url (the table uses --prompts)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT",
                   help="--json alone: print the figures as JSON; --json OUT: also save the table's rows to OUT")
    table = p.add_argument_group("the throughput table")
    table.add_argument("--model", default=None, help="start `mtp serve --model MODEL` per mode (a folder or hub id)")
    table.add_argument("--concurrency", default=None, help="concurrency levels, comma-separated (default 1,2,4,8,16)")
    table.add_argument("--modes", default="off,on,auto", help="off (plain), on (3 drafts), auto, or a number of drafts")
    table.add_argument("--prompts", default=None, help="bench prompt JSONL (default: the shipped set); its code prompts are sent")
    table.add_argument("--threads", type=int, default=None, help="the servers' --threads")
    table.add_argument("--temperature", type=float, default=0.0,
                       help="sample the table's requests at this temperature (no seed; default 0: greedy)")
    table.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="the table's requests' repetition penalty (default 1: none, whatever the model's "
                            "generation_config says; the shipped model's is 1.2)")
    table.add_argument("--prompt-cache-mb", type=int, default=None,
                       help="the servers' --prompt-cache-mb (0: off; default: the server's). The table's requests "
                            "repeat the code prompts, so a prompt cache reads each once")
    table.add_argument("--dtype", default="auto", help="the servers' --dtype")
    table.add_argument("--device", default="auto", help="the servers' --device")
    table.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to load its model")
    args = p.parse_args()
    if args.model or args.concurrency:
        return table_main(args)
    out = run(args.base_url, args.api_key, args.clients, args.requests or 20, args.max_tokens, args.prompt)
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
