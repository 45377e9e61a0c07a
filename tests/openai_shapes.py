"""Answers checked against the ``openai`` package's own models (``openai.types``), not the server's
re-declaration of them: a field of the wrong type, a missing one, or a name the ``openai`` model does
not have (kvbaton's extensions aside) fails the test that received it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

KVBATON_EXTRAS = frozenset({"kvbaton", "max_model_len"})  # kvbaton's field; vLLM's model card field


def unknown_fields(value: Any, where: str = "") -> list[str]:
    """Every field of a validated ``openai`` model (nested ones too) that the model does not declare."""
    out: list[str] = []
    if isinstance(value, BaseModel):
        for name in (value.model_extra or {}):
            if name not in KVBATON_EXTRAS:
                out.append(f"{where}.{name}" if where else name)
        for name in type(value).model_fields:
            out += unknown_fields(getattr(value, name), f"{where}.{name}" if where else name)
    elif isinstance(value, list | tuple):
        for k, item in enumerate(value):
            out += unknown_fields(item, f"{where}[{k}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            out += unknown_fields(item, f"{where}.{key}")
    return out


def check(body: dict[str, Any] | str, model: type[BaseModel]) -> Any:
    """``body`` (JSON text or a parsed dict) validated as ``model`` (an ``openai.types`` class), and
    holding no field the model does not have; the validated object."""
    data = json.loads(body) if isinstance(body, str) else body
    validated = model.model_validate(data)
    extra = unknown_fields(validated)
    assert not extra, f"fields {extra} are not in openai's {model.__name__}: {data}"
    return validated


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """``(event, data)`` of each server-sent event of a response body."""
    out = []
    for block in text.split("\n\n"):
        event, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        if data:
            out.append((event, "\n".join(data)))
    return out


def check_all(bodies: Iterable[str], model: type[BaseModel]) -> list[Any]:
    return [check(b, model) for b in bodies]
