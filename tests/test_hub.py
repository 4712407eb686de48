"""Hub ids resolve through huggingface_hub's cache; every test runs offline against a fake cache built on disk."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from mtp.io.hub import HubError, resolve_checkpoint

hf_constants = pytest.importorskip("huggingface_hub.constants")

MAIN = "a" * 40
DEV = "b" * 40


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to reach the network fails the test loudly (rather than passing by luck on a machine without internet)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to use the network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1, as a user would set it.

    huggingface_hub reads HF_HUB_OFFLINE once, when `huggingface_hub.constants` is imported, so setting the env var here
    does not reach a library that is already imported: its own offline guard (`constants.is_offline_mode()`, which
    makes every HTTP request raise OfflineModeIsEnabled) only turns on if the constant is patched too. We patch both:
    the env var is what resolve_checkpoint reads to pass local_files_only=True, the constant is the library's own guard.
    """
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def online_env(monkeypatch):
    """Neither the env var nor huggingface_hub's constant says offline (the socket guard still blocks the network)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",)) -> Path:
    """Write a snapshot in huggingface_hub's cache layout and return its folder:

    models--org--name/blobs/<git sha1, or sha256 for LFS files>   the file contents
    models--org--name/snapshots/<commit>/<file> -> ../../blobs/<id>  relative symlinks (copies where symlinks fail)
    models--org--name/refs/<branch>                                the commit hash, no trailing newline
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / (hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else _git_blob_id(data))
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            target.symlink_to(os.path.relpath(blob, target.parent))
        except OSError:
            target.write_bytes(data)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path) -> Path:
    cache = tmp_path / "hub"
    files = {"config.json": b'{"model_type": "qwen3_5"}', "model.safetensors": b"\x00" * 16, "tokenizer.json": b"{}"}
    add_snapshot(cache, "org/name", MAIN, files)
    add_snapshot(cache, "org/name", DEV, {**files, "config.json": b'{"model_type": "dev"}'}, refs=("dev",))
    return cache


def test_offline_hub_id_resolves_to_cached_snapshot(cache, offline):
    folder = resolve_checkpoint("org/name", cache_dir=str(cache))
    assert folder == cache.resolve() / "models--org--name" / "snapshots" / MAIN
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "qwen3_5"}


def test_offline_revision_branch_and_commit(cache, offline):
    dev = resolve_checkpoint("org/name", revision="dev", cache_dir=str(cache))
    assert dev.name == DEV and json.loads((dev / "config.json").read_text()) == {"model_type": "dev"}
    assert resolve_checkpoint("org/name", revision=DEV, cache_dir=str(cache)) == dev


def test_offline_env_alone_keeps_it_local(cache, online_env, monkeypatch):
    # The env var set after huggingface_hub was imported (its constant still says online): resolve_checkpoint must still
    # pass local_files_only=True, or snapshot_download would ask the Hub first (and trip the socket guard).
    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")
    assert resolve_checkpoint("org/name", cache_dir=str(cache)).name == MAIN
    with pytest.raises(HubError, match="offline mode is on"):
        resolve_checkpoint("org/other", cache_dir=str(cache), local_files_only=False)


def test_uncached_id_offline(cache, offline):
    with pytest.raises(HubError) as err:
        resolve_checkpoint("org/missing", revision="v2", cache_dir=str(cache))
    msg = str(err.value)
    assert "'org/missing'" in msg and "'v2'" in msg and str(cache.resolve()) in msg
    assert "not in the local cache" in msg and "offline mode is on" in msg and "\n" not in msg


def test_unknown_branch_of_cached_repo_offline(cache, offline):
    with pytest.raises(HubError, match="'org/name'.*'nope'.*not in the local cache"):
        resolve_checkpoint("org/name", revision="nope", cache_dir=str(cache))


def test_local_files_only_without_offline_env(cache, online_env):
    assert resolve_checkpoint("org/name", cache_dir=str(cache), local_files_only=True).name == MAIN
    with pytest.raises(HubError, match="'org/missing'.*local_files_only=True"):
        resolve_checkpoint("org/missing", cache_dir=str(cache), local_files_only=True)


def test_unreachable_hub(cache, online_env, monkeypatch):
    # A machine without a network: name resolution fails, huggingface_hub falls back to its cache and finds nothing.
    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(socket, "create_connection", no_dns)
    with pytest.raises(HubError, match="'org/missing'.*not in the local cache.*the Hub is unreachable"):
        resolve_checkpoint("org/missing", cache_dir=str(cache))


@pytest.mark.parametrize("error", ["httpx2.ConnectError", "httpx2.ReadTimeout", "ConnectionResetError", "TimeoutError"])
def test_connection_lost_mid_download(error, monkeypatch, online_env, tmp_path):
    # snapshot_download turns a failed first request into LocalEntryNotFoundError, but a connection lost while
    # downloading the files surfaces as the HTTP client's own error.
    import huggingface_hub

    module, _, name = error.rpartition(".")
    cls = getattr(pytest.importorskip(module) if module else builtins, name)

    def lost(repo_id, **kwargs):
        raise cls("connection lost")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lost)
    with pytest.raises(HubError, match="'org/name'.*not in the local cache.*the Hub is unreachable"):
        resolve_checkpoint("org/name", cache_dir=str(tmp_path))


def test_incomplete_snapshot(cache, offline):
    # huggingface_hub keeps the file listing of each downloaded commit; a snapshot missing listed files is incomplete.
    listing = {"config.json": {"size": 1, "blob_id": "x"}, "model-2.safetensors": {"size": 1, "blob_id": "y"}}
    trees = cache / "models--org--name" / "trees"
    trees.mkdir()
    (trees / f"{MAIN}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    with pytest.raises(HubError, match="only partly in the local cache"):
        resolve_checkpoint("org/name", cache_dir=str(cache))


def test_repository_not_found(monkeypatch, online_env, tmp_path):
    import httpx2
    import huggingface_hub
    from huggingface_hub.utils import RepositoryNotFoundError

    def not_found(repo_id, **kwargs):
        response = httpx2.Response(404, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{repo_id}"))
        raise RepositoryNotFoundError("404 Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(HubError, match="no repository 'org/typo'"):
        resolve_checkpoint("org/typo", cache_dir=str(tmp_path))


def test_snapshot_download_arguments(monkeypatch, online_env, tmp_path):
    import huggingface_hub

    seen = {}

    def fake(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_checkpoint("org/name", revision="r1", cache_dir="/c") == tmp_path
    assert seen == {
        "repo_id": "org/name", "revision": "r1", "cache_dir": "/c", "local_files_only": False,
        "allow_patterns": ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"],
    }


def test_local_folder_passes_through_without_huggingface_hub(tmp_path, monkeypatch):
    folder = tmp_path / "org" / "name"
    folder.mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # importing it would now fail
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint(folder) == folder
    assert resolve_checkpoint(str(folder)) == folder
    assert resolve_checkpoint("org/name") == Path("org/name")  # a folder wins over the hub id of the same name


def test_missing_huggingface_hub(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubError) as err:
        resolve_checkpoint("org/name")
    assert str(err.value) == "loading 'org/name' from the Hugging Face Hub needs huggingface_hub: pip install huggingface_hub"


@pytest.mark.parametrize(
    "name", ["no/such/folder", "./org/name", "/no/such/dir", "nosuchfolder", "org/na--me", "org/-name", "org/name.git", "org/näme"]
)
def test_not_a_folder_nor_a_hub_id(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # told apart from hub ids without asking huggingface_hub
    with pytest.raises(HubError, match="no such folder, and not a hub id"):
        resolve_checkpoint(name)


def test_a_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(HubError, match="is a file"):
        resolve_checkpoint(tmp_path / "model.safetensors")


def test_load_model_and_cli_take_a_cached_hub_id_offline(tmp_path, offline, monkeypatch):
    """`mtp.load_model("org/tiny")` and `mtp generate --model org/tiny` read a checkpoint from the local hub cache."""
    import subprocess

    import torch

    import mtp
    from serve_support import build_model_dir

    folder = build_model_dir(tmp_path / "src", chat_template=False)
    cache = tmp_path / "hub"
    add_snapshot(cache, "org/tiny", MAIN, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))  # the default cache_dir, read at call time
    model = mtp.load_model("org/tiny")
    ref = mtp.load_model(folder)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model.source_path.startswith(str(cache.resolve())) and torch.equal(model(ids), ref(ids))
    with pytest.raises(HubError, match="'org/absent'.*not in the local cache"):
        mtp.load_model("org/absent")

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    run = lambda name: subprocess.run([sys.executable, "-m", "mtp.cli", "generate", "--model", name, "--prompt", "def add(",  # noqa: E731
                                       "--max-new-tokens", "6", "--json", "--threads", "1"], capture_output=True, text=True, env=env)
    proc = run("org/tiny")
    assert proc.returncode == 0, proc.stderr
    want = mtp.generate(ref, ref.tokenizer.encode("def add("), max_new_tokens=6).tokens
    assert json.loads(proc.stdout)["tokens"] == want
    proc = run("org/absent")
    assert proc.returncode != 0 and "not in the local cache" in proc.stderr and "Traceback" not in proc.stderr
