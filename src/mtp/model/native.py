"""Our C kernels for x86 CPUs: each ships as one C source beside this file and is compiled with the system's C
compiler (`$CC`, else `cc`) into $MTP_CACHE (or ~/.cache/mtp)/kernels, keyed by the source, the flags and the compiler
(0.1-2 s each), then loaded with ctypes on first use. A CPU model load first compiles every build missing from the
cache side by side (`prebuild`). They share torch's OpenMP runtime.

- `qmatmul.c`: int8/int4 weights times int8 activations (the quantized linear kernels, qmatmul.py) and bf16 weights
  times bf16 activations, built for AVX-512 VNNI where the CPU has it (`Isa`: the same bits, fewer instructions) and
  for AVX-512 BF16 where it has that too (its bf16 products by `vdpbf16ps`, with their own bits);
- `deltanet.c`: the Gated DeltaNet decode step and its keep (deltanet_kernel.py);
- `attention.c`: decode attention (attention_kernel.py);
- `norm.c`: RMSNorm (norm_kernel.py);
- `argmax.c`: the greedy choice over a vocabulary (argmax_kernel.py);
- `act.c`: SwiGLU's `silu(gate) * up` and the attention gate `out * sigmoid(gate)` (act.py);
- `step.c`: a Qwen3.5 dense decode forward, and its MTP's greedy draft chain, as one call each over the kernels
  above, reached through their function pointers (step.py);
- `../decode/round.c`: the end of a greedy round, accept and keep (decode/round_kernel.py: a source given by path);
- `rtn.c`: round-to-nearest int8 / int4 quantization of float weights, what a `--quantize` load spends (rtn.py);
- `native.h`: what they share (bf16 conversions, one vector exp); a build is keyed on it too.

Where a library cannot be used (not x86-64 Linux with AVX2/FMA/F16C, no compiler, a failed build, or disabled by its
environment switch or by MTP_NATIVE=0) the callers keep torch's kernels; `NativeLibrary.available()` says which and
`reason()` why not. Every kernel here is row-invariant by construction (an output's arithmetic depends only on its own
inputs, in one fixed order), so a verify row or a batch row is bit for bit its plain step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..io.files import cache_root

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
CPU_FLAGS = ("avx2", "fma", "f16c")
HEADER = Path(__file__).with_name("native.h")  # included by every source


@dataclass(frozen=True)
class Isa:
    """A build of a source for CPUs with more than the baseline: its extra compiler flags, and the /proc/cpuinfo flags
    a CPU needs to run it."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    ready: str | None = None  # a function of the library that returns 0 when this process may run the build


# AVX-512 VNNI (Intel since Cascade Lake, AMD since Zen 4): qmatmul.c's u8 x s8 products in one instruction. 256-bit
# vectors still (-mprefer-vector-width), so the code is the AVX2 code with that one instruction changed.
AVX512_VNNI = Isa("avx512vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"),
                  ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
# AVX-512 BF16 (AMD Zen 4 on, Intel Cooper Lake and Sapphire Rapids on; all with VNNI): the VNNI build plus qmatmul.c's
# bf16 products by `vdpbf16ps`, half the instructions of fp32 multiply-adds (their own bits, not the AVX2 build's).
AVX512_BF16 = Isa("avx512bf16", AVX512_VNNI.flags + ("-mavx512bf16",), AVX512_VNNI.cpu_flags + ("avx512_bf16",))
# AMX (Intel Sapphire Rapids on): the AVX-512 BF16 build plus tile registers, qmatmul.c's bf16 products by `tdpbf16ps`
# (their own bits again) and its int8 / int4 products of a prompt's many rows by `tdpbsud` (the same bits as the
# other builds). The kernel asks Linux for the tiles' state when loaded (`ready`); where it is refused, the next build
# is taken.
AMX = Isa("amx", AVX512_BF16.flags + ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
          AVX512_BF16.cpu_flags + ("amx_tile", "amx_bf16", "amx_int8"), ready="qmatmul_ready")
ISA_NAMES = ("avx2", AVX512_VNNI.name, AVX512_BF16.name, AMX.name)


def cpu_flags() -> list[str]:
    """This CPU's /proc/cpuinfo flags ([] where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:  # (closed here: stopping at the first "flags" line left it to the collector)
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_problem() -> str:
    """Why this machine cannot run the kernels ("" when it can)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    if not os.path.exists("/proc/cpuinfo"):
        return "cannot read /proc/cpuinfo"
    flags = cpu_flags()
    missing = [f for f in CPU_FLAGS if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else ""


def pick_isas(isas: tuple[Isa, ...]) -> list[Isa | None]:
    """The builds of `isas` this CPU runs, best first, then the baseline AVX2 build (None). MTP_NATIVE_ISA names the
    build to take instead, where the CPU runs it ("avx2": the baseline; tests compare the builds)."""
    asked = os.environ.get("MTP_NATIVE_ISA", "")
    if asked not in ("",) + ISA_NAMES:
        raise ValueError(f"MTP_NATIVE_ISA must be one of {', '.join(ISA_NAMES)}, got {asked!r}")
    if asked == "avx2":
        return [None]
    flags = cpu_flags()
    return [isa for isa in isas if all(f in flags for f in isa.cpu_flags) and asked in ("", isa.name)] + [None]


def kernels_dir() -> Path:
    return cache_root() / "kernels"


@functools.cache
def compiler() -> tuple[str, str]:
    """The C compiler ($CC, else cc or gcc) and its `--version` text (asked once a process: every library's build key
    holds it)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return cc, subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout


def build(source: Path, isa: Isa | None = None) -> Path:
    """Compile `source` (once per source, flags and compiler; with `isa`'s flags too) and return the shared
    library's path."""
    cc, version = compiler()
    code = source.read_bytes() + HEADER.read_bytes()
    flags = FLAGS + (isa.flags if isa else ())
    key = hashlib.sha256(code + "\0".join(flags + LIBS).encode() + version.encode()).hexdigest()[:16]
    for root in (kernels_dir(), Path(tempfile.gettempdir()) / f"mtp-kernels-{os.getuid()}"):
        path = root / f"{source.stem}-{key}.so"
        if path.exists():
            return path
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
            os.close(fd)
        except OSError:
            continue  # an unwritable cache: try the next place
        try:
            done = subprocess.run([cc, *flags, str(source), "-o", tmp, *LIBS], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed on {source.name}: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)  # atomic: concurrent builders each write their own file, the last rename wins
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path
    raise RuntimeError(f"no writable cache directory for the kernels ({kernels_dir()})")


LIBRARIES: list[NativeLibrary] = []  # every library defined (`prebuild`)


class NativeLibrary:
    """One C source, built and loaded on first use. `declare(lib)` sets the functions' ctypes signatures; `switch` is
    the environment variable that turns this library off (=0); `fallback` says what runs instead, for the warning."""

    def __init__(self, source: str | Path, switch: str | None, fallback: str, declare: Callable[[ctypes.CDLL], None],
                 isas: tuple[Isa, ...] = ()):
        self.source = source if isinstance(source, Path) else Path(__file__).with_name(source)  # a name: beside this file
        self.switch, self.fallback, self.declare, self.isas = switch, fallback, declare, isas
        self.isa: Isa | None = None  # the build loaded (None: the baseline)
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._why: str | None = None  # None until probed; "" when the library loaded
        LIBRARIES.append(self)

    def switched_off(self) -> str | None:
        """The environment switch that turns this library off (its own, or MTP_NATIVE=0), or None."""
        return next((s for s in (self.switch, "MTP_NATIVE") if s and os.environ.get(s, "1") == "0"), None)

    def _load(self) -> None:
        if switch := self.switched_off():
            self._why = f"disabled by {switch}=0"
            return
        if why := cpu_problem():
            self._why = why
            return
        for isa in pick_isas(self.isas):
            try:
                lib = ctypes.CDLL(str(build(self.source, isa)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                if isa is not None:  # (a compiler too old for the build's flags, say): the next build
                    log.info("%s: no %s build (%s); taking the next", self.source.name, isa.name, str(e).splitlines()[0])
                    continue
                self._why = str(e).splitlines()[0]
                log.warning("%s: %s", self.fallback, self._why)
                return
            if isa is not None and isa.ready and getattr(lib, isa.ready)() != 0:
                log.info("%s: the %s build cannot run in this process; taking the next", self.source.name, isa.name)
                continue
            self.declare(lib)
            self.isa, self._lib, self._why = isa, lib, ""
            return

    def available(self) -> bool:
        """Can this process run the library's kernels (built and loaded on the first call)?"""
        if self._why is None:
            with self._lock:
                if self._why is None:
                    self._load()
        return self._lib is not None

    def reason(self) -> str:
        """Why the kernels are not used ("" when they are)."""
        self.available()
        return self._why or ""

    def lib(self) -> ctypes.CDLL:
        """The loaded library (within `timed()`: a view of it that times each call)."""
        lib = self.handle()
        return lib if _TIMER is None else _Timed(lib, _TIMER)

    def handle(self) -> ctypes.CDLL:
        """The loaded library itself (its functions' addresses: step.py passes them to C)."""
        if self._lib is None and not self.available():
            raise RuntimeError(f"{self.source.name} kernels are not available here: {self.reason()}")
        return self._lib


_PREBUILT = threading.Event()


def prebuild() -> None:
    """Compile, a compiler a core, every library's first build that compiles (in `_load`'s order) where it is not in
    the cache yet - once a process, before a model's first load: on a fresh machine they were compiled one at a time
    as each was first used, 7.1 s on this project's 2-core Xeon (qmatmul 2.1, dequant and deltanet 1.0 each,
    attention 0.8, ...), much of it inside the first generation's timing. A library's load still decides what it runs
    (a build the process may not run, AMX without the tiles' permission, gives way to the next, compiled then);
    libraries turned off, or a CPU they cannot run on, are skipped. Where every build is cached this only hashes the
    sources (~1 ms a library)."""
    if _PREBUILT.is_set():
        return
    _PREBUILT.set()
    if cpu_problem():
        return
    todo = [lib for lib in LIBRARIES if lib._why is None and not lib.switched_off()]
    try:
        compiler()
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return  # (each library's load says so)

    def first_build(lib: NativeLibrary) -> None:  # the builds in `_load`'s order, up to the first that compiles
        for isa in pick_isas(lib.isas):
            try:
                build(lib.source, isa)
                return
            except (OSError, RuntimeError, subprocess.SubprocessError):
                continue

    if todo:
        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
            list(pool.map(first_build, todo))


@dataclass
class NativeTime:
    """Seconds spent inside calls into our C kernels, and how many calls (`timed`)."""

    seconds: float = 0.0
    calls: int = 0


_TIMER: NativeTime | None = None


class _Timed:
    def __init__(self, lib: ctypes.CDLL, timer: NativeTime):
        self._lib, self._timer = lib, timer

    def __getattr__(self, name: str):
        fn, timer = getattr(self._lib, name), self._timer

        def call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                timer.seconds += time.perf_counter() - t0
                timer.calls += 1
        return call


@contextmanager
def timed() -> Iterator[NativeTime]:
    """Within: every call into the C kernels (through `NativeLibrary.lib()`) is timed into the yielded `NativeTime`
    (bench/profile.py: what of a round is C and what is the host's). Not for threads running at once."""
    global _TIMER
    before, _TIMER = _TIMER, NativeTime()
    try:
        yield _TIMER
    finally:
        _TIMER = before
