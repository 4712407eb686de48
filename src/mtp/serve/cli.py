"""`mtp serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn), loopback by default."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..cli_common import (
    add_compile_arg,
    add_draft_args,
    add_model_args,
    load_from_args,
    model_name,
    parse_draft_tokens,
    require_extra,
)
from ..io.template_worker import DEFAULT_TIMEOUT_S, KILL_AFTER_S

DEFAULT_GRACE_S = 5.0  # as serve/shutdown.py (not imported here: it needs uvicorn, an optional extra)

DEFAULT_PORT = 8000
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_MAX_TOKENS = 256
DEFAULT_PROMPT_CACHE_MB = 1024  # a snapshot of code-small after a prompt ~0.9 MB, of the Qwen3.5-0.8B shape ~20 MB + 12 KB a token
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model behind an OpenAI-compatible HTTP API",
                              description=__doc__)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default; anything else exposes the API)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--draft-tokens", type=parse_draft_tokens, default="auto",
                   help="MTP drafts per step: 0 = plain decoding, 1..8, or 'auto' (default)")
    add_draft_args(p)
    add_compile_arg(p)
    p.add_argument("--api-key", default=os.environ.get("MTP_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MTP_API_KEY; unset = no auth)")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help="requests admitted at once (decoded together, see --max-batch); more get 429 + Retry-After "
                        f"(default {DEFAULT_MAX_CONCURRENCY})")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together in one batch (continuous batching; default: --max-concurrency); "
                        "admitted requests beyond it wait for a row")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens when a request gives none (capped by the room left in the context; default "
                        f"{DEFAULT_MAX_TOKENS})")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model folder's name)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted, larger ones get 413 (default: 32 bytes per token of the "
                        "model's context, at least 1 MiB)")
    p.add_argument("--chat-template-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a chat template may take to render, longer is a 400 (it renders in a worker "
                        f"process with a memory limit; default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_GRACE_S,
                   help="on SIGTERM / Ctrl-C, seconds the requests in flight may run on before they are stopped "
                        f"with an error (default {DEFAULT_GRACE_S:g})")
    p.add_argument("--prompt-cache-mb", type=int, default=DEFAULT_PROMPT_CACHE_MB,
                   help="memory for prompts' states kept to be read again by later requests that start with the same "
                        f"tokens (a system prompt, a conversation's earlier turns; default {DEFAULT_PROMPT_CACHE_MB} "
                        "MiB, 0: off). Output is unchanged: a prompt resumes only where a cold read's chunks end")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    require_extra("serve", "fastapi", "uvicorn", "prometheus_client")
    import uvicorn

    from ..decode import policy_store
    from .app import Limits, create_app
    from .engine import Engine
    from .requestlog import setup_request_log
    from .shutdown import MARGIN_S, GracefulServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_request_log()
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not args.chat_template_timeout > 0:
        raise ValueError(f"--chat-template-timeout must be > 0, got {args.chat_template_timeout}")
    if args.prompt_cache_mb < 0:
        raise ValueError(f"--prompt-cache-mb must be >= 0, got {args.prompt_cache_mb}")
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    model = load_from_args(args)
    if model.tokenizer is None:
        raise SystemExit(f"mtp serve: {model.source_path} has no tokenizer.json; the server needs one")
    source = model_name(args)  # a folder is served under its name, a hub id under the id (as vLLM does)
    name = args.served_model_name or (Path(source).resolve().name if Path(source).is_dir() else source)
    engine = Engine(model, args.draft_tokens, args.max_concurrency, draft_vocab=args.draft_vocab, max_batch=args.max_batch,
                    compile=args.compile, prompt_cache_bytes=args.prompt_cache_mb << 20)
    limits = Limits(max_request_bytes=args.max_request_bytes, chat_template_timeout_s=args.chat_template_timeout)
    app = create_app(engine, name, api_key=args.api_key, default_max_tokens=args.default_max_tokens, limits=limits)
    server = app.state.server
    if args.host not in LOOPBACK:
        print(f"mtp serve: warning: binding {args.host} exposes the API beyond this machine"
              f"{'' if args.api_key else ' WITHOUT an API key'}", file=sys.stderr)
    drafts = f", drafts {model.draft_quantize}" if model.draft_quantize else ""
    cache = f", prompt cache {args.prompt_cache_mb} MiB" if args.prompt_cache_mb else ""
    print(f"mtp serve: {name} (context {engine.context}, draft_tokens {engine.draft_tokens}{drafts}{cache}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn's own deadline comes after ours (the grace period, then the aborted requests answer; a request still
    # rendering its chat template then ends within the template's time limit)
    hard = args.shutdown_grace + MARGIN_S + args.chat_template_timeout + KILL_AFTER_S
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=False, log_level=args.log_level,
                            timeout_graceful_shutdown=hard)
    # the cleanup keeps what `auto` measured (`policy_store`) itself: after a signal the process ends by the signal
    # uvicorn raises again, which runs no atexit handler
    cleanup = (lambda: engine.shutdown(wait=5.0), server.close, policy_store.save_all)
    try:
        GracefulServer(config, server.begin_drain, args.shutdown_grace, cleanup=cleanup).run()
    finally:  # reached when the server did not start (a port in use, say); after a signal the cleanup ran already
        engine.shutdown()
        server.close()
    return 0
