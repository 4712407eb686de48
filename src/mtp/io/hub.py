"""Turn a checkpoint name into a local folder: an existing folder as is, or a Hugging Face Hub id (`org/name`)
resolved through huggingface_hub's cache (downloaded when online, read from the cache when offline)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# The files a checkpoint folder needs: config, weights, tokenizer, chat template. Skips e.g. *.bin, *.gguf and onnx exports.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"]

# huggingface_hub's repo id rules: ASCII letters, digits, '-', '_', '.', each part 1-96 chars starting and ending with a
# letter, digit or '_'; '--' and '..' are forbidden (see huggingface_hub.utils.validate_repo_id).
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"{_PART}/{_PART}")

_TRUE = {"1", "TRUE", "YES", "ON"}


class HubError(ValueError):
    """A checkpoint name that is neither a local folder nor a hub id that can be resolved."""


def looks_like_hub_id(name: str) -> bool:
    """True when `name` has the form of a Hub model id, `org/name` (it may still not exist on the Hub)."""
    return bool(_HUB_ID.fullmatch(name)) and "--" not in name and ".." not in name and not name.endswith(".git")


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, which huggingface_hub also honours) is 1/true/yes/on now."""
    return any((os.environ.get(var) or "").strip().upper() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve_checkpoint(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    cache_dir: str | None = None,
    local_files_only: bool | None = None,
) -> Path:
    """Return the local folder of a checkpoint given as a folder path or as a Hub id `org/name`.

    A hub id is fetched with huggingface_hub.snapshot_download (config, safetensors, tokenizer and template files only)
    at `revision` (branch, tag or commit; default main) into `cache_dir` (default: huggingface_hub's cache).
    `local_files_only` defaults to False; HF_HUB_OFFLINE=1 makes it True whatever is passed. Raises HubError when the
    name is neither, when huggingface_hub is missing, or when the id is not cached and cannot be downloaded.
    """
    path = Path(os.path.expanduser(os.fspath(name_or_path)))
    if path.is_dir():
        return path
    name = os.fspath(name_or_path)
    if path.exists():
        raise HubError(f"checkpoint {name!r} is a file; expected a checkpoint folder or a hub id (org/name)")
    if not isinstance(name_or_path, str) or not looks_like_hub_id(name):
        raise HubError(f"checkpoint {name!r}: no such folder, and not a hub id (org/name)")

    try:
        import huggingface_hub
        from huggingface_hub import constants as hub_constants
        from huggingface_hub.utils import (
            HFValidationError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:
        raise HubError(f"loading {name!r} from the Hugging Face Hub needs huggingface_hub: pip install huggingface_hub") from e

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; reading it here too honours it when it is set later.
    offline = hub_offline() or bool(getattr(hub_constants, "HF_HUB_OFFLINE", False))
    local_only = True if offline else bool(local_files_only)
    rev = revision or "main"
    cache = Path(os.path.expanduser(cache_dir or hub_constants.HF_HUB_CACHE)).resolve()
    try:
        folder = huggingface_hub.snapshot_download(
            name, revision=revision, cache_dir=cache_dir, local_files_only=local_only, allow_patterns=ALLOW_PATTERNS
        )
    except RepositoryNotFoundError as e:
        # Also raised for gated and private repos the token cannot see.
        msg = f"no repository {name!r} on the Hugging Face Hub (or it is private/gated), nor a local folder of that name"
        raise HubError(msg) from e
    except RevisionNotFoundError as e:
        raise HubError(f"the Hugging Face Hub repository {name!r} has no revision {rev!r}") from e
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, *_network_errors()) as e:
        incomplete = any(cls.__name__ == "IncompleteSnapshotError" for cls in type(e).__mro__)
        state = "is only partly in the local cache" if incomplete else "is not in the local cache"
        if offline:
            reason = "offline mode is on (HF_HUB_OFFLINE)"
        elif local_only:
            reason = "local_files_only=True"
        else:
            reason = f"the Hub is unreachable ({type(e.__cause__ or e).__name__})"
        raise HubError(f"cannot load {name!r} (revision {rev!r}): it {state} {cache}, and {reason}; nor is it a local folder") from e
    except HFValidationError as e:
        raise HubError(f"checkpoint {name!r}: no such folder, and not a hub id (org/name): {e}") from e
    return Path(folder)


def _network_errors() -> tuple[type[BaseException], ...]:
    # huggingface_hub raises its HTTP client's transport errors for a dropped connection mid-download; which client
    # (requests, httpx, httpx2) depends on its version, so take whichever is already imported instead of importing one.
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, attr in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        err = getattr(sys.modules.get(module), attr, None)
        if isinstance(err, type) and issubclass(err, BaseException):
            errors.append(err)
    return tuple(errors)
