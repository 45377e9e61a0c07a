"""Server defaults and the bind policy, importable without torch (the CLI parses arguments and
refuses a bad bind before the engine is loaded)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from .errors import InvalidRequest

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# max_tokens of a request that gives none, on every route (native and OpenAI): one value, set by
# --default-max-tokens. (SDK clients always send their own, SamplingParams' default.)
DEFAULT_MAX_TOKENS = 256
DEFAULT_STATS_INTERVAL_S = 10.0  # how often the server logs its throughput line (0: never)
DEFAULT_MAX_N = 8
DEFAULT_MAX_AGENTS = 1024
DEFAULT_THREADS = 64
DEFAULT_MAX_HANDLES_PER_TENANT = 4096  # live handles of one tenant (0: no limit)
# Tokens of one tenant's live handles, forks counted in full (0: no limit). Each live handle keeps its
# token ids on the host, a list of 8-byte references per handle (forks share K/V blocks, not that
# list), so this bounds one tenant's token lists at about 8 bytes x 8Mi tokens = 64 MiB of host memory.
DEFAULT_MAX_HANDLE_TOKENS_PER_TENANT = 8 * 1024 * 1024
# Open streams (generation streams and event streams), of the whole server and of one tenant (0: no limit).
DEFAULT_MAX_STREAMS = 256
DEFAULT_MAX_STREAMS_PER_TENANT = 32
# Agents one tenant may register (POST /v1/kv/agents); beyond, its least recently registered one is dropped.
# The engine keeps each one's fixed prompt on the host: about 36 bytes a token, up to the model's context.
DEFAULT_MAX_REGISTERED_AGENTS = 64
# Tokens POST /v1/kv/fidelity may generate to compare: it holds both sides' full logits of each on the
# host (about 0.5 GiB at 512 tokens with the default model), so longer checks are refused.
DEFAULT_MAX_FIDELITY_TOKENS = 256
ADMIN_TOKEN_ENV = "KVBATON_ADMIN_TOKEN"
# How long a client may stall a connection (request headers, a pause in its body, an unread answer).
DEFAULT_CLIENT_TIMEOUT_S = 30.0
# A cluster worker that answers no heartbeat for this long is hung: stopped, its requests fail over.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
HOST_BYTES_PER_HANDLE_TOKEN = 8  # a list slot: a reference to the (shared) token int
MAX_JSON_DEPTH = 64  # deepest nesting of arrays/objects in a request body
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # kvbaton's and uvicorn's lines alike
TOKEN_ENV = "KVBATON_TOKEN"
API_KEY_ENV = "KVBATON_API_KEY"  # read when KVBATON_TOKEN is unset (vLLM's --api-key, by its kvbaton name)


def env_tokens(environ: Mapping[str, str]) -> list[str]:
    """The tokens of a server given none on its command line: ``$KVBATON_TOKEN``, else
    ``$KVBATON_API_KEY`` (comma-separated)."""
    value = environ.get(TOKEN_ENV) or environ.get(API_KEY_ENV) or ""
    return [t.strip() for t in value.split(",") if t.strip()]


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_tokens(tokens: Sequence[str], what: str = "tokens") -> None:
    """Refuse an empty token, or one with whitespace (``--token ''``): it could never be sent."""
    if any(not t or t != t.strip() or any(c.isspace() for c in t) for t in tokens):
        raise InvalidRequest(f"{what} must be non-empty and contain no whitespace")


def check_bind(host: str, tokens: Sequence[str]) -> None:
    """Refuse to expose an unauthenticated server: a non-loopback bind needs a token (a valid one)."""
    check_tokens(tokens)
    if not is_loopback(host) and not tokens:
        raise InvalidRequest(
            f"refusing to bind {host}: a non-loopback address requires a token "
            f"(pass --token or --api-key, or set {TOKEN_ENV} or {API_KEY_ENV}); without one, bind 127.0.0.1"
        )
