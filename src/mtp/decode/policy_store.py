"""`auto`'s measurements kept from one process to the next: what a model's rounds cost on this machine, and how its
drafts were accepted.

`auto` learns the round times (`policy.RoundTimes`) and the acceptance (`policy.Acceptance`) as it decodes, and an
in-process model keeps them for its next generation. A new process started from nothing: its first generation
measured k = 0, tried every unmeasured k once and probed every 8th round while the fit settled, which cost a one-shot
`mtp generate` (auto is its default) ~3% against starting from an earlier process's measurements (the shipped model
in int8 and bf16, 7 prompts x 3 fresh processes, AMX Xeon; docs/decisions.md, sixteenth session). A store file per
(model files, how they were prepared, decoding setup, machine) holds them between processes: read when a process
first decodes with that model and setup, written at the process's exit when they changed (`mtp serve` writes it in
its shutdown: uvicorn ends the process by the signal, past atexit).

The file lives in $MTP_CACHE (or ~/.cache/mtp)/auto, one JSON object a key (`key`); it is a cache: a file that does
not parse or does not hold what it should is ignored (logged) and replaced at exit, a write goes to a temporary
renamed into place (a reader never sees half a file), and a failed write only logs. Models built in code (no folder)
keep nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import threading
from collections import Counter
from pathlib import Path

import torch

from ..io.files import cache_root
from ..model.linear import FastLinear
from .policy import QUIET_MAX, SETTLED_MAX, WINDOW, Acceptance, RoundTimes

log = logging.getLogger("mtp.decode")
VERSION = 1
# (B, k) pairs a file may hold: an eager round keys its times by its decoding rows (1 .. a server's max batch), a
# compiled one by its bucket, times k = 0 .. k_max (a server of 64 rows: 576; at 256 there was no room past 28 rows)
MAX_KEYS = 8192
MAX_DEPTH = 16  # draft positions an acceptance record may hold
MAX_FILES = 256  # store files kept (the oldest written go first)

_lock = threading.Lock()
# file -> (key, the RoundTimes and Acceptance to write at exit, what was read or last written)
_open: dict[Path, tuple[dict, RoundTimes, Acceptance, str | None]] = {}
_read: set[Path] = set()  # the files measurements were read from


def enabled() -> bool:
    """Kept across processes unless MTP_AUTO_STORE=0."""
    return os.environ.get("MTP_AUTO_STORE", "1") != "0"


def key(model, setup: tuple, vocab: int | None) -> dict | None:
    """What the measurements depend on, or None where nothing is kept (a model not loaded from a folder):
    the folder and the size and time of each of its weight and JSON files (a checkpoint saved again is another model),
    how the model runs (dtype, device, each linear layer's kernel, the drafts' precision), the decoder's setup
    (`Decoder`: compiled, threads, masks, batch) and the draft vocabulary's size, and the machine (CPU, torch). (Not
    mtp's version: a round's cost that a change of the code moved is measured again within WINDOW rounds.)"""
    if model.source_path is None:
        return None
    folder = Path(model.source_path).resolve()
    try:
        files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()
                       if p.suffix in (".safetensors", ".json") and p.is_file())
    except OSError:
        return None
    kernels = Counter(m.kernel or "torch" for m in model.modules() if isinstance(m, FastLinear))
    return _as_json({
        "version": VERSION, "folder": str(folder), "files": [list(f) for f in files], "dtype": str(model.dtype),
        "device": str(model.device), "kernels": sorted(kernels.items()), "draft_quantize": model.draft_quantize,
        "setup": list(setup), "vocab": vocab, "cpu": _cpu_name(), "isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "machine": platform.machine()})


def _as_json(value):
    """`value` as it reads back from its JSON (tuples as lists): a key compares equal to the one a file holds."""
    return json.loads(json.dumps(value))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def path_for(k: dict) -> Path:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "auto" / f"{digest}.json"


def load(k: dict, rounds: RoundTimes, counts: Acceptance, fill_counts: bool = True) -> bool:
    """Fill a fresh `rounds` (and, with `fill_counts`, a fresh `counts`) from the store file of key `k`, and write
    them there at exit. Returns whether the file was read."""
    path = path_for(k)
    text = None
    try:
        text = path.read_text()
        data = json.loads(text)
        if data.get("key") != k:
            raise ValueError("it was written for another key")
        _fill(data, rounds, counts, fill_counts)
        found = True
    except FileNotFoundError:
        found = False
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("ignoring %s (auto's stored measurements): %s", path, e)
        rounds.__init__()
        if fill_counts:
            counts.__init__()
        found, text = False, None
    with _lock:
        if not _open:
            atexit.register(save_all)
        _open[path] = (k, rounds, counts, text if found else None)
        if found:
            _read.add(path)
    return found


def read() -> list[Path]:
    """The store files this process read measurements from (what `auto` started from)."""
    with _lock:
        return sorted(_read)


def _fill(data: dict, rounds: RoundTimes, counts: Acceptance, fill_counts: bool) -> None:
    """Validate a parsed file (ValueError / TypeError / KeyError naming what is wrong) and fill rounds, counts."""
    r = data["rounds"]
    samples = r["samples"]
    if not isinstance(samples, list) or len(samples) > MAX_KEYS:
        raise ValueError(f"rounds.samples: a list of at most {MAX_KEYS} entries expected")
    filled: dict[tuple[int, int], list[float]] = {}
    for entry in samples:
        b, kk, times = entry
        if not (isinstance(b, int) and isinstance(kk, int) and 1 <= b <= 4096 and 0 <= kk <= MAX_DEPTH):
            raise ValueError(f"rounds.samples: batch and k out of range: {b!r}, {kk!r}")
        if not (isinstance(times, list) and 1 <= len(times) <= WINDOW
                and all(isinstance(t, float | int) and math.isfinite(t) and 0 < t < 60 for t in times)):
            raise ValueError(f"rounds.samples ({b}, {kk}): 1..{WINDOW} round times in (0, 60) s expected")
        filled[(b, kk)] = [float(t) for t in times]
    quiet, settled, rested = r["quiet"], r["settled"], r["rested"]
    if not (isinstance(quiet, int) and 0 <= quiet <= QUIET_MAX and isinstance(settled, int)
            and 0 <= settled <= SETTLED_MAX and isinstance(rested, int) and 0 <= rested < 1 << 30):
        raise ValueError("rounds: quiet, settled or rested out of range")
    states = data["acceptance"]
    if not (isinstance(states, list) and len(states) == len(counts.by_state)):
        raise ValueError(f"acceptance: {len(counts.by_state)} states expected")
    for s in states:
        offered, accepted = s["offered"], s["accepted"]
        if not (isinstance(offered, list) and isinstance(accepted, list) and len(offered) == len(accepted) <= MAX_DEPTH
                and all(_count(x) and _count(y) and y <= x for x, y in zip(offered, accepted))):
            raise ValueError(f"acceptance: at most {MAX_DEPTH} offered and accepted counts, 0 <= accepted <= offered")
    for (b, kk), times in filled.items():
        for t in times:
            rounds.record((b, kk), t)
    rounds.quiet, rounds.settled, rounds.rested = quiet, settled, rested
    for c, s in zip(counts.by_state if fill_counts else (), states):
        c.offered, c.accepted = [float(x) for x in s["offered"]], [float(y) for y in s["accepted"]]


def _count(x) -> bool:
    return isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x < 1e9


def dump(k: dict, rounds: RoundTimes, counts: Acceptance) -> str:
    return json.dumps({"key": k, "rounds": {"samples": [[b, kk, t] for (b, kk), t in sorted(rounds.samples.items())],
                                            "quiet": rounds.quiet, "settled": rounds.settled, "rested": rounds.rested},
                       "acceptance": [{"offered": c.offered, "accepted": c.accepted} for c in counts.by_state]},
                      sort_keys=True)


def save_all() -> None:
    """Write every store file whose measurements changed since they were read (at exit; a failure only logs)."""
    with _lock:
        todo = list(_open.items())
    for path, (k, rounds, counts, before) in todo:
        try:
            text = dump(k, rounds, counts)
        except RuntimeError as e:  # (a server's decoding thread still recording at exit: its dict changed mid-read)
            log.warning("could not keep auto's measurements in %s: %s", path, e)
            continue
        if text == before:
            continue
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not keep auto's measurements in %s: %s", path, e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            continue
        with _lock:
            _open[path] = (k, rounds, counts, text)
        _prune(path.parent)


def _prune(folder: Path) -> None:
    """Keep the MAX_FILES most recently written store files (each setup, checkpoint version or machine adds one)."""
    try:
        files = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime_ns)
        for f in files[:-MAX_FILES]:
            f.unlink(missing_ok=True)
    except OSError as e:  # (another process pruning at the same time)
        log.debug("pruning %s: %s", folder, e)
