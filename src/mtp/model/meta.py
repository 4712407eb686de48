"""Meta's released multi-token prediction checkpoints (Gloeckle et al. 2024: `7B_200B_4/`, `7B_1T_4/`, ... with
`consolidated.pth` + `params.json`, the Llama 2 SentencePiece `tokenizer.model` beside them) -> our Hugging Face
layout for `llama.py`: `mtp convert` (docs/families.md, "Meta's multi-token models").

The release's model code (`llama/model.py`) builds `layers` (n_layers - n_future_tokens + 1 Llama blocks) and
`extra_heads` (n_future_tokens - 1 blocks); the trunk is `layers[:-1]`, the next-token head `layers[-1]`, and every
head (the next-token one and the extras) reads the trunk's output, then the shared `norm` and `output`. So `layers.{i}`
become `model.layers.{i}` (a plain Llama: the next-token model, as the release says) and `extra_heads.{j}` become
`mtp.layers.{j}` (head j + 2 predicts token t + j + 2). Names: `tok_embeddings` -> `model.embed_tokens`, `output` ->
`lm_head`, `attention.w{q,k,v,o}` -> `self_attn.{q,k,v,o}_proj`, `feed_forward.w1/w3/w2` -> `mlp.gate/up/down_proj`,
`attention_norm` / `ffn_norm` -> `input_layernorm` / `post_attention_layernorm`. Meta's RoPE rotates adjacent pairs
(complex numbers), transformers' the two halves of each head: wq and wk rows are permuted per head so that
rotate-half computes the same (transformers' own Llama conversion does the same). `rope.freqs`, when present, is
checked against rope_theta and dropped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import ConfigError
from ..io.safetensors_mmap import CheckpointError

# params.json keys (the release's `ModelArgs`) and what they become; max_batch_size is a runtime setting.
PARAMS = {"dim": int, "n_layers": int, "n_heads": int, "n_kv_heads": (int, type(None)), "vocab_size": int,
          "multiple_of": int, "ffn_dim_multiplier": (float, int, type(None)), "norm_eps": (float, int),
          "rope_theta": (float, int), "n_future_tokens": int, "max_seq_len": int, "max_batch_size": int}
DEFAULTS = {"n_kv_heads": None, "vocab_size": -1, "multiple_of": 256, "ffn_dim_multiplier": None, "norm_eps": 1e-5,
            "rope_theta": 10000.0, "n_future_tokens": 1, "max_seq_len": 2048}
BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
         "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
         "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
         "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
         "ffn_norm.weight": "post_attention_layernorm.weight"}
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
NAME = re.compile(r"^(layers|extra_heads)\.(\d+)\.(.+)$")


def read_params(path: Path) -> dict:
    """params.json, every key known and of its type (errors name the file and the key), with the release's defaults."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    for key, value in raw.items():
        if key not in PARAMS:
            raise ConfigError(f"{path}: key '{key}' is not one of the release's params ({', '.join(PARAMS)}): "
                              "not converted, as its meaning is unknown")
        if isinstance(value, bool) or not isinstance(value, PARAMS[key]):
            raise ConfigError(f"{path}: key '{key}' has the wrong type ({value!r:.40})")
    for key in ("dim", "n_layers", "n_heads"):
        if key not in raw:
            raise ConfigError(f"{path}: key '{key}' is missing")
    p = {**DEFAULTS, **raw}
    if not 1 <= p["n_future_tokens"] <= p["n_layers"]:
        raise ConfigError(f"{path}: key 'n_future_tokens' ({p['n_future_tokens']}) must be in 1..n_layers ({p['n_layers']})")
    return p


def ffn_hidden(p: dict) -> int:
    """The SwiGLU width the release's FeedForward computes from dim, multiple_of and ffn_dim_multiplier."""
    hidden = int(2 * (4 * p["dim"]) / 3)
    if p["ffn_dim_multiplier"] is not None:
        hidden = int(p["ffn_dim_multiplier"] * hidden)
    return p["multiple_of"] * ((hidden + p["multiple_of"] - 1) // p["multiple_of"])


def to_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """wq / wk [heads * D, H] with each head's rows in Meta's pair order (x0, x1), (x2, x3), ... -> the order
    rotate-half pairs them in ((x0, x_{D/2}), (x1, x_{D/2+1}), ...)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_config(p: dict, vocab_size: int, bos: int | None, eos: int | None, max_positions: int | None) -> dict:
    """Our config.json (`LlamaConfig`, with Meta's heads) for params p."""
    n_future = p["n_future_tokens"]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": p["dim"],
           "intermediate_size": ffn_hidden(p), "num_hidden_layers": p["n_layers"] - n_future + 1,
           "num_attention_heads": p["n_heads"], "num_key_value_heads": p["n_kv_heads"] or p["n_heads"],
           "head_dim": p["dim"] // p["n_heads"], "rms_norm_eps": float(p["norm_eps"]), "rope_theta": float(p["rope_theta"]),
           "vocab_size": vocab_size, "max_position_embeddings": max_positions or p["max_seq_len"],
           "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
           "mtp_num_hidden_layers": n_future - 1, "mtp_style": "parallel"}
    if bos is not None:
        cfg["bos_token_id"] = bos
    if eos is not None:
        cfg["eos_token_id"] = eos
    return cfg


def convert_state(state: dict[str, torch.Tensor], p: dict, where: str) -> dict[str, torch.Tensor]:
    """The release's tensors -> ours (names, the q/k permutation), every tensor's presence and shape checked first
    (errors name the tensor)."""
    n_future, n_layers = p["n_future_tokens"], p["n_layers"]
    n_trunk = n_layers - n_future + 1
    dim, heads = p["dim"], p["n_heads"]
    kv = p["n_kv_heads"] or heads
    if dim % heads or (dim // heads) % 2:
        raise ConfigError(f"{where}: params 'dim' ({dim}) / 'n_heads' ({heads}) must give an even head size")
    if heads % kv:
        raise ConfigError(f"{where}: params 'n_kv_heads' ({kv}) must divide 'n_heads' ({heads})")
    D, F = dim // heads, ffn_hidden(p)
    emb = state.get("tok_embeddings.weight")
    if emb is None or emb.dim() != 2 or emb.shape[1] != dim:
        raise CheckpointError(f"{where}: tensor 'tok_embeddings.weight' must be [vocab, dim={dim}], got "
                              f"{None if emb is None else list(emb.shape)}")
    V = emb.shape[0]
    if p["vocab_size"] not in (-1, V):
        raise CheckpointError(f"{where}: tensor 'tok_embeddings.weight' has {V} rows but params 'vocab_size' is {p['vocab_size']}")
    block = {"attention.wq.weight": (heads * D, dim), "attention.wk.weight": (kv * D, dim), "attention.wv.weight": (kv * D, dim),
             "attention.wo.weight": (dim, heads * D), "feed_forward.w1.weight": (F, dim), "feed_forward.w3.weight": (F, dim),
             "feed_forward.w2.weight": (dim, F), "attention_norm.weight": (dim,), "ffn_norm.weight": (dim,)}
    want = {"tok_embeddings.weight": (V, dim), "norm.weight": (dim,), "output.weight": (V, dim)}
    for prefix, count in (("layers", n_trunk), ("extra_heads", n_future - 1)):
        want |= {f"{prefix}.{i}.{k}": shape for i in range(count) for k, shape in block.items()}
    extra = sorted(set(state) - set(want) - {"rope.freqs"})
    if extra:
        m = NAME.match(extra[0])
        hint = (f" (params say {n_trunk} 'layers' and {n_future - 1} 'extra_heads': n_layers {n_layers}, n_future_tokens "
                f"{n_future})") if m else ""
        raise CheckpointError(f"{where}: unexpected tensor '{extra[0]}'{hint}")
    for name, shape in want.items():
        t = state.get(name)
        if t is None:
            raise CheckpointError(f"{where}: missing tensor '{name}' (params: n_layers {n_layers}, n_future_tokens {n_future})")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: tensor '{name}' has dtype {t.dtype}, not a floating-point type")
    if "rope.freqs" in state:
        freqs = state["rope.freqs"].float()
        expect = 1.0 / (float(p["rope_theta"]) ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        if freqs.shape != expect.shape or not torch.allclose(freqs, expect, rtol=1e-3, atol=0):
            raise CheckpointError(f"{where}: tensor 'rope.freqs' does not match params 'rope_theta' ({p['rope_theta']})")
    out = {TOP[k]: state[k] for k in TOP}
    for name in want:
        m = NAME.match(name)
        if m is None:
            continue
        kind, i, rest = m[1], int(m[2]), m[3]
        t = state[name]
        if rest == "attention.wq.weight":
            t = to_rotate_half(t, heads)
        elif rest == "attention.wk.weight":
            t = to_rotate_half(t, kv)
        prefix = f"model.layers.{i}." if kind == "layers" else f"mtp.layers.{i}."
        out[prefix + BLOCK[rest]] = t.contiguous()
    return out


def checkpoint_file(folder: Path) -> Path:
    """The one weights file of a release folder: consolidated.pth or consolidated.00.pth (model-parallel shards are
    refused: the 7B releases have none)."""
    shards = sorted(folder.glob("consolidated.*.pth"))
    single = folder / "consolidated.pth"
    if single.exists() and not shards:
        return single
    if len(shards) == 1 and not single.exists():
        return shards[0]
    if not shards and not single.exists():
        raise CheckpointError(f"{folder}: no consolidated.pth (Meta's multi-token checkpoint folder holds consolidated.pth "
                              "and params.json)")
    raise CheckpointError(f"{folder}: {len(shards) + single.exists()} weight files ({', '.join(p.name for p in shards)}); "
                          "model-parallel shards are not supported")


def load_release(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """(params, the state dict memory-mapped, the weights file) of a release folder; `torch.load` with
    weights_only=True, so a pickle that would run code is refused."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    params = read_params(folder / "params.json") if (folder / "params.json").exists() else None
    if params is None:
        raise ConfigError(f"{folder}: no params.json")
    f = checkpoint_file(folder)
    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many kinds (UnpicklingError, RuntimeError, EOFError) for a bad file
        raise CheckpointError(f"{f}: cannot read as a PyTorch state dict ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise CheckpointError(f"{f}: not a state dict of named tensors")
    return params, state, f


def describe(p: dict) -> str:
    """One line about a release's shape, for the command's output."""
    n = p["n_future_tokens"]
    return (f"dim {p['dim']}, {p['n_layers']} blocks: trunk {p['n_layers'] - n} + next-token head + {n - 1} extra heads, "
            f"{p['n_heads']} heads, SwiGLU {ffn_hidden(p)}, rope_theta {p['rope_theta']:g}")

