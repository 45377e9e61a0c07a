"""What the grammar engine can enforce: a response format it would give up on is a 400 before any work.

Constrained decoding (llguidance, ``backend/runtime/constrained.py``) compiles any valid JSON schema,
but its Earley parser holds at most ``MAX_ITEMS_IN_ROW`` (2000) items in one row: an object whose
optional properties may come in any subset takes four items each at the point where its next key
starts, so an object of more than :data:`MAX_OPTIONAL_PROPERTIES` optional properties fails there —
after the prompt was prefilled, at the answer's first key ("ParserTooComplex"). :func:`check_format`
refuses such a schema when the request is read (400 naming the limit), and :func:`grammar_failure`
turns any other failure of the grammar engine met while generating into a 400 too, never a 500.
"""

from __future__ import annotations

from typing import Any

from kvbaton.errors import InvalidRequest
from kvbaton.types import ResponseFormat

MAX_ITEMS_IN_ROW = 2000  # llguidance's ParserLimits.max_items_in_row (its default)
MAX_OPTIONAL_PROPERTIES = MAX_ITEMS_IN_ROW // 4  # 500: four parser items per optional property
_FAILURE_PREFIX = "constrained decoding:"  # how the runtime reports a token the grammar engine rejects


def _objects(schema: Any) -> Any:
    """Every sub-schema that declares ``properties`` (nested anywhere)."""
    if isinstance(schema, dict):
        if isinstance(schema.get("properties"), dict):
            yield schema
        for value in schema.values():
            yield from _objects(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _objects(value)


def check_format(fmt: ResponseFormat | None, param: str = "response_format") -> None:
    """``InvalidRequest`` (naming the limit) for a response format the grammar engine cannot enforce."""
    if fmt is None or fmt.type != "json_schema":
        return
    for obj in _objects((fmt.json_schema or {}).get("schema")):
        required = obj.get("required") if isinstance(obj.get("required"), list) else []
        optional = len(set(obj["properties"]) - set(required))
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise InvalidRequest(
                f"Invalid value for '{param}': an object of its schema has {optional} optional properties; the "
                f"grammar engine (llguidance) enforces at most {MAX_OPTIONAL_PROPERTIES} in one object (its parser's "
                f"limit of {MAX_ITEMS_IN_ROW} items in a row): make some of them required, or split the object.",
                param=param,
            )


def grammar_failure(exc: BaseException) -> InvalidRequest | None:
    """The 400 of a failure of the grammar engine met while generating (None: not one)."""
    if isinstance(exc, RuntimeError) and str(exc).startswith(_FAILURE_PREFIX):
        return InvalidRequest(f"Invalid value for 'response_format': the grammar engine could not enforce it ({exc}); "
                              "simplify the schema.", param="response_format")
    return None
