"""Server constants the SDK shares (the bind address, the token variables, the log format) and the
bind policy, importable without torch (the CLI refuses a bad bind before the engine is loaded). The
server's limits are declared once, in ``kvbaton.backend.server.args.ServerArgs``."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from .errors import InvalidRequest

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
ADMIN_TOKEN_ENV = "KVBATON_ADMIN_TOKEN"
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
