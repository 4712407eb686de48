"""The hostile checkpoints of issue 22 ("Checkpoints and configs"), built from a model folder and each run through
`mtp generate` as a real process: one line per case with the exit status, the wall time, the peak memory and the last
line of stderr (or the output). A case should end in one `mtp generate: error:` line, or - for NaN/Inf weights - run
with a warning naming the tensor.

    python scripts/hostile_checkpoints.py [--model models/code-small] [--timeout 60] [--memory-gb 8]

Every process runs under a memory limit (RLIMIT_AS) and a timeout, so a case that allocates without bound ends there.
`tests/test_bad_checkpoints.py` and `tests/test_safetensors.py` assert the same cases on tiny models.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]


def build(src: Path, out: Path) -> list[Path]:
    """Every case as a checkpoint folder under `out` (weights symlinked where they are unchanged)."""
    base = json.loads((src / "config.json").read_text())
    raw = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    state = load_file(src / "model.safetensors")
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])

    def folder(name: str, config: dict | None = None, drop: tuple = (), link_weights: bool = True) -> Path:
        d = out / name
        d.mkdir()
        for f in src.iterdir():
            if f.name == "model.safetensors" and link_weights:
                os.symlink(f.resolve(), d / f.name)
            elif f.is_file() and f.suffix not in (".png", ".md") and f.name not in ("model.safetensors", "config.json"):
                shutil.copy(f, d / f.name)
        cfg = {k: v for k, v in {**base, **(config or {})}.items() if k not in drop}
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    def header_case(name: str, edit) -> None:
        h = json.loads(json.dumps(header))
        edit(h)
        text = json.dumps(h).encode()
        folder(name, link_weights=False).joinpath("model.safetensors").write_bytes(
            struct.pack("<Q", len(text)) + text + data)

    def weights_case(name: str, edit) -> None:
        t = {k: v.clone() for k, v in state.items()}
        edit(t)
        save_file(t, folder(name, link_weights=False) / "model.safetensors", metadata={"format": "pt"})

    folder("mtp_layers_1e6", {"mtp_num_hidden_layers": 10**6})
    folder("layers_1e9", {"num_hidden_layers": 10**9}, drop=("layer_types",))
    folder("head_dim_1e10", {"head_dim": 10**10})
    folder("hidden_1e12", {"hidden_size": 10**12})
    folder("eps_tiny", {"rms_norm_eps": "tiny"})
    folder("eps_negative", {"rms_norm_eps": -1e-6})
    (folder("config_folder") / "config.json").unlink()
    (out / "config_folder" / "config.json").mkdir()
    (folder("config_binary") / "config.json").write_bytes(bytes(range(256)) * 4)
    (folder("tokenizer_config_list") / "tokenizer_config.json").write_text("[1]")
    (folder("tokenizer_config_binary") / "tokenizer_config.json").write_bytes(b"\xff\xfe garbage {{{")
    first, second = order[0], order[1]
    header_case("st_negative_offsets", lambda h: h[first].update(
        data_offsets=[h[first]["data_offsets"][0] - 64, h[first]["data_offsets"][1] - 64]))
    header_case("st_no_offsets", lambda h: h[first].pop("data_offsets"))
    header_case("st_string_shape", lambda h: h[first].update(shape=[str(s) for s in h[first]["shape"]]))
    header_case("st_overlap", lambda h: h[second].update(
        data_offsets=[h[second]["data_offsets"][0] - 4, h[second]["data_offsets"][1] - 4]))
    # a JSON list as the whole header
    text = b"[1, 2, 3]"
    folder("st_header_is_a_list", link_weights=False).joinpath("model.safetensors").write_bytes(
        struct.pack("<Q", len(text)) + text + data)
    weights_case("nan_embedding", lambda t: t["model.embed_tokens.weight"].__setitem__((5, 3), float("nan")))
    layer = next(k for k in state if k.startswith("model.layers.") and k.endswith("mlp.down_proj.weight"))
    weights_case("inf_layer", lambda t: t[layer].__setitem__((0, 0), float("inf")))
    weights_case("inf_final_norm", lambda t: t["model.norm.weight"].__setitem__(0, float("inf")))
    return sorted(p for p in out.iterdir())


def run(case: Path, timeout: float, memory: int) -> str:
    """`mtp generate` on one case under RLIMIT_AS = `memory` bytes and `timeout` seconds -> its line."""
    cmd = [sys.executable, "-m", "mtp.cli", "generate", "--model", str(case), "--prompt", "def f(x):",
           "--max-new-tokens", "8", "--threads", "1", "--draft-tokens", "2", "--dtype", "float32"]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, preexec_fn=limit)
        status = "timeout"
        while time.perf_counter() - t0 < timeout:
            pid, code, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                status = str(os.waitstatus_to_exitcode(code))
                break
            time.sleep(0.05)
        else:
            p.kill()
            _, _, usage = os.wait4(p.pid, 0)
        p.returncode = 0  # reaped above
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    shown = stdout.strip().replace("\n", " ")[:40]
    return (f"{case.name:24s} exit {status:>7s} {wall:5.1f} s  peak {usage.ru_maxrss / 1024:6.0f} MB  stderr lines "
            f"{len(lines):3d} | {last[:200]}" + (f" | stdout: {shown!r}" if shown else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "code-small")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--memory-gb", type=float, default=8.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mtp-hostile-") as tmp:
        for case in build(args.model, Path(tmp)):
            print(run(case, args.timeout, int(args.memory_gb * 1e9)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
