"""`mtp convert`: a checkpoint in another release format -> our Hugging Face layout, which `mtp` (and, for the
backbone, transformers) loads. Today: Meta's multi-token prediction models (`--from meta`: `consolidated.pth` +
`params.json`, the SentencePiece `tokenizer.model` beside them) -> Llama with Meta's heads (`model/llama.py`,
`model/meta.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FORMATS = ("meta",)


def find_tokenizer(src: Path, given: str | None) -> Path | None:
    """--tokenizer, else tokenizer.model in the checkpoint folder or its parent (the release keeps one at its top)."""
    if given is not None:
        return Path(given)
    for p in (src / "tokenizer.model", src.parent / "tokenizer.model"):
        if p.is_file():
            return p
    return None


def convert_meta(src: str | Path, out: str | Path, tokenizer: str | None = None, dtype: str | None = None,
                 max_position_embeddings: int | None = None, max_shard_size: int | None = 5 << 30,
                 with_tokenizer: bool = True) -> dict:
    """Convert a Meta multi-token release folder into `out` (all or nothing: `io.files.FolderWriter`); returns the
    config written (with_tokenizer=False: the weights and config alone). Everything is checked (params, every
    tensor's name and shape, the tokenizer against the embedding) before anything is written."""
    import torch

    from .config import LlamaConfig
    from .io.files import FolderWriter, save_tensors
    from .io.sentencepiece import sentencepiece_to_tokenizer, write_tokenizer_files
    from .model.checkpoint import parse_dtype
    from .model.meta import convert_state, hf_config, load_release

    src, out = Path(src), Path(out)
    params, state, weights = load_release(src)
    tok_path = find_tokenizer(src, tokenizer) if with_tokenizer else None
    if tok_path is None and with_tokenizer:
        raise FileNotFoundError(f"{src}: no tokenizer.model here or in {src.parent} (give --tokenizer PATH, or "
                                "--no-tokenizer to write the weights alone)")
    files, bos, eos = {}, None, None
    if tok_path is not None:
        tok, tok_config = sentencepiece_to_tokenizer(tok_path)
        files = write_tokenizer_files(tok, tok_config)
        bos, eos = tok.token_to_id(tok_config.get("bos_token", "")), tok.token_to_id(tok_config.get("eos_token", ""))
    converted = convert_state(state, params, str(weights))
    vocab = converted["model.embed_tokens.weight"].shape[0]
    if tok_path is not None and tok.get_vocab_size() != vocab:
        raise ValueError(f"{tok_path}: {tok.get_vocab_size()} tokens, but tensor 'tok_embeddings.weight' of {weights} has "
                         f"{vocab} rows")
    cfg = hf_config(params, vocab, bos, eos, max_position_embeddings)
    if dtype is not None and (dt := parse_dtype(dtype)) is not None:
        converted = {k: v.to(dt) for k, v in converted.items()}
    cfg["dtype"] = str(next(iter(converted.values())).dtype).removeprefix("torch.")
    LlamaConfig.from_hf_dict(cfg)  # the family's own checks (a clear error naming the key)
    out.mkdir(parents=True, exist_ok=True)
    with FolderWriter(out) as w:
        save_tensors(converted, w, max_shard_size)
        w.write_text("config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name, text in files.items():
            w.write_text(name, text)
    del state, torch
    return cfg


def cmd_convert(args) -> int:
    from .cli_common import require_extra
    from .model.meta import describe, read_params

    if not args.no_tokenizer:
        require_extra("convert", "sentencepiece", "google.protobuf")
    src = Path(args.src)
    try:
        cfg = convert_meta(src, args.out, args.tokenizer, args.dtype, args.max_position_embeddings,
                           with_tokenizer=not args.no_tokenizer)
    except (OSError, ValueError) as e:  # ConfigError, CheckpointError and a missing file: one line
        raise SystemExit(f"mtp convert: error: {e}") from None
    print(f"mtp convert: {src} ({describe(read_params(src / 'params.json'))}) -> {args.out}: a Llama of "
          f"{cfg['num_hidden_layers']} layers + {cfg['mtp_num_hidden_layers']} parallel MTP heads, {cfg['dtype']}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert another release format to mtp's Hugging Face layout (Meta's multi-token "
                       "prediction checkpoints)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--from", dest="fmt", choices=FORMATS, default="meta",
                   help="the source format: 'meta' = consolidated.pth + params.json (+ tokenizer.model)")
    p.add_argument("src", help="the release folder (e.g. 7B_200B_4/)")
    p.add_argument("out", help="the folder to write (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--tokenizer", default=None, help="the SentencePiece tokenizer.model (default: in SRC or its parent)")
    p.add_argument("--no-tokenizer", action="store_true", help="write the weights and config without a tokenizer")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast the weights (default: as stored)")
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="the context length to record (default: params.json's max_seq_len, else 2048)")
    p.set_defaults(func=cmd_convert)
