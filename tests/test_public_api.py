"""The public API of ``import kvbaton`` is pinned: a name appears or disappears only on purpose."""

from __future__ import annotations

import importlib.resources
import inspect

import kvbaton
import pytest
from kvbaton.ops import KVOps

pytestmark = pytest.mark.unit

PUBLIC = [
    "AgentInfo", "AgentStats", "AsyncClient", "AsyncTokenStream", "CacheStats", "Capabilities", "ChatMessage",
    "Client", "Composition", "ContextTooLong", "Event", "Events", "Fidelity", "Handle", "HandleNotFound",
    "HandleReleased", "IncompatibleHandle", "InvalidRequest", "KVOps", "KvbatonError", "LineageStep", "MergeConflict",
    "ModelNotFound", "Op", "Placement", "PoolExhausted", "Positions", "ResponseFormat", "Result", "Reuse",
    "SamplingParams", "Segment",
    "SegmentReport", "ServerUnavailable", "Stats", "StepGraph", "StepGraphSpec", "StreamChunk", "Timings",
    "TokenLogprob", "TokenStream", "TopLogprob", "Unauthorized", "UnsupportedPositions", "aconnect", "connect",
]


def test_all_is_pinned_and_every_name_resolves() -> None:
    assert sorted(kvbaton.__all__) == sorted(PUBLIC)
    for name in kvbaton.__all__:
        assert getattr(kvbaton, name) is not None


def test_the_package_is_typed() -> None:
    assert importlib.resources.files("kvbaton").joinpath("py.typed").is_file()


@pytest.mark.parametrize("client", [kvbaton.Client, kvbaton.AsyncClient])
def test_both_clients_offer_every_operator_with_the_contracts_parameters(client: type) -> None:
    """Client and AsyncClient add keyword sampling options (``**options``) and nothing else."""
    for name in kvbaton.ops.OPERATORS:
        ours = inspect.signature(getattr(client, name)).parameters
        theirs = inspect.signature(getattr(KVOps, name)).parameters
        assert set(theirs) <= set(ours), f"{client.__name__}.{name} lacks {set(theirs) - set(ours)}"
        assert set(ours) - set(theirs) <= {"options"}, f"{client.__name__}.{name} adds {set(ours) - set(theirs)}"
        kinds = {p.name: p.kind for p in ours.values()}
        assert all(kinds[p.name] == p.kind for p in theirs.values()), f"{client.__name__}.{name} parameter kinds"
        assert inspect.iscoroutinefunction(getattr(client, name)) == (client is kvbaton.AsyncClient)


def test_the_http_operations_take_the_contracts_signatures() -> None:
    from kvbaton.http import AsyncHttpOps, HttpOps
    from kvbaton.wire import OPERATIONS

    assert set(OPERATIONS) == set(kvbaton.ops.OPERATORS)
    for ops in (HttpOps, AsyncHttpOps):
        for name in OPERATIONS:
            assert list(inspect.signature(getattr(ops, name)).parameters) == list(
                inspect.signature(getattr(KVOps, name)).parameters
            ), f"{ops.__name__}.{name}"
