"""Typed exceptions of the kvbaton SDK.

Every error carries a stable machine-readable ``code`` and the HTTP ``status`` the server answers it
with: the server turns an error into one JSON schema (``{"error": {"code": ..., "message": ...}}``)
with that status, and the HTTP client maps the code back, so embedded and remote users catch the
same types. A 4xx status means the request was at fault, a 5xx that the server was.
"""

from __future__ import annotations


class KvbatonError(Exception):
    """Base class of every error kvbaton raises on purpose. A subclass names its ``code`` and
    ``status`` in its class line (``class HandleReleased(KvbatonError, code="handle_released",
    status=410)``); one that names neither keeps its parent's."""

    code: str = "kvbaton_error"
    status: int = 400  # an error of no more specific kind counts as the request's fault

    def __init_subclass__(cls, *, code: str | None = None, status: int | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if status is not None:
            cls.status = status

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, when one is (OpenAI clients read it)


class InvalidRequest(KvbatonError, ValueError, code="invalid_request", status=400):
    """Arguments that can never succeed: bad sampling values, empty input, wrong types."""


class ContextTooLong(InvalidRequest, code="context_too_long", status=400):
    """The prompt (plus requested new tokens) does not fit the model's context window."""


class HandleNotFound(KvbatonError, KeyError, code="handle_not_found", status=404):
    """No KV state with this id exists here (never existed, or belongs to someone else)."""

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return self.message


class HandleReleased(KvbatonError, code="handle_released", status=410):
    """The handle existed but was released; its KV is gone."""


class IncompatibleHandle(KvbatonError, code="incompatible_handle", status=409):
    """The handle was made by another model, tokenizer or positional layout."""


class UnsupportedPositions(IncompatibleHandle, code="unsupported_positions", status=409):
    """Cached keys cannot be moved to other positions exactly under this model's RoPE variant
    (dynamic NTK, YaRN, LongRoPE...); the segment must be recomputed instead."""


class MergeConflict(InvalidRequest, code="merge_conflict", status=409):
    """A merge would place two different KV states at the same positions; kvbaton never blends them."""


class PoolExhausted(KvbatonError, code="pool_exhausted", status=503):
    """The KV block pool has no room for the request; release handles or raise the budget."""


class QuotaExceeded(KvbatonError, code="quota_exceeded", status=429):
    """The tenant is at one of its quotas (live handles, KV bytes held by its handles); release
    handles first. Retrying the same request does not help until then."""


class ModelNotFound(KvbatonError, code="model_not_found", status=404):
    """The requested model is not installed or not a supported local checkpoint."""


class PayloadTooLarge(InvalidRequest, code="payload_too_large", status=413):
    """The request body exceeds the server's size limit."""


class Unauthorized(KvbatonError, code="unauthorized", status=401):
    """The server requires a bearer token and the request had none, or a wrong one."""


# raised by clients, and answered (with Retry-After) by a server whose engine is down
class ServerUnavailable(KvbatonError, code="server_unavailable", status=503):
    """The server could not be reached, the connection broke or timed out mid-request, or the
    server's engine cannot serve right now (every worker down): retry later."""


class ServerError(KvbatonError, code="internal_error", status=500):
    """The server failed on its own (a bug, not the request's fault)."""


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


# -- the message of a body that fails validation ---------------------------------------------------

_EXPECTED = {  # pydantic error types that mean "wrong JSON type", and the type that was wanted
    "string_type": "a string", "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "a boolean", "bool_parsing": "a boolean",
    "list_type": "an array", "tuple_type": "an array", "set_type": "an array", "dict_type": "an object",
    "model_type": "an object", "model_attributes_type": "an object", "none_required": "null",
}
_BRANCHES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "none": "null"}


def _branch(tag: str) -> str | None:
    """The JSON type a union branch of pydantic's error locations stands for (None: not a branch tag)."""
    if tag in _BRANCHES:
        return _BRANCHES[tag]
    if tag.startswith("list[str]"):
        return "an array of strings"
    if tag.startswith(("list[", "tuple[", "set[")):
        return "an array"
    if tag.startswith(("dict[", "function-", "json-or-python[", "tagged-union[", "is-instance[", "literal[")):
        return "an object" if tag.startswith("dict[") else "a valid value"
    return "an object" if tag[:1].isupper() else None  # a model's class name; field names are lower case


def _expected(err: dict[str, object], tags: list[str]) -> str:
    """What one union branch wanted."""
    kind = str(err.get("type", ""))
    if kind == "literal_error":
        return f"one of {(err.get('ctx') or {}).get('expected', '')}"  # type: ignore[union-attr]
    branch = _branch(tags[0]) if tags else None
    if branch is not None and branch != "a valid value":
        return branch
    return _EXPECTED.get(kind, "a valid value")


def _kind(value: object) -> str:
    for cls, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                      (list, "an array"), (dict, "an object")):
        if isinstance(value, cls):
            return name
    return "null" if value is None else type(value).__name__


def _field(loc: list[object]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(errors: list[dict[str, object]]) -> InvalidRequest:
    """One sentence for a body that fails validation (pydantic's ``errors()``), naming the field at
    fault in ``param`` as OpenAI does ("Invalid type for 'max_tokens': expected an integer, but got a
    string instead."); union branches are folded into one "expected X or Y"."""
    if not errors:
        return InvalidRequest("The request body is invalid.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = (list(first.get("loc") or ()) or ["?"])[-1]
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")  # type: ignore[union-attr]
        return InvalidRequest(f"The request body is not valid JSON ({reason} at position {where}).")

    def split(err: dict[str, object]) -> tuple[list[object], list[str], list[object]]:
        """(the field's location, the union branches on the way, the full location without them)"""
        loc = [p for p in err.get("loc") or () if p != "body"]  # type: ignore[union-attr]
        base: list[object] = []
        tags: list[str] = []
        clean: list[object] = []
        for part in loc:
            tag = _branch(part) if isinstance(part, str) else None
            if tag is not None:
                tags.append(part)  # type: ignore[arg-type]
            else:
                clean.append(part)
                if not tags:
                    base.append(part)
        return base, tags, clean

    base = split(first)[0]
    group = [e for e in errors if split(e)[0] == base]
    if len(group) > 1:  # a union: every branch failed
        deeper = [e for e in group if len(split(e)[2]) > len(base)]
        if deeper:  # one branch got further (e.g. a list with a bad item): that is what was meant
            first, group = deeper[0], [deeper[0]]
        else:
            wanted = list(dict.fromkeys(_expected(e, split(e)[1]) for e in group))
            field = _field(base)
            return InvalidRequest(f"Invalid type for '{field}': expected {' or '.join(wanted)}, but got "
                                  f"{_kind(first.get('input'))} instead.", param=field or None)
    field = _field(split(first)[2])
    kind, msg = str(first.get("type", "")), str(first.get("msg", "invalid"))
    if kind == "missing":
        return InvalidRequest(f"Missing required parameter: '{field}'.", param=field or None)
    if kind == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: '{field}'.", param=field or None)
    if kind in _EXPECTED:
        return InvalidRequest(f"Invalid type for '{field}': expected {_EXPECTED[kind]}, but got "
                              f"{_kind(first.get('input'))} instead.", param=field or None)
    msg = msg.removeprefix("Value error, ").rstrip(".")
    if not field:  # a check of the whole body (a model validator)
        return InvalidRequest(f"{msg}.")
    return InvalidRequest(f"Invalid value for '{field}': {msg[:1].lower()}{msg[1:]}.", param=field or None)
