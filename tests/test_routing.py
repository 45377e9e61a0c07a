"""The cluster's router: tickets, handle leases and load, without Ray workers or a model.

Specification (the router a cluster's control runs, whichever ingress opened the ticket):
- a handle is leased to one request from its placement until the worker admitted it: a second
  request (or a move) on the same handle waits until the first started, then runs;
- a lease its ingress never gave back (the ingress died mid-request) is broken after its time to
  live, so no request waits on it forever; a request waiting for a handle that gets released learns so;
- a worker's load is the tickets placed on it and not ended, whichever ingress opened them, and a
  ticket that failed because its worker died marks the worker lost (its handles recomputed on next use);
- the handles a request made belong to its tenant, or to the tenant of the handle it ran on (a fork).
"""

from __future__ import annotations

import threading
import time

import pytest
from kvbaton.errors import HandleReleased
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions, new_handle_id

pytest.importorskip("ray")

from kvbaton.backend.cluster import routing
from kvbaton.backend.cluster.placement import Placer
from kvbaton.backend.cluster.routing import Router

pytestmark = pytest.mark.unit


class FakeWorker:
    """What the router reads of a worker: its rank, liveness and whether it has a prefix cache."""

    def __init__(self, rank: int) -> None:
        self.rank, self.device, self.alive, self.info = rank, "cpu", True, {"prefix_cache": True}

    def lost(self) -> None:
        self.alive = False


def _handle(tokens: int = 4) -> Handle:
    return Handle(id=new_handle_id(), model="fake", model_fingerprint="0", tokenizer_fingerprint="0",
                  num_tokens=tokens, positions=Positions(rope_type="default", rope_theta=1.0),
                  lineage=(LineageStep(op=Op.MATERIALIZE, token_ids=tuple(range(tokens))),),
                  placement=Placement(device="cpu"))


@pytest.fixture
def router() -> Router:
    return Router(Placer(slack=100), [FakeWorker(0), FakeWorker(1)])  # type: ignore[list-item]


def test_a_second_request_on_a_handle_waits_until_the_first_started(router):
    handle = _handle()
    router.record(1, [handle], owner="ta")
    first = router.begin_on_handle(handle.id)
    assert first.rank == 1 and first.hids == (handle.id,)
    got = []
    waiter = threading.Thread(target=lambda: got.append(router.begin_on_handle(handle.id)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # leased to the first
    router.started(first)
    waiter.join(10)
    assert got and got[0].rank == 1
    router.done(got[0])
    router.done(first)


def test_a_lease_never_given_back_is_broken_after_its_time_to_live(router, monkeypatch):
    monkeypatch.setattr(routing, "LEASE_TTL_S", 0.2)
    handle = _handle()
    router.record(0, [handle])
    router.begin_on_handle(handle.id)  # its ingress died: never started, done or failed
    again = router.begin_on_handle(handle.id)
    assert again.rank == 0


def test_a_request_waiting_for_a_handle_released_meanwhile_gets_the_typed_error(router):
    handle = _handle()
    router.record(0, [handle])
    first = router.begin_on_handle(handle.id)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            router.begin_on_handle(handle.id)
        except HandleReleased as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    router.release([handle.id])
    waiter.join(10)
    assert not waiter.is_alive() and len(errors) == 1
    router.done(first)


def test_load_counts_open_tickets_and_a_lost_worker_is_marked(router):
    a, b = router.begin_anywhere(None), router.begin_anywhere(None)
    assert {a.rank, b.rank} == {0, 1}  # the second sees the first's load
    assert [router.placer.load(w) for w in router.workers] == [1, 1]
    router.done(a)
    router.failed(b, lost=True)
    assert [router.placer.load(w) for w in router.workers] == [0, 0]
    assert not router.workers[b.rank].alive and router.retries == 1


def test_handles_a_request_made_belong_to_its_tenant_or_to_its_handles(router):
    parent = _handle()
    router.record(0, [parent], owner="ta")
    fork = router.begin_on_handle(parent.id)
    children = [_handle(), _handle()]
    router.done(fork, children)  # a fork names no tenant: its parent's
    assert [router.owner_of(c.id) for c in children] == [("ta", 4), ("ta", 4)]
    made = router.begin_anywhere(None)
    fresh = _handle(7)
    router.done(made, [fresh], owner="tb")
    assert router.owner_of(fresh.id) == ("tb", 7) and router.owner_of(new_handle_id()) is None
