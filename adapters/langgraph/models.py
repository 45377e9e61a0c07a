"""Where a LangGraph app's LLM calls go: the chat models its nodes reach, found before it runs.

``wrap(app)`` must route every LLM call of the app through kvbaton or refuse (never a silent no-op),
so it looks for the chat models each node uses: in the node's runnable (bindings, sequences,
parallels, lambdas), in a node function's closure, defaults, ``functools.partial`` arguments,
bound ``self`` and the module globals it names, and in subgraphs. What it finds is classified:

- :class:`~kvbaton.adapters.langgraph.KvbatonChatModel`: runs on kvbaton (mode 1);
- an OpenAI-SDK model (``langchain_openai``'s ``ChatOpenAI`` family): its base URL says where it
  goes (``api.openai.com`` unless set; mode 2 routes it);
- anything else: cannot be routed through kvbaton.

A model built inside a node at run time is not visible here; the wrapper checks those when they
start (see :meth:`kvbaton.adapters.langgraph.run.Run.on_chat_model_start`).
"""

from __future__ import annotations

import functools
import inspect
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import Runnable

OPENAI_BASE = "https://api.openai.com/v1"
_DEPTH = 6  # how far from a node the search follows references (closures of closures, ...)
_VISITS = 20_000  # objects looked at per app at most: the search must stay instant
# libraries whose objects hold no chat model of the app (and are large: engines, tensors, clients)
_OPAQUE = ("builtins", "threading", "logging", "asyncio", "kvbaton", "torch", "transformers", "numpy", "httpx",
           "openai", "pydantic", "typing", "langgraph.checkpoint")


@dataclass(frozen=True)
class FoundModel:
    """A chat model a node reaches: ``kind`` is ``"kvbaton"``, ``"openai"`` or ``"other"``;
    ``base_url`` is where an OpenAI-SDK model sends its requests (``/v1`` form)."""

    node: str
    model: Any
    kind: str
    base_url: str | None = None

    @property
    def name(self) -> str:
        return type(self.model).__name__


def normalize_base_url(base_url: str) -> str:
    """``http://host:8470`` or ``http://host:8470/v1`` -> ``http://host:8470/v1``."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _openai_base(model: Any) -> str | None:
    """The base URL an OpenAI-SDK chat model sends to, or None when ``model`` is not one."""
    try:
        from langchain_openai.chat_models.base import BaseChatOpenAI
    except ImportError:
        return None
    if not isinstance(model, BaseChatOpenAI):
        return None
    base = model.openai_api_base or os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE")
    return normalize_base_url(base) if base else OPENAI_BASE


def classify(node: str, model: Any) -> FoundModel:
    from .chat_model import KvbatonChatModel

    if isinstance(model, KvbatonChatModel):
        return FoundModel(node, model, "kvbaton")
    base = _openai_base(model)
    if base is not None:
        return FoundModel(node, model, "openai", base)
    return FoundModel(node, model, "other")


def _referenced(obj: Any) -> Iterator[Any]:
    """The objects ``obj`` uses directly, as far as a static look can tell."""
    if isinstance(obj, BaseChatModel):
        return
    if isinstance(obj, Runnable):
        for attr in ("bound", "first", "last", "func", "afunc", "runnable", "default", "builder"):
            value = getattr(obj, attr, None)
            if value is not None:
                yield value
        for attr in ("middle", "steps", "branches"):
            yield from getattr(obj, attr, None) or ()
        steps = getattr(obj, "steps__", None)
        if isinstance(steps, dict):
            yield from steps.values()
        return
    if isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
        return
    if isinstance(obj, types.MethodType):
        yield obj.__func__
        yield obj.__self__
        return
    if isinstance(obj, types.FunctionType):
        yield from (cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
        yield from obj.__defaults__ or ()
        yield from (obj.__kwdefaults__ or {}).values()
        for name in _global_names(obj.__code__):
            if name in obj.__globals__:
                value = obj.__globals__[name]
                if not isinstance(value, types.ModuleType) and not inspect.isclass(value):
                    yield value
        return
    if isinstance(obj, list | tuple | set | frozenset):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    elif hasattr(obj, "__dict__") and not inspect.isclass(obj) and not isinstance(obj, types.ModuleType):
        if not type(obj).__module__.startswith(_OPAQUE):
            yield from vars(obj).values()


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions and lambdas
            yield from _global_names(const)


def _models_of(root: Any) -> Iterator[Any]:
    seen: set[int] = set()
    todo = [(root, 0)]
    while todo and len(seen) < _VISITS:
        obj, depth = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, str | bytes | int | float | bool):
            continue
        seen.add(id(obj))
        if isinstance(obj, BaseChatModel):
            yield obj
            continue
        if depth < _DEPTH:
            todo.extend((child, depth + 1) for child in _referenced(obj))


def find_chat_models(app: Any) -> list[FoundModel]:
    """The chat models the nodes of a compiled graph (``app.builder``) reach, each once, with the
    first node found to use it; subgraphs count for the node that runs them."""
    builder = getattr(app, "builder", None)
    nodes = getattr(builder, "nodes", None) or {}
    found: dict[int, FoundModel] = {}
    for name, spec in nodes.items():
        for model in _models_of(getattr(spec, "runnable", spec)):
            found.setdefault(id(model), classify(name, model))
    return list(found.values())
