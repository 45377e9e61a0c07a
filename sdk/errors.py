"""Typed exceptions of the kvbaton SDK.

Every error carries a stable machine-readable ``code`` and the HTTP ``status`` the server answers it
with: the server turns an error into one JSON schema (``{"error": {"code": ..., "message": ...}}``)
with that status, and the HTTP client maps the code back, so embedded and remote users catch the
same types. A 4xx status means the request was at fault, a 5xx that the server was.
"""

from __future__ import annotations


class KvbatonError(Exception):
    """Base class of every error kvbaton raises on purpose."""

    code: str = "kvbaton_error"
    status: int = 400  # an error of no more specific kind counts as the request's fault

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when one is (OpenAI clients read it)


class InvalidRequest(KvbatonError, ValueError):
    """Arguments that can never succeed: bad sampling values, empty input, wrong types."""

    code = "invalid_request"
    status = 400


class ContextTooLong(InvalidRequest):
    """The prompt (plus requested new tokens) does not fit the model's context window."""

    code = "context_too_long"
    status = 400


class HandleNotFound(KvbatonError, KeyError):
    """No KV state with this id exists here (never existed, or belongs to someone else)."""

    code = "handle_not_found"
    status = 404

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return self.message


class HandleReleased(KvbatonError):
    """The handle existed but was released; its KV is gone."""

    code = "handle_released"
    status = 410


class IncompatibleHandle(KvbatonError):
    """The handle was made by another model, tokenizer or positional layout."""

    code = "incompatible_handle"
    status = 409


class UnsupportedPositions(IncompatibleHandle):
    """Cached keys cannot be moved to other positions exactly under this model's RoPE variant
    (dynamic NTK, YaRN, LongRoPE...); the segment must be recomputed instead."""

    code = "unsupported_positions"
    status = 409


class MergeConflict(InvalidRequest):
    """A merge would place two different KV states at the same positions; kvbaton never blends them."""

    code = "merge_conflict"
    status = 409


class PoolExhausted(KvbatonError):
    """The KV block pool has no room for the request; release handles or raise the budget."""

    code = "pool_exhausted"
    status = 503


class QuotaExceeded(KvbatonError):
    """The tenant is at one of its quotas (live handles, KV bytes held by its handles); release
    handles first. Retrying the same request does not help until then."""

    code = "quota_exceeded"
    status = 429


class ModelNotFound(KvbatonError):
    """The requested model is not installed or not a supported local checkpoint."""

    code = "model_not_found"
    status = 404


class PayloadTooLarge(InvalidRequest):
    """The request body exceeds the server's size limit."""

    code = "payload_too_large"
    status = 413


class Unauthorized(KvbatonError):
    """The server requires a bearer token and the request had none, or a wrong one."""

    code = "unauthorized"
    status = 401


class ServerUnavailable(KvbatonError):
    """The server could not be reached, the connection broke or timed out mid-request, or the
    server's engine cannot serve right now (every worker down): retry later."""

    code = "server_unavailable"
    status = 503  # raised by clients, and answered (with Retry-After) by a server whose engine is down


class ServerError(KvbatonError):
    """The server failed on its own (a bug, not the request's fault)."""

    code = "internal_error"
    status = 500


ERRORS_BY_CODE: dict[str, type[KvbatonError]] = {
    cls.code: cls
    for cls in (
        KvbatonError,
        InvalidRequest,
        ContextTooLong,
        HandleNotFound,
        HandleReleased,
        IncompatibleHandle,
        UnsupportedPositions,
        MergeConflict,
        PoolExhausted,
        QuotaExceeded,
        ModelNotFound,
        PayloadTooLarge,
        Unauthorized,
        ServerUnavailable,
        ServerError,
    )
}


# Codes the OpenAI routes answer with instead of kvbaton's own, for the clients that look for them.
OPENAI_CODES: dict[str, str] = {ContextTooLong.code: "context_length_exceeded"}


def error_from_code(code: str, message: str, param: str | None = None) -> KvbatonError:
    """The typed exception for an error ``code`` (as the server reports it, OpenAI aliases
    included); unknown codes give a plain :class:`KvbatonError` that still carries the code."""
    cls = ERRORS_BY_CODE.get(code) or next((ERRORS_BY_CODE[k] for k, v in OPENAI_CODES.items() if v == code), None)
    err = (cls or KvbatonError)(message, param=param)
    if cls is None:
        err.code = code
    return err
