"""Model-free: every engine implements the operator contract of kvbaton.ops with its exact signatures.

The classes are compared, not instances (no model loads): each operator of :class:`EngineOps` must
exist on ``Engine``, ``Cluster`` and ``SglangEngine`` with the Protocol's parameter names, kinds
and defaults, in order. An implementation may add keyword-only parameters with defaults after them
(``Cluster.transfer(..., method=)``): a caller of the contract never sees them.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
from kvbaton.ops import OPERATORS, STREAM_OPERATORS, EngineOps, KVOps

pytestmark = pytest.mark.unit

IMPLEMENTATIONS = [
    ("kvbaton.backend.engine", "Engine"),
    ("kvbaton.backend.cluster", "Cluster"),
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


def test_the_operator_names_come_from_the_protocol():
    assert {"materialize", "resume", "resume_stream", "compose", "hints", "capabilities", "events"} <= OPERATORS
    assert "close" not in OPERATORS and STREAM_OPERATORS == {"resume_stream", "complete_stream", "generate_stream"}
    assert set(METHODS) <= {n for n in vars(EngineOps) | vars(KVOps) if not n.startswith("_")}


@pytest.mark.parametrize(("module", "name"), IMPLEMENTATIONS, ids=[n for _, n in IMPLEMENTATIONS])
@pytest.mark.parametrize("method", METHODS)
def test_operator_signature_matches_the_protocol(module, name, method):
    cls = _load(module, name)
    impl = getattr(cls, method, None)
    assert callable(impl), f"{name} lacks {method}"
    protocol = getattr(EngineOps, method)
    want, got = _params(protocol), _params(impl)
    shape = lambda ps: [(p.name, p.kind, p.default) for p in ps]  # noqa: E731
    assert shape(got[: len(want)]) == shape(want), f"{name}.{method}{inspect.signature(impl)}"
    for extra in got[len(want) :]:
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty, (
            f"{name}.{method} adds {extra.name!r}, which a caller of the contract cannot leave out"
        )


@pytest.mark.parametrize(("module", "name"), IMPLEMENTATIONS, ids=[n for _, n in IMPLEMENTATIONS])
def test_max_context_is_a_property(module, name):
    assert isinstance(inspect.getattr_static(_load(module, name), "max_context"), property)


def test_the_worker_whitelist_is_the_contract_plus_its_extras():
    from kvbaton.backend.worker import ENGINE_METHODS, STREAM_METHODS

    assert STREAM_METHODS == STREAM_OPERATORS
    assert OPERATORS - STREAM_OPERATORS <= ENGINE_METHODS
    assert ENGINE_METHODS - OPERATORS == {"describe", "adopt", "flush_cache", "cached_prefix", "isolate_prefix_cache"}
