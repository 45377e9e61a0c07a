"""``ServerArgs``: every option of ``kvbaton serve``, declared once (as SGLang's ``ServerArgs``).

Each field is one option: its type, default and bounds (pydantic), and how the command line spells
it (an :class:`Option` in the field's ``Annotated`` metadata: its ``--help`` section and text, its
form). ``kvbaton serve``'s argparse options are generated from the fields
(:func:`add_arguments`), :func:`from_cli` reads them back, and ``create_app``, ``ServerState``,
the listener and ``serve`` read every limit from the one ``ServerArgs`` they are given, so a limit
has one name, one default and one check. The engine's own knobs are
:class:`kvbaton.backend.config.EngineConfig`'s (generated into the same ``--help`` the same way).

Adding an option is adding one field here, with its ``Option``; the code that uses it reads
``args.<field>`` (and docs/server.md's option table gets a row).

Invariants: a ``ServerArgs`` that exists is valid (a bad value is ``InvalidRequest`` naming the
option, before anything loads); it is frozen; importing this module loads neither torch nor the
engine (the command line builds its parser from it).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from kvbaton import serverconf as conf
from kvbaton.errors import InvalidRequest, validation_error
from kvbaton.types import Reuse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

NETWORK, ENGINE, MULTI, REUSE, LIMITS, STREAMS, LOGGING = (
    "network and security", "engine", "multi-device (docs/multidevice.md)",
    "cross-prefix reuse (docs/server.md#reuse-across-prefixes)", "limits",
    "streams (docs/server.md#fair-admission-and-stream-caps)", "",
)
"""The ``--help`` sections, in the order they are shown (``""``: the top-level options)."""

FALLBACK_MAX_TOKENS = 4096
"""The cap on ``max_tokens`` of a model that does not say its context (``--max-tokens`` unset)."""


@dataclass(frozen=True)
class Option:
    """How ``kvbaton serve`` spells a field: its ``--help`` section and text, and its form: ``value``
    (``--name VALUE``), ``switch`` (``--name`` turns on what is off), ``append`` (repeatable),
    ``nargs`` (``--name A B ...``). ``flags``: the spellings (default ``--field-name``)."""

    group: str
    help: str
    form: str = "value"
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    cli: bool = True  # False: create_app's only (no command-line option)


def _opt(group: str, help: str, **form: Any) -> Option:
    return Option(group, help, **form)


Count = Annotated[int | None, Field(ge=0, strict=True)]  # 0 or None: no limit


class ServerArgs(BaseModel):
    """The options of one server (docs/server.md has the table)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # -- network and security ------------------------------------------------------------------
    host: Annotated[str, _opt(NETWORK, "address to bind (default %(default)s); any non-loopback address "
                              "requires a token")] = conf.DEFAULT_HOST
    port: Annotated[int, Field(ge=0, le=65535), _opt(NETWORK, "port (default %(default)s)")] = conf.DEFAULT_PORT
    token: Annotated[str | list[str] | dict[str, str] | None, _opt(
        NETWORK, "bearer token every request must carry; repeat for several tenants (each token is a tenant whose "
        f"handles the others cannot see); --api-key is the name vLLM and SGLang use. Default: ${conf.TOKEN_ENV}, "
        f"else ${conf.API_KEY_ENV} (comma-separated)", form="append", flags=("--token", "--api-key"),
        metavar="TOKEN")] = None
    admin_token: Annotated[str | list[str] | None, _opt(
        NETWORK, "a token that reads /metrics whole (every tenant, the pool, the engine) and nothing else; a tenant's "
        f"token reads its own metrics only. Default: ${conf.ADMIN_TOKEN_ENV}", form="append", metavar="TOKEN")] = None
    client_timeout: Annotated[float, Field(gt=0), _opt(
        NETWORK, "how long a client may stall a connection: to send its request headers, between two reads of its "
        "body, or without taking delivery of the answer (an unread stream); then the connection is closed and its "
        "request cancelled (default %(default)g)", metavar="SECONDS")] = 30.0
    allowed_origins: Annotated[list[str] | None, _opt(
        NETWORK, "let web pages of these origins call the server from a browser (CORS), e.g. https://app.example, "
        "or * for any; the token is still required. Default: none (no CORS)", form="nargs",
        metavar="ORIGIN")] = None
    shutdown_timeout: Annotated[float, Field(gt=0), _opt(
        NETWORK, "on SIGTERM, how long requests in flight may take to finish (a long materialize, a whole answer) "
        "before the server exits anyway (default %(default)g)", metavar="SECONDS")] = 30.0

    # -- engine -----------------------------------------------------------------------------------
    served_model_names: Annotated[list[str] | None, _opt(
        ENGINE, "the model's name(s): the only ones /v1/models lists and OpenAI requests may name (another is 404 "
        "model_not_found); answers name the one asked for (default: the model's own)", form="nargs",
        flags=("--served-model-name",), metavar="NAME")] = None
    engine: Annotated[Literal["kvbaton", "sglang"], _opt(
        ENGINE, "kvbaton's engine (default), or SGLang with the kvbaton plugin (GPU; needs sglang==0.5.23 in this "
        "Python and --model <HF dir>; docs/sglang.md)")] = "kvbaton"
    sglang_args: Annotated[list[str] | None, _opt(
        ENGINE, "with --engine sglang: an sglang.Engine option (repeatable; VALUE is read as JSON when it parses), "
        "e.g. mem_fraction_static=0.5 or disable_cuda_graph=true", form="append", flags=("--sglang-arg",),
        metavar="KEY=VALUE")] = None

    # -- multi-device ------------------------------------------------------------------------------
    devices: Annotated[str | None, _opt(
        MULTI, "one worker (a Ray actor) per listed device, e.g. cuda:0,cuda:1 (or cpu,cpu); KV moves between them "
        "over NCCL (a GPU each) or Ray's object store", metavar="DEV,DEV,...")] = None
    ray_address: Annotated[str | None, _opt(
        MULTI, "run the --devices workers on this Ray cluster (auto, HOST:6379 or ray://HOST:10001; "
        "docs/multidevice.md) instead of a private Ray instance on this machine", metavar="ADDRESS")] = None
    cluster_name: Annotated[str | None, _opt(
        MULTI, "name this server's cluster, so that other servers serve it too (--attach NAME): each one more "
        "ingress over the same workers and handles; the cluster stops with this server", metavar="NAME")] = None
    attach: Annotated[str | None, _opt(
        MULTI, "serve the cluster another server started with --cluster-name NAME on the Ray cluster at "
        "--ray-address (default: auto), instead of starting workers", metavar="NAME")] = None
    balance_slack: Annotated[int, Field(ge=0), _opt(
        MULTI, "move a request off its handle's worker when that worker's queue is longer than the shortest by more "
        "than this (default %(default)s)")] = 1
    bandwidth_cap: Annotated[float | None, Field(gt=0), _opt(
        MULTI, "pace KV transfers between workers (experiments: emulate a slower interconnect)",
        metavar="BYTES_PER_S")] = None
    heartbeat_timeout: Annotated[float, Field(gt=0), _opt(
        MULTI, "a worker that answers no liveness ping for this long is hung: Ray restarts it, /health reports the "
        "cluster degraded meanwhile, and its requests run on the other workers (default %(default)g)",
        metavar="SECONDS")] = conf.DEFAULT_HEARTBEAT_TIMEOUT_S

    # -- cross-prefix reuse ---------------------------------------------------------------------------
    shared_spans: Annotated[bool, _opt(
        REUSE, "with several tokens: let a tenant's requests reuse spans of other tenants' handles (default: each "
        "tenant's own only; their prompts then shape each other's answers)", form="switch")] = False
    shared_prefix_cache: Annotated[bool, _opt(
        REUSE, "with several tokens: let a tenant's requests reuse prefix-cache blocks other tenants' requests "
        "computed (default: each tenant's own only, so that no tenant can tell from its reuse or time to first token "
        "what another sent; the cost: a prefix several tenants send, such as a common system prompt, is prefilled "
        "and stored once per tenant)", form="switch")] = False
    reuse: Annotated[Reuse | None, _opt(
        REUSE, "the reuse policy of requests that name none (the command line sets the engine's, --reuse)",
        cli=False)] = None

    # -- limits ---------------------------------------------------------------------------------------
    max_body_bytes: Annotated[int, Field(ge=1), _opt(
        LIMITS, "largest request body, else 413 (default %(default)s)")] = 8 * 1024 * 1024
    max_tokens: Annotated[int | None, Field(ge=0), _opt(
        LIMITS, "largest max_tokens a request may ask for, else 400 (default: the model's context)")] = None
    default_max_tokens: Annotated[int, Field(ge=1), _opt(
        LIMITS, "max_tokens of requests that set none, on every route (default %(default)s)")] = 256
    max_n: Annotated[int, Field(ge=1), _opt(LIMITS, "largest OpenAI n (default %(default)s)")] = 8
    max_agents: Annotated[int, Field(ge=0), _opt(
        LIMITS, "agents per tenant whose latest handle the OpenAI endpoints retain (default %(default)s)")] = 1024
    threads: Annotated[int, Field(ge=1), _opt(
        LIMITS, "worker threads for engine calls (default %(default)s)")] = 64
    max_handles_per_tenant: Annotated[Count, _opt(
        LIMITS, "live handles one tenant may hold, else 429 quota_exceeded; 0: no limit (default %(default)s)")] = 4096
    max_kv_bytes_per_tenant: Annotated[int | str | None, _opt(
        LIMITS, 'KV bytes one tenant\'s live handles may hold, counted as their tokens x bytes per token, e.g. "2GiB" '
        'or "800 blocks", else 429 quota_exceeded (default: no limit)', metavar="SIZE")] = None
    max_handle_tokens_per_tenant: Annotated[Count, _opt(
        LIMITS, "tokens one tenant's live handles may hold, forks counted in full, else 429 quota_exceeded; each "
        f"live handle keeps its token ids on the host (about {conf.HOST_BYTES_PER_HANDLE_TOKEN} bytes a token), so "
        "the default bounds them at about 64 MiB a tenant; 0: no limit (default %(default)s)",
        metavar="TOKENS")] = 8 * 1024 * 1024
    handle_ttl: Annotated[float | None, Field(gt=0), _opt(
        LIMITS, "release handles no operation named for this long (default: never)", metavar="SECONDS")] = None
    max_requests: Annotated[Count, _opt(
        LIMITS, "requests running at once (their streams included); more wait their turn, tenant by tenant, up to "
        "--queue-timeout (then 503) (default: --threads)", metavar="N")] = None
    max_requests_per_tenant: Annotated[Count, _opt(
        LIMITS, "requests of one tenant running at once; its others wait (default: half of --threads with several "
        "tokens, else no limit of its own)", metavar="N")] = None
    queue_timeout: Annotated[float, Field(gt=0), _opt(
        LIMITS, "how long a request may wait for a request slot before it is answered 503 with Retry-After "
        "(default %(default)g)", metavar="SECONDS")] = 30.0
    max_registered_agents: Annotated[Count, _opt(
        LIMITS, "agents one tenant may register (POST /v1/kv/agents, fixed prompts kept on the host); beyond, its "
        "least recently registered one is dropped; 0: no limit (default %(default)s)", metavar="N")] = 64
    max_fidelity_tokens: Annotated[Count, _opt(
        LIMITS, "largest max_tokens of POST /v1/kv/fidelity (it holds full logits of each token, about 1 MiB a "
        "token), else 400; 0: no limit (default %(default)s)", metavar="N")] = 256

    # -- streams ----------------------------------------------------------------------------------------
    max_streams: Annotated[Count, _opt(
        STREAMS, "open generation streams (native and OpenAI), else 429 quota_exceeded; 0: no limit "
        "(default %(default)s)", metavar="N")] = 256
    max_streams_per_tenant: Annotated[Count, _opt(
        STREAMS, "open generation streams of one tenant, else 429 quota_exceeded; 0: no limit (default %(default)s)",
        metavar="N")] = 32
    max_event_streams: Annotated[Count, _opt(
        STREAMS, "open event streams (GET /v1/kv/events/stream), counted apart from generations, else 429; 0: no "
        "limit (default %(default)s)", metavar="N")] = 64
    max_event_streams_per_tenant: Annotated[Count, _opt(
        STREAMS, "open event streams of one tenant, else 429; 0: no limit (default %(default)s)", metavar="N")] = 4
    event_stream_idle_timeout: Annotated[float, Field(gt=0), _opt(
        STREAMS, "an event stream with no event for this long ends (a browser's EventSource reconnects, missing "
        "nothing) (default %(default)g)", metavar="SECONDS")] = 300.0

    # -- logging ----------------------------------------------------------------------------------------
    log_level: Annotated[Literal["critical", "error", "warning", "info", "debug"], _opt(
        LOGGING, "info (default) logs one access line per request and a throughput line every --stats-interval "
        "seconds")] = "info"
    stats_interval: Annotated[float, Field(ge=0), _opt(
        LOGGING, "seconds between throughput log lines, while requests come (0: none; default %(default)g)",
        metavar="SECONDS")] = 10.0

    @model_validator(mode="after")
    def _consistent(self) -> ServerArgs:
        conf.check_tokens(self.tokens())
        conf.check_tokens(self.admin_tokens(), "admin tokens")
        if self.served_model_names is not None and (not self.served_model_names or not all(self.served_model_names)):
            raise InvalidRequest("served model names must be non-empty", param="served_model_names")
        if self.max_kv_bytes_per_tenant:
            from ..cache.block_pool import blocks_for_budget

            blocks_for_budget(self.max_kv_bytes_per_tenant, 1)  # the format; its blocks need the engine's block size
        if self.reuse is not None:
            from kvbaton.ops import check_reuse

            check_reuse(self.reuse)
        if self.attach is not None and (self.devices or self.cluster_name):
            raise InvalidRequest("--attach serves a cluster another server started: its workers are that "
                                 "server's (no --devices or --cluster-name here)", param="attach")
        return self

    @classmethod
    def of(cls, args: ServerArgs | None = None, **options: Any) -> ServerArgs:
        """``args`` (default: the defaults) with ``options`` set; ``InvalidRequest`` naming the first
        bad or unknown option."""
        values = {**(args.model_dump() if args is not None else {}),
                  **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}
        try:
            return cls(**values)
        except ValidationError as exc:
            first = exc.errors()[0]
            cause = (first.get("ctx") or {}).get("error")
            if isinstance(cause, InvalidRequest):
                raise cause from None
            name = str(first["loc"][0]) if first["loc"] else None
            if first["type"] == "extra_forbidden":
                raise InvalidRequest(f"invalid server option: {name!r} is not one", param=name) from None
            err = validation_error([{**first, "loc": (_flag(name),)}])
            reason = err.message.removeprefix("Invalid value for ").removeprefix("Invalid type for ")
            raise InvalidRequest(f"invalid server option {reason}", param=name) from None

    # -- derived values -------------------------------------------------------------------------------
    def tokens(self) -> list[str]:
        """The tenants' tokens (of a ``{token: tenant}`` map, its keys)."""
        return [self.token] if isinstance(self.token, str) else list(self.token or [])

    def admin_tokens(self) -> list[str]:
        return [self.admin_token] if isinstance(self.admin_token, str) else list(self.admin_token or [])

    def app_options(self) -> dict[str, Any]:
        """The options ``create_app`` (and the SGLang plugin's ``serve``) take as keywords: every field
        but those of the process (where to bind, which engine, the devices, the log level)."""
        return {name: value for name, value in self.model_dump().items() if name not in PROCESS_FIELDS}


PROCESS_FIELDS = frozenset({"host", "port", "engine", "sglang_args", "devices", "ray_address", "cluster_name",
                            "attach", "balance_slack",
                            "bandwidth_cap", "heartbeat_timeout", "log_level", "token"})
"""Options of the serving process, not of the app (``create_app`` takes ``token`` on its own)."""

DEFAULTS = ServerArgs()
DEFAULT_MAX_TOKENS = DEFAULTS.default_max_tokens


def _flag(name: str | None) -> str:
    """The command-line spelling of a field (``--max-streams``)."""
    info = ServerArgs.model_fields.get(name or "")
    option = next((m for m in info.metadata if isinstance(m, Option)), None) if info is not None else None
    if option is None or not option.cli:
        return str(name)
    return option.flags[0] if option.flags else f"--{str(name).replace('_', '-')}"


def server_options() -> list[tuple[str, Any, Option]]:
    """``(field, default, option)`` of every command-line option, in declaration order."""
    out = []
    for name, info in ServerArgs.model_fields.items():
        option = next((m for m in info.metadata if isinstance(m, Option)), None)
        if option is not None and option.cli:
            out.append((name, info.default, option))
    return out


def add_arguments(groups: Mapping[str, Any]) -> None:
    """One argparse option per field into its section (``groups``: section -> argument group or parser);
    each option's dest is its field, its default the field's (the CLI's environment defaults are
    :func:`from_cli`'s)."""
    for name, default, option in server_options():
        group = groups[option.group]
        flags = option.flags or (f"--{name.replace('_', '-')}",)
        common: dict[str, Any] = {"dest": name, "help": option.help}
        if option.form == "switch":
            group.add_argument(*flags, action="store_true", **common)
        elif option.form == "append":
            group.add_argument(*flags, action="append", default=None, metavar=option.metavar, **common)
        elif option.form == "nargs":
            group.add_argument(*flags, nargs="+", default=default, metavar=option.metavar, **common)
        else:
            info = ServerArgs.model_fields[name]
            choices = _choices(info.annotation)
            group.add_argument(*flags, default=default, type=_scalar(info.annotation, name), choices=choices,
                               metavar=option.metavar if choices is None else None, **common)


def _choices(annotation: Any) -> list[str] | None:
    args = getattr(annotation, "__args__", ())
    if getattr(annotation, "__origin__", None) is Literal:
        return list(args)
    return None


def _scalar(annotation: Any, name: str) -> Any:
    """The argparse type of a value option (a size such as "2GiB" stays a string)."""
    text = str(annotation)
    if name == "max_kv_bytes_per_tenant" or "str" in text or "Literal" in text:
        return None
    if "float" in text:
        return float
    if "int" in text:
        return int
    return None


def from_cli(namespace: argparse.Namespace, environ: Mapping[str, str]) -> ServerArgs:
    """The ``ServerArgs`` of parsed ``kvbaton serve`` arguments; tokens not given come from the
    environment (``$KVBATON_TOKEN``, else ``$KVBATON_API_KEY``; ``$KVBATON_ADMIN_TOKEN``)."""
    values = {name: getattr(namespace, name) for name, _, _ in server_options() if hasattr(namespace, name)}
    if values.get("token") is None:
        values["token"] = conf.env_tokens(environ) or None
    if values.get("admin_token") is None:
        admins = [t.strip() for t in environ.get(conf.ADMIN_TOKEN_ENV, "").split(",") if t.strip()]
        values["admin_token"] = admins or None
    return ServerArgs.of(**values)
