"""int8 and int4 weights times int8 activations on x86 CPUs: the "int8" and "int4" linear kernels of decoding
(`linear.FastLinear`) where this machine can run them.

torch's CPU kernels for quantized weights (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) widen every weight
to float and multiply in float: on an AVX2 CPU they run at 4-6 GB/s of weights, well below the memory bandwidth, so
a quantized 0.8B-shape step was little faster than bf16 (docs/decisions.md, 2026-12-01, "int8 and int4 at the
memory's speed"). `qmatmul.c` does what llama.cpp's q8_0 path does instead: it quantizes the activations to int8 in
blocks of 32 and multiplies int8 by int8 (or int4 by int8) with exact integer block sums (`vpmaddubsw`). Each
output's float accumulation runs in one fixed order, so the kernels are row-invariant by construction: at any row
count and thread count, row m of a product is its 1-row product.

The C source ships with the package and is compiled on first use with the system's C compiler (`$CC`, else `cc`) into
$MTP_CACHE (or ~/.cache/mtp)/kernels, keyed by the source, the flags and the compiler, in about a second. Where that
cannot happen (no compiler, not x86-64 with AVX2/FMA/F16C, or MTP_QMATMUL=0) the linear layers keep torch's kernels,
which are row-invariant too; `available()` says which, and `reason()` why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..io.files import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
BLOCK = 32  # activation block, and the granularity of K and of int4 groups
_CPU_FLAGS = ("avx2", "fma", "f16c")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # None until probed; "" when the library loaded


def _cpu_ok() -> str:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError as e:
        return f"cannot read /proc/cpuinfo: {e}"
    missing = [f for f in _CPU_FLAGS if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else ""


def _cache_root() -> Path:
    return cache_root() / "kernels"


def _build() -> Path:
    """Compile qmatmul.c (once per source, flags and compiler) and return the shared library's path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + "\0".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    for root in (_cache_root(), Path(tempfile.gettempdir()) / f"mtp-kernels-{os.getuid()}"):
        path = root / f"qmatmul-{key}.so"
        if path.exists():
            return path
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
            os.close(fd)
        except OSError:
            continue  # an unwritable cache: try the next place
        try:
            done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)  # atomic: concurrent builders each write their own file, the last rename wins
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path
    raise RuntimeError(f"no writable cache directory for the kernels ({_cache_root()})")


def _load() -> None:
    global _lib, _why
    if os.environ.get("MTP_QMATMUL", "1") == "0":
        _why = "disabled by MTP_QMATMUL=0"
        return
    if why := _cpu_ok():
        _why = why
        return
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why = str(e).splitlines()[0]
        log.warning("int8/int4 layers use torch's kernels: %s", _why)
        return
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.q8_linear.argtypes = [p, i64, i64, p, p, p, i64, p, i32]
    lib.q4_linear.argtypes = [p, i64, i64, p, p, p, i64, p, i64, p, i32]
    lib.q8_linear.restype = lib.q4_linear.restype = i32
    _lib, _why = lib, ""


def available() -> bool:
    """Can this process run the kernels (built and loaded on the first call)?"""
    if _why is None:
        with _lock:
            if _why is None:
                _load()
    return _lib is not None


def reason() -> str:
    """Why the kernels are not used ("" when they are)."""
    available()
    return _why or ""


def supports(in_features: int, group: int | None = None) -> bool:
    """Can the kernels run a layer of this input width (and int4 group size)?"""
    ok = in_features % BLOCK == 0
    return ok if group is None else ok and group % BLOCK == 0 and in_features % group == 0


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes uint8 [N, K] in 0..15 -> uint8 [N, K/2]: per block of 32 codes 16 bytes, byte j = q[j] | q[j+16] << 4
    (the kernel widens a block with one shift and one mask)."""
    N, K = codes.shape
    c = codes.reshape(N, K // BLOCK, BLOCK)
    return (c[..., :16] | (c[..., 16:] << 4)).reshape(N, K // 2).contiguous()


def _library() -> ctypes.CDLL:
    if _lib is None and not available():
        raise RuntimeError(f"the int8/int4 CPU kernels are not available here: {reason()}")
    return _lib


def _bias(bias: torch.Tensor | None) -> int | None:
    return None if bias is None else bias.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("qmatmul: out of memory for the activations' int8 copy")


def q8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) times int8 codes w [N, K] with fp32 scales [N] (w ~ codes * scale[:, None]), plus
    fp32 bias [N] -> bf16 [M, N]."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M:
        _check(_library().q8_linear(x.data_ptr(), M, K, w.data_ptr(), scale.data_ptr(), _bias(bias), N, y.data_ptr(),
                              torch.get_num_threads()))
    return y


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [M, K] (contiguous) times int4 codes (`pack_int4`, [N, K/2]) with fp32 scales and offsets [N, K/group]
    (w ~ codes * scale + low per group), plus fp32 bias [N] -> bf16 [M, N]."""
    M, K = x.shape
    N = packed.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M:
        _check(_library().q4_linear(x.data_ptr(), M, K, packed.data_ptr(), scale.data_ptr(), low.data_ptr(), group, _bias(bias),
                              N, y.data_ptr(), torch.get_num_threads()))
    return y
