"""Which torch device a name means: 'auto' is CUDA when torch sees a GPU, else the CPU; a device that is not
available is a clear error naming the option that asked for it."""

from __future__ import annotations

import torch


def resolve_device(name: str | None, index: int | None = None, option: str = "--device") -> torch.device:
    """'auto'/None -> cuda when available, else cpu; 'cuda' -> cuda:index (index: e.g. LOCAL_RANK under torchrun);
    else as given. `option` names where the value came from in the error (a flag or a config key)."""
    if name in (None, "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{option} is 'cuda' but torch sees no CUDA device (is this a CPU build of torch?)")
        return torch.device("cuda", index) if index is not None else torch.device("cuda")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{option} is 'mps' but MPS is not available on this machine")
    return torch.device(name)
