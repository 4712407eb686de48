"""Running the round's steps (`round.draft`, `round.verify`, `round.catch_up`): eagerly, or as compiled graphs.

The steps have static shapes and never synchronise with the host, so they compile whole:
- CPU: `torch.compile` (inductor) generates one C++ function per step and static key (the draft length K, the
  batch bucket, the sampling flags), which replaces the ~3,000 aten calls of an eager round with a few fused loops
  around the linear layers' prepared kernels (`model/linear.py` keeps those as custom ops: the compiled step
  multiplies with exactly the eager kernels). Inductor's caches live in `cache_dir()` (keyed by torch's version and
  this CPU's instruction set), so only the first run on a machine pays the compilation.
- CUDA: the same functions with `mode="reduce-overhead"` (CUDA graphs: one replay per step).
Eager execution stays the default where compiling does not pay (a short command on a fresh machine).
"""

from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path

import torch

from ..io.files import cache_root
from ..model.cache import Cache
from . import round as rnd

# one compiled graph per (function, K, batch bucket, sampling flags): allow many before dynamo falls back to eager
RECOMPILE_LIMIT = 256


def cache_dir() -> Path:
    """Where compiled graphs are cached: $MTP_CACHE (or ~/.cache/mtp)/inductor/<torch version>-<CPU ISA>."""
    root = cache_root()
    isa = torch.backends.cpu.get_cpu_capability()
    return root / "inductor" / f"torch-{torch.__version__}-{platform.machine()}-{isa}"


def configure_compiler() -> None:
    """Point inductor at the persistent cache (unless the user chose a directory) and raise dynamo's recompile limit."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor writes its default (a temporary folder) into the variable the first time it asks for it, which an
    # earlier compile in this process may have done: only a value the user chose is theirs
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        path = cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._dynamo
    import torch._inductor.config

    # A fused kernel keeps its intermediates in fp32 where eager rounds each op's bf16 output, and where the kernels'
    # boundaries fall depends on the graph: the width-1 plain step and a width-(k+1) verify then rounded the same
    # token differently (compiled speculative != compiled plain on 2 of 7 bench prompts, docs/decisions.md). With
    # the casts emulated every graph rounds where eager does, so all graphs, and eager, agree.
    torch._inductor.config.emulate_precision_casts = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                               4 * RECOMPILE_LIMIT)


def _tensors(obj):
    """Every tensor of a round's state: its fields, the backbone's `Cache` layers, the MTP caches (lists of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Cache):
        yield from _tensors(obj.layers)
    elif isinstance(obj, list):
        for x in obj:
            yield from _tensors(x)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


class Runner:
    """The round's steps for one model: eager, or compiled (one per model and mode, shared by its decoders, so a
    graph compiled for one generation serves the next)."""

    def __init__(self, compiled: bool, device: torch.device):
        self.compiled = compiled
        self.device = device
        self.called: set[tuple] = set()  # the graph keys called so far (decoder.py: a first call compiles)
        if not compiled:  # looked up at each call (tests wrap them)
            self.draft = lambda *a, **kw: rnd.draft(*a, **kw)
            self.verify = lambda *a, **kw: rnd.verify(*a, **kw)
            self.catch_up = lambda *a, **kw: rnd.catch_up(*a, **kw)
            return
        configure_compiler()
        if device.type == "cuda":
            opts = dict(mode="reduce-overhead")
        else:
            opts = dict(options={"cpp_wrapper": os.environ.get("MTP_CPP_WRAPPER", "1") == "1"})
        self.draft = torch.compile(rnd.draft, dynamic=False, **opts)
        self.verify = torch.compile(rnd.verify, dynamic=False, **opts)
        self.catch_up = torch.compile(rnd.catch_up, dynamic=False, **opts)

    def begin_round(self) -> None:
        """A round starts: on CUDA, a new generation of cudagraph trees. The round's graphs (catch-up, draft, verify)
        then replay as one path whose outputs feed each other, and the last round's outputs, all read by now, may be
        overwritten. Without it a draft's output was overwritten before the verify read it (the first GPU check,
        docs/decisions.md)."""
        if self.compiled and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()

    def static_state(self, st) -> None:
        """A CUDA graph replays at fixed addresses: the round's state (caches, positions, pending buffers), which the
        steps write in place, is marked as living at a fixed address so that cudagraph trees record it rather than
        skip the graph for its mutated inputs. Set MTP_CUDA_STATIC=0 to leave it unmarked (a measurement's control;
        scripts/gpu_bench.py)."""
        if not self.compiled or self.device.type != "cuda" or os.environ.get("MTP_CUDA_STATIC", "1") != "1":
            return
        import torch._dynamo

        for t in _tensors(st):
            torch._dynamo.mark_static_address(t, guard=False)

    @classmethod
    def for_model(cls, model, compiled: bool) -> Runner:
        """The model's runner (called as each decoder starts)."""
        if compiled:  # compiled steps trust the prepared weights (model/linear.py): renew what changed since
            model.renew_prepared()
        runners = model.__dict__.setdefault("_runners", {})
        if compiled not in runners:
            runners[compiled] = cls(compiled, model.device)
        return runners[compiled]
