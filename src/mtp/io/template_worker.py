"""Chat templates rendered in worker processes, with a time, an output-size and a memory limit.

A chat template is code from the checkpoint. The sandbox (io/chat_template.py) keeps it away from Python internals,
but a loop of 10^10 steps or `'x' | center(10**10)` is allowed Jinja, and pure-Python rendering cannot be stopped
from another thread (a single C call such as that `center` cannot be interrupted at all). So templates render in
worker processes: each render runs under a timer inside the worker (SIGALRM ends Python-level loops with a clean
error) and the caller kills the worker when the timer did not help (a long C call) - the caller never waits much
longer than `timeout_s`. The worker's address space is capped (RLIMIT_AS), so a template's allocation is a
MemoryError in the worker, never an out-of-memory kill of the server. The output stops at `max_chars`. The
measurements behind this choice are in docs/decisions.md (2026-12-01, issue 22).

Each worker is `python -P template_worker.py MEMORY_BYTES`: the file is run by path so that the worker imports
only jinja2 and io/chat_template.py (loaded by path as well), not the `mtp` package and torch. One request a
line on stdin, one answer a line on stdout, both JSON. POSIX only (select on pipes, SIGALRM, RLIMIT_AS).
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __name__ != "__main__":  # the worker process runs this file by path, outside the package (see _worker_main)
    from .chat_template import ChatTemplateError, ChatTemplateLimitError

DEFAULT_TIMEOUT_S = 2.0  # real templates render in about a millisecond (docs/decisions.md)
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_WORKERS = 2  # so that one slow render does not hold every chat request up
KILL_AFTER_S = 1.0  # past the timeout, how long the caller waits for the worker's own timer before killing it


class TemplateWorkers:
    """`render(...)` like io/chat_template.py's `render_chat_template`, in one of `workers` worker processes; blocking
    and thread-safe (the server calls it from a thread, never on its event loop). `close()` ends the workers."""

    def __init__(self, workers: int = DEFAULT_WORKERS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers} and {timeout_s}")
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self._all = [_Worker(memory_bytes) for _ in range(workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for w in self._all:
            w.start()  # the worker imports jinja2 while the server loads its model
            self._idle.put(w)

    def render(self, template: str, messages: list[dict], add_generation_prompt: bool = True,
               max_chars: int | None = None, **extra: Any) -> str:
        """The prompt text; ChatTemplateLimitError ("time", "output", "memory") or ChatTemplateError as in-process."""
        request = {"template": template, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "max_chars": max_chars, "extra": extra, "timeout_s": self.timeout_s}
        worker = self._idle.get()
        try:
            return worker.render(request, self.timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for w in self._all:
            w.stop()


class _Worker:
    """One worker process, restarted when it had to be killed or died."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-P", str(Path(__file__).resolve()), str(self.memory_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def stop(self) -> None:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def render(self, request: dict, timeout_s: float) -> str:
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self.start()
            proc = self.proc
            try:
                _write_all(proc.stdin.fileno(), json.dumps(request).encode() + b"\n")
                line = _read_line(proc.stdout, time.monotonic() + timeout_s + KILL_AFTER_S)
            except BrokenPipeError:  # it died before reading the request
                line = b""
            if line is None:  # its own timer did not stop it (a long C call): kill it, start afresh next time
                proc.kill()
                proc.wait()
                self.proc = None
                raise ChatTemplateLimitError("time", time_limit_message(timeout_s))
            if not line:
                code = proc.wait()
                self.proc = None
                raise ChatTemplateError(f"the chat template worker process died (exit status {code})")
        answer = json.loads(line)
        if "text" in answer:
            return answer["text"]
        if answer.get("limit"):
            raise ChatTemplateLimitError(answer["limit"], answer["error"])
        raise ChatTemplateError(answer["error"])


def time_limit_message(timeout_s: float) -> str:
    return f"the chat template exceeded the time limit of {timeout_s:g} s"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_line(stream, deadline: float) -> bytes | None:
    """One line from an unbuffered pipe, b"" at end of file, None when `deadline` passes first."""
    out = bytearray()
    while not out.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            return None
        chunk = stream.read(1 << 16)
        if not chunk:
            return b""
        out += chunk
    return bytes(out)


# ---- the worker process --------------------------------------------------------------------------------------
class _Timeout(BaseException):
    """Raised by SIGALRM inside a render; a BaseException so that no `except Exception` in the template code path
    swallows it."""


def _worker_main(memory_bytes: int) -> None:
    import importlib.util
    import resource

    spec = importlib.util.spec_from_file_location("_mtp_chat_template", Path(__file__).with_name("chat_template.py"))
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    def on_alarm(signum, frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    for line in sys.stdin.buffer:  # ends when the server closes the pipe (or dies)
        req = json.loads(line)
        try:
            signal.setitimer(signal.ITIMER_REAL, req["timeout_s"])
            try:
                text = ct.render_chat_template(req["template"], req["messages"], req["add_generation_prompt"],
                                               max_chars=req["max_chars"], **req["extra"])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            answer = {"text": text}
        except _Timeout:
            answer = {"error": time_limit_message(req["timeout_s"]), "limit": "time"}
        except MemoryError:
            answer = {"error": f"the chat template exceeded the memory limit of {memory_bytes / 2**20:g} MiB",
                      "limit": "memory"}
        except ct.ChatTemplateError as e:
            answer = {"error": str(e), "limit": getattr(e, "limit", None)}
        sys.stdout.buffer.write(json.dumps(answer).encode() + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
