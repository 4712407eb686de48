"""The hostile-input cases of issue 22 against a real `mtp serve` process (loopback, bounded time), with figures.

Each case starts its own server on a free loopback port (the shipped model by default, `--threads 1`) and prints
one JSON line: what the client got, how long `/health` took while the case ran (polled every 0.2 s, 2 s timeout),
and whether SIGTERM stopped the process. Every wait is bounded; a server that ignores SIGTERM is killed.

    python scripts/serve_hostile.py                          # every case, the installed mtp
    python scripts/serve_hostile.py --src /tmp/old/src       # the same against another checkout's code
    python scripts/serve_hostile.py --cases template_loops,sigterm

Cases: template_loops (nested range loops in the chat template), template_output ('x'*10**7 in the template),
big_prompt (a 10 MB prompt while a stream runs), prompt_250k_chars (the same with a prompt that must be tokenized),
big_user (a 10 MB `user` field), surrogate (a lone surrogate in a
prompt / message / stop string, then a second request on the same keep-alive connection), loose_types, sigterm
(SIGTERM with two whole-answer and two streaming requests that need longer than the shutdown grace).
The regression test is tests/test_serve_hostile.py; this script only measures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
NAME = "m"
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 10**7 }}"
HELLO = [{"role": "user", "content": "hi"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_template(model: Path, template: str, out: Path) -> Path:
    """A copy of `model` (weights linked, not copied) whose tokenizer_config.json carries `template`."""
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return out


class Server:
    def __init__(self, model: Path, log: Path, args, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.src:
            env["PYTHONPATH"] = args.src
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "mtp.cli", "serve", "--model", str(model), "--port", str(self.port),
                                      "--threads", "1", "--served-model-name", NAME, *args.server_args, *extra],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("server did not start")

    def post(self, path: str, body, timeout: float = 60, client: httpx.Client | None = None) -> httpx.Response:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        return (client or httpx).post(self.url + path, content=data, headers={"Content-Type": "application/json"},
                                      timeout=timeout)

    def stop(self, wait: float = 20) -> dict:
        """SIGTERM, then SIGKILL if it has not exited within `wait` seconds."""
        t0 = time.monotonic()
        out = {}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=wait)
                out = {"sigterm_exit_s": round(time.monotonic() - t0, 2), "sigkill_needed": False}
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                out = {"sigterm_exit_s": None, "sigkill_needed": True}
        self._log.close()
        text = self.log_path.read_text(errors="replace")
        out |= {"tracebacks": text.count("Traceback"), "cancelled_errors": text.count("CancelledError")}
        return out

    def request_log(self) -> list[dict]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        out = []
        for line in lines:
            if line.startswith('{"event": "request"'):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


class HealthWatch:
    """Polls /health every 0.2 s in a thread; `stop()` gives the slowest answer and the number that timed out."""

    def __init__(self, url: str):
        self.url, self.times, self.failed, self._stop = url, [], 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                httpx.get(self.url + "/health", timeout=2)
                self.times.append(time.monotonic() - t0)
            except httpx.HTTPError:
                self.failed += 1
            self._stop.wait(0.2)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"health_max_s": round(max(self.times, default=0), 3), "health_timeouts": self.failed}


def answer(r: httpx.Response | Exception, t0: float) -> dict:
    if isinstance(r, Exception):
        return {"error": type(r).__name__, "after_s": round(time.monotonic() - t0, 2)}
    try:
        body = r.json().get("error", {}).get("message") if r.headers.get("content-type", "").startswith("application/json") else r.text
    except (ValueError, AttributeError):
        body = r.text
    return {"status": r.status_code, "message": (body or "")[:160], "after_s": round(time.monotonic() - t0, 2)}


def timed_post(srv: Server, path: str, body, timeout: float) -> dict:
    watch, t0 = HealthWatch(srv.url), time.monotonic()
    try:
        r = srv.post(path, body, timeout=timeout)
    except httpx.HTTPError as e:
        r = e
    return answer(r, t0) | watch.stop()


# ---- the cases --------------------------------------------------------------------------------------------
def case_template(args, tmp: Path, template: str, name: str) -> dict:
    srv = Server(with_template(args.model, template, tmp / name), tmp / f"{name}.log", args)
    out = timed_post(srv, "/v1/chat/completions", {"model": NAME, "messages": HELLO, "max_tokens": 1}, timeout=15)
    return out | srv.stop()


def case_big_prompt(args, tmp: Path, prompt: str = "x " * (5 * 10**6), name: str = "big_prompt") -> dict:
    srv = Server(args.model, tmp / f"{name}.log", args)
    gaps, t_last = [], [None]

    def stream():  # a running stream: the longest pause between its events
        body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    now = time.monotonic()
                    if t_last[0] is not None:
                        gaps.append(now - t_last[0])
                    t_last[0] = now
                    if done.is_set():
                        return
        except httpx.HTTPError:
            pass

    done = threading.Event()
    th = threading.Thread(target=stream, daemon=True)
    th.start()
    time.sleep(2)
    out = timed_post(srv, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 1}, timeout=60)
    time.sleep(1)
    done.set()
    th.join(timeout=30)
    return out | {"stream_max_gap_s": round(max(gaps, default=0), 3)} | srv.stop()


def case_big_user(args, tmp: Path) -> dict:
    srv = Server(args.model, tmp / "big_user.log", args)
    out = timed_post(srv, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1, "user": "u" * 10**7}, timeout=60)
    return out | srv.stop()


SURROGATES = {  # raw JSON: the \\ud800 escape is a lone surrogate once parsed
    "prompt": ("/v1/completions", '{"model": "m", "prompt": "a\\ud800b", "max_tokens": 1}'),
    "message": ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}'),
    "stop": ("/v1/completions", '{"model": "m", "prompt": "a", "max_tokens": 1, "stop": ["\\ud800"]}'),
}


def case_surrogate(args, tmp: Path) -> dict:
    srv = Server(args.model, tmp / "surrogate.log", args)
    out = {}
    for where, (path, body) in SURROGATES.items():
        with httpx.Client() as client:  # one keep-alive connection: the bad request, then a good one
            t0 = time.monotonic()
            try:
                first = answer(srv.post(path, body, timeout=30, client=client), t0)
            except httpx.HTTPError as e:
                first = answer(e, t0)
            t0 = time.monotonic()
            try:
                second = answer(srv.post("/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 1}, 30, client), t0)
            except httpx.HTTPError as e:
                second = answer(e, t0)
        out[where] = {"bad": first, "next_on_same_connection": second}
    return out | srv.stop()


LOOSE = {
    "max_tokens_string": {"max_tokens": "8"},
    "max_tokens_true": {"max_tokens": True},
    "max_tokens_float": {"max_tokens": 8.0},
    "stream_yes": {"stream": "yes"},
    "repetition_penalty_inf": '{"model": "m", "prompt": "a", "repetition_penalty": Infinity}',
    "temperature_nan": '{"model": "m", "prompt": "a", "temperature": NaN}',
    "temperature_string": {"temperature": "0.5"},
    "seed_float": {"seed": 1.5},
    "prompt_tokens_bool": {"prompt": [True, False]},
}


def case_loose_types(args, tmp: Path) -> dict:
    srv = Server(args.model, tmp / "loose.log", args)
    out = {}
    for name, extra in LOOSE.items():
        body = extra if isinstance(extra, str) else {"model": NAME, "prompt": "a", "max_tokens": 1, **extra}
        t0 = time.monotonic()
        r = srv.post("/v1/completions", body, timeout=30)
        out[name] = answer(r, t0) | ({"param": r.json()["error"].get("param")} if r.status_code >= 400 and
                                     r.headers.get("content-type", "").startswith("application/json") else {})
    return out | srv.stop()


def case_sigterm(args, tmp: Path) -> dict:
    srv = Server(args.model, tmp / "sigterm.log", args)
    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    results: dict[str, dict] = {}

    def whole(i):
        t0 = time.monotonic()
        try:
            r = srv.post("/v1/completions", body, timeout=90)
            results[f"whole{i}"] = {"status": r.status_code, "content_type": r.headers.get("content-type"),
                                    "body": r.text[:160], "after_s": round(time.monotonic() - t0, 2)}
        except httpx.HTTPError as e:
            results[f"whole{i}"] = {"error": type(e).__name__}

    started = threading.Barrier(3)

    def streamed(i):
        events = []
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=90) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            started.wait(timeout=60)
        except (httpx.HTTPError, threading.BrokenBarrierError) as e:
            events.append(f"<{type(e).__name__}>")
        results[f"stream{i}"] = {"events": len(events), "last": [e[:120] for e in events[-2:]],
                                 "done": bool(events) and events[-1] == "[DONE]",
                                 "error_event": any('"error"' in e for e in events[-2:])}

    threads = [threading.Thread(target=whole, args=(i,)) for i in range(2)] + \
        [threading.Thread(target=streamed, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    time.sleep(1.0)
    stop = srv.stop(wait=60)
    for t in threads:
        t.join(timeout=30)
    logged = [(e["status"], e.get("finish_reason")) for e in srv.request_log() if e["path"] == "/v1/completions"]
    return results | {"logged_completions": logged} | stop


CASES = {
    "template_loops": lambda a, t: case_template(a, t, LOOPS, "template_loops"),
    "template_output": lambda a, t: case_template(a, t, HUGE, "template_output"),
    "big_prompt": case_big_prompt,
    # under the shipped model's bound of 4095 x 64 characters and its 1 MiB body limit: it has to be tokenized
    "prompt_250k_chars": lambda a, t: case_big_prompt(a, t, ("def f(x):\n    return x + 1\n" * 10**4)[:250_000], "prompt_250k"),
    "big_user": case_big_user,
    "surrogate": case_surrogate,
    "loose_types": case_loose_types,
    "sigterm": case_sigterm,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "code-small")
    p.add_argument("--src", default=None, help="put this folder first on the server's PYTHONPATH (another checkout's src/)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    p.add_argument("--server-args", default="", help="extra `mtp serve` flags for every case, space-separated "
                   "(e.g. '--dtype float32' where the CPU lacks bf16 kernels)")
    args = p.parse_args()
    args.model = args.model.resolve()
    args.server_args = args.server_args.split()
    tmp = Path(tempfile.mkdtemp(prefix="mtp-hostile-"))
    try:
        for name in args.cases.split(","):
            t0 = time.monotonic()
            out = CASES[name](args, tmp)
            print(json.dumps({"case": name, "wall_s": round(time.monotonic() - t0, 1), **out}, ensure_ascii=True), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
