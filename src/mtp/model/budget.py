"""Will the model a config describes fit in memory? Answered before anything is allocated: first from a lower bound
on the config's sizes (so a config with 10**9 layers is refused at once), then exactly, by building the model on the
meta device while counting the bytes of every parameter and buffer as it is registered (so a huge tensor is refused
the moment its module is built, and the build stops as soon as the count passes what is available).

Memory available: on the CPU, /proc/meminfo's MemAvailable, capped by the cgroup's limit when there is one; on CUDA,
the device's free memory (`torch.cuda.mem_get_info`); elsewhere no bound is known and none is applied.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from ..config import ConfigError

# The Python memory of one nn.Module object (its dicts, hooks and attributes), parameters aside: 2.5 KB measured on
# CPython 3.11 / torch 2.13 over a Qwen3.5 model built on the meta device (docs/decisions.md); 2 KB is a lower bound.
MODULE_BYTES = 2_000
# The fewest modules a decoder layer of any family has: the layer, its two norms, a mixer with at least two
# projections, an MLP with three (counted for the lower bound only).
MIN_MODULES_PER_LAYER = 8


# What torch raises for a tensor whose element count overflows (depending on where it overflows).
BUILD_ERRORS = (RuntimeError, ValueError, TypeError, OverflowError)


def first_line(e: BaseException, limit: int = 120) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class TooLargeError(ConfigError):
    """The model a config describes does not fit in the memory available (the message names the file and keys)."""


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _cgroup_free() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def available_memory(device: torch.device | str) -> int | None:
    """Bytes a new allocation may take on `device` now (None: unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None and hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_free()
    return cgroup if free is None else (free if cgroup is None else min(free, cgroup))


def lower_bound_bytes(config, itemsize: int) -> int:
    """Bytes any family's model of this config takes at least: the embedding [V, H], two norms [H] per decoder and
    MTP layer, and the Python objects of their modules."""
    H, V = config.hidden_size, config.vocab_size
    layers = config.num_hidden_layers + config.mtp_num_hidden_layers
    return (V * H + layers * 2 * H) * itemsize + layers * MIN_MODULES_PER_LAYER * MODULE_BYTES


# Initializers (torch.nn.init's and the tensors' own): a model built for a checkpoint takes every value from it.
FILLS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "orthogonal_", "constant_", "zeros_", "ones_", "fill_", "zero_"})


class MetaFills(TorchFunctionMode):
    """Initializers do nothing to a meta tensor (it has no values): returned as they are, uncalled. torch runs some of
    them on the meta device (`normal_`, as every nn.Embedding's init calls it) through Python reference
    implementations whose first call imports torch._dynamo: 1.1 s of every load (docs/decisions.md, 2026-12-07
    fourteenth session). Elementwise ops on meta tensors do the same; a constructor leaves them out on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else kwargs.get("tensor")  # torch.nn.init's pass theirs by name
        if getattr(func, "__name__", None) in FILLS and isinstance(t, torch.Tensor) and t.is_meta:
            return t
        return func(*args, **kwargs)


@contextmanager
def counting(limit: int | None, itemsize: int, refuse) -> Iterator[list[int]]:
    """Count the bytes of the parameters and buffers registered inside the block (at `itemsize` bytes per element),
    each tensor once however many modules hold it (a head tied to the embedding), a replaced one no longer, plus
    MODULE_BYTES per module; call refuse(count) as soon as the count passes `limit`. Yields a one-element list
    holding the count (what `model_bytes` gives for the built model)."""
    total = [0]
    holders: dict[int, int] = {}  # id(tensor) -> how many (module, name) slots hold it
    modules: set[int] = set()

    def add(n: int) -> None:
        total[0] += n
        if limit is not None and total[0] > limit:
            refuse(total[0])

    def tensor(table: dict, name: str, t: torch.Tensor | None) -> None:
        old = table.get(name)
        if old is not None:
            holders[id(old)] -= 1
            if holders[id(old)] == 0:
                total[0] -= old.numel() * itemsize
        if t is not None:
            holders[id(t)] = holders.get(id(t), 0) + 1
            if holders[id(t)] == 1:
                add(t.numel() * itemsize)

    def module(sub: nn.Module | None) -> None:
        if sub is not None and id(sub) not in modules:
            modules.add(id(sub))
            add(MODULE_BYTES)

    handles = [
        module_hooks.register_module_parameter_registration_hook(lambda m, n, p: tensor(m._parameters, n, p)),
        module_hooks.register_module_buffer_registration_hook(lambda m, n, b: tensor(m._buffers, n, b)),
        module_hooks.register_module_module_registration_hook(lambda m, n, sub: module(sub)),
    ]
    try:
        yield total
    finally:
        for h in handles:
            h.remove()


def build_on_meta(cls, config, dtype: torch.dtype, device: torch.device | str, where: str, with_mtp: bool | None = None,
                  limit: int | None = None) -> nn.Module:
    """cls(config) on the meta device, refused (TooLargeError naming `where`, e.g. the config file) when its weights in
    `dtype` (and its modules' Python objects) would not fit in what `device` has available (or in `limit` bytes when
    given): by the lower bound first, then while it is being built, then exactly (`model_bytes`; tied parameters
    counted once)."""
    limit = available_memory(device) if limit is None else limit
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    on = torch.device(device).type

    def refuse(need: int, what: str) -> None:
        raise TooLargeError(f"{where}: {what} {gigabytes(need)} in {str(dtype).removeprefix('torch.')}, more than the "
                            f"{gigabytes(limit)} of memory available on {on}")

    if limit is not None:
        low = lower_bound_bytes(config, itemsize)
        if low > limit:
            refuse(low, f"config keys 'num_hidden_layers' ({config.num_hidden_layers}), "
                        f"'{config.mtp_layers_key}' ({config.mtp_num_hidden_layers}), 'hidden_size' "
                        f"({config.hidden_size}) and 'vocab_size' ({config.vocab_size}) describe a model of at least")
    try:
        with counting(limit, itemsize, lambda n: refuse(n, "the model this config describes takes more than")), \
                torch.device("meta"), MetaFills():
            model = cls(config, with_mtp=with_mtp)
    except TooLargeError:
        raise
    except BUILD_ERRORS as e:  # e.g. a size whose element count torch cannot represent, even on the meta device
        raise TooLargeError(f"{where}: the model this config describes cannot be built ({first_line(e)})") from None
    need = model_bytes(model, itemsize)
    if limit is not None and need > limit:
        refuse(need, "the model this config describes takes")
    return model


def parameter_bytes(model: nn.Module, itemsize: int) -> int:
    """Bytes of the model's parameters and buffers at `itemsize` per element, each shared tensor once."""
    seen = {id(t): t.numel() for t in [*model.parameters(), *model.buffers()]}
    return sum(seen.values()) * itemsize


def model_bytes(model: nn.Module, itemsize: int) -> int:
    """What `counting` counts for a built model: its parameters and buffers, and MODULE_BYTES per module."""
    return parameter_bytes(model, itemsize) + (sum(1 for _ in model.modules()) - 1) * MODULE_BYTES
