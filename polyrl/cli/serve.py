"""`polyrl serve`: an OpenAI-compatible HTTP server over the built-in engine, in this process.

    polyrl serve                                  # the bundled tiny model on 127.0.0.1:8000
    polyrl serve --model ~/models/Qwen3-0.6B --port 9000 --dtype bfloat16

Then point any OpenAI client at the printed URL (`OpenAI(base_url=URL, api_key="x")`).
Ctrl-C stops it cleanly. Endpoints: docs/serving.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from polyrl.cli.common import CLIError, choose_platform

DEFAULT_MODEL = "builtin:tiny-arith"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API "
                       "(default: the bundled tiny model, on CPU)",
                       description="Start a rollout server with the built-in engine: "
                       "/v1/completions, /v1/chat/completions (streaming too), /v1/models, /health.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"local Hugging Face model directory or builtin:NAME (default {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; the API has no "
                   "authentication, so a wider address warns)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="weight and activation dtype (default float32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion in tokens (default: the model's, capped at 4096)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded together (default 256)")
    # default None: the server module (fastapi, uvicorn) is imported only when serving
    p.add_argument("--max-sequences-per-request", type=int, default=None,
                   help="most prompts x n one request may ask for; beyond it the request is an HTTP "
                   "400 (default 1024, openai_service.MAX_SEQUENCES_PER_REQUEST: one request "
                   "cannot hold the engine for long while other clients wait)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model directory's name)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let image parts name local files (a path or file:// URL), only those whose "
                   "real path lies inside DIR (default: no local file is ever read; send data: URLs)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that carry none")
    p.add_argument("--platform", default=None, help="cpu, cuda, rocm, npu (default: detect)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from polyrl.builtin import resolve
    from polyrl.rollout.base import ROLLOUT_ENGINES
    from polyrl.rollout.server.app import build_app
    from polyrl.rollout.server.http import HTTPServer
    from polyrl.rollout.server.openai_service import MAX_SEQUENCES_PER_REQUEST

    if args.max_sequences_per_request is None:
        args.max_sequences_per_request = MAX_SEQUENCES_PER_REQUEST
    _check_numbers(args)
    try:
        path = resolve(args.model)
    except FileNotFoundError as exc:
        raise CLIError(str(exc)) from None
    media = args.allowed_local_media_path
    if media is not None and not os.path.isdir(media):
        raise CLIError(f"--allowed-local-media-path {media}: not a directory")
    name = args.served_model_name or os.path.basename(os.path.normpath(path))
    platform = choose_platform(args.platform)
    try:
        engine = ROLLOUT_ENGINES.get("native")(
            path, dtype=args.dtype, device=platform.torch_device(0), max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, seed=args.seed)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(f"--model {args.model}: {exc}") from None
    try:
        app = build_app(engine, name, aliases=(args.model, path),
                        max_sequences_per_request=args.max_sequences_per_request,
                        allowed_local_media_path=media)
        server = HTTPServer(app, args.host, args.port, log_level="info" if args.verbose else "warning")
    except OSError as exc:
        raise CLIError(str(exc)) from None
    if not _is_loopback(args.host):
        print(f"warning: --host {args.host} serves beyond this machine: anyone who can reach port "
              f"{server.port} can run the model (the API has no authentication)"
              + (f" and have it read the images under {os.path.realpath(media)}" if media else "")
              + "; use --host 127.0.0.1 unless a firewall or proxy guards it", file=sys.stderr, flush=True)
    print(f"serving '{name}' ({platform.name}, max_model_len {engine.max_model_len}) at "
          f"{server.url}/v1 — OpenAI-compatible; Ctrl-C to stop", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the signal
        pass
    print("server stopped", flush=True)
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _check_numbers(args: argparse.Namespace) -> None:
    """Out-of-range numbers, refused before the model loads (one line, exit 2)."""
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port {args.port}: a port is 0-65535 (0 picks a free one)")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise CLIError(f"--max-model-len {args.max_model_len}: must be >= 2 (a prompt token plus "
                       "one generated token); leave it out for the model's own length")
    if args.max_num_seqs < 1:
        raise CLIError(f"--max-num-seqs {args.max_num_seqs}: must be >= 1")
    if args.max_sequences_per_request < 1:
        raise CLIError(f"--max-sequences-per-request {args.max_sequences_per_request}: must be >= 1")
