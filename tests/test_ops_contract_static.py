"""Model-free: every engine implements the operator contract of kvbaton.ops, and the hosted-engine
contract of kvbaton.backend.hosting, with their exact signatures; the asynchronous twins
(``AsyncKVOps``, ``AsyncClient``) are their synchronous twins' with coroutines.

The classes are compared, not instances (no model loads): each operator of :class:`EngineOps` must
exist on ``Engine``, ``Cluster`` and ``SglangEngine`` with the Protocol's parameter names, kinds
and defaults, in order. An implementation may add keyword-only parameters with defaults after them
(``Cluster.transfer(..., method=)``): a caller of the contract never sees them. The same holds for
what a server uses beyond the operators (:class:`HostedEngine`: all three) and what a cluster's
coordinator calls on its workers' engines (:class:`WorkerEngine`: ``Engine``); the contract's
properties are properties of every implementation, so a server reads them without probing.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
from kvbaton.backend.hosting import WORKER_CALLS, HostedEngine, WorkerEngine
from kvbaton.client import AsyncClient, Client
from kvbaton.ops import OPERATORS, STREAM_OPERATORS, AsyncKVOps, EngineOps, KVOps

pytestmark = pytest.mark.unit

IMPLEMENTATIONS = [
    ("kvbaton.backend.engine", "Engine"),
    ("kvbaton.backend.cluster.coordinator", "Cluster"),
    ("kvbaton.backend.sglang_plugin.engine", "SglangEngine"),  # importable without sglang installed
]
METHODS = sorted(OPERATORS | {"close", "describe"})


def _load(module: str, name: str) -> type:
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except ImportError as exc:
        pytest.skip(f"{module} cannot be imported here: {exc}")


def _params(fn: object) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]  # type: ignore[arg-type]


def _own_members(protocol: type) -> dict[str, object]:
    """What ``protocol`` itself declares (not what it inherits), by name."""
    return {n: v for n, v in vars(protocol).items() if not n.startswith("_")}


def _check_signature(name: str, method: str, impl: object, protocol_fn: object) -> None:
    assert callable(impl), f"{name} lacks {method}"
    want, got = _params(protocol_fn), _params(impl)
    assert _shape(impl)[: len(want)] == _shape(protocol_fn), f"{name}.{method}{inspect.signature(impl)}"
    for extra in got[len(want) :]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty, (
            f"{name}.{method} adds {extra.name!r}, which a caller of the contract cannot leave out"
        )


def _shape(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in _params(fn)]


def test_the_operator_names_come_from_the_protocol():
    assert {"materialize", "resume", "resume_stream", "compose", "hints", "capabilities", "events"} <= OPERATORS
    assert "close" not in OPERATORS and STREAM_OPERATORS == {"resume_stream", "complete_stream", "generate_stream"}
    assert set(METHODS) <= {n for n in vars(EngineOps) | vars(KVOps) if not n.startswith("_")}


@pytest.mark.parametrize(("module", "name"), IMPLEMENTATIONS, ids=[n for _, n in IMPLEMENTATIONS])
@pytest.mark.parametrize("method", METHODS)
def test_operator_signature_matches_the_protocol(module, name, method):
    cls = _load(module, name)
    _check_signature(name, method, getattr(cls, method, None), getattr(EngineOps, method))


@pytest.mark.parametrize(("module", "name"), IMPLEMENTATIONS, ids=[n for _, n in IMPLEMENTATIONS])
def test_max_context_is_a_property(module, name):
    assert isinstance(inspect.getattr_static(_load(module, name), "max_context"), property)


HOSTED = [(module, name, HostedEngine) for module, name in IMPLEMENTATIONS]
WORKERS = [("kvbaton.backend.engine", "Engine", WorkerEngine)]


@pytest.mark.parametrize(("module", "name", "protocol"), HOSTED + WORKERS,
                         ids=[f"{n}-{p.__name__}" for _, n, p in HOSTED + WORKERS])
def test_the_hosted_contract_is_implemented_as_declared(module, name, protocol):
    cls = _load(module, name)
    for member, declared in _own_members(protocol).items():
        if isinstance(declared, property):
            assert isinstance(inspect.getattr_static(cls, member, None), property), f"{name}.{member} is not a property"
        else:
            _check_signature(name, member, getattr(cls, member, None), declared)


def test_the_worker_whitelist_is_the_contract_plus_its_extras():
    from kvbaton.backend.cluster.worker import ENGINE_METHODS, STREAM_METHODS

    assert STREAM_METHODS == STREAM_OPERATORS
    assert OPERATORS - STREAM_OPERATORS <= ENGINE_METHODS
    assert ENGINE_METHODS - OPERATORS == WORKER_CALLS
    declared = {n for p in (WorkerEngine, HostedEngine, EngineOps) for n, v in _own_members(p).items() if callable(v)}
    assert WORKER_CALLS <= declared, "every worker call is a declared method of the contract"


@pytest.mark.parametrize("method", sorted(OPERATORS | {"close"}))
def test_the_async_contract_is_the_contract_with_coroutines(method):
    sync, coroutine = getattr(KVOps, method), getattr(AsyncKVOps, method)
    assert inspect.iscoroutinefunction(coroutine) and not inspect.iscoroutinefunction(sync)
    assert _shape(coroutine) == _shape(sync)


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize("method", sorted(_public(Client)))
def test_the_async_client_is_the_client_with_coroutines(method):
    """Every method of Client is AsyncClient's with the same parameters; those that do I/O are
    coroutines there (``scope`` and ``keep`` do none), and nothing else is added but ``aclose``."""
    assert _public(AsyncClient) == _public(Client) | {"aclose"}
    sync, twin = getattr(Client, method), getattr(AsyncClient, method)
    assert _shape(twin) == _shape(sync)
    assert inspect.iscoroutinefunction(twin) == (method not in {"scope", "keep"})


def test_the_recipe_for_a_new_operator_is_written_once():
    """docs/architecture.md and kvbaton.ops say the same (the module docstring holds it whole)."""
    import kvbaton.ops

    doc = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    recipe = doc.split("## Adding an operator\n", 1)[1].split("\n## ", 1)[0].strip()
    assert recipe.startswith("Adding an operator") and recipe in (kvbaton.ops.__doc__ or "")
