"""Multi-device and multi-node backend on Ray: two CPU worker actors on two simulated nodes.

One local multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head without workers and two
nodes of one CPU each) is started once for the module, and one kvbaton ``Cluster`` on it: a worker
actor per node (``STRICT_SPREAD``), KV moved over a gloo group formed inside the actors, each worker
persistent (its own journal on its own disk tier). The cluster is named, so its control is a Ray actor
that other ingresses attach to, as ``kvbaton serve --cluster-name`` / ``--attach`` run it.

Specification:
- a handle materialized on one node and resumed on the other after a KV transfer gives exactly the
  tokens of dense prefill under greedy decoding; so does one recomputed from lineage, a fork's
  children spread over both nodes, and a merge of handles living on different nodes;
- the cost model transfers when the link is fast and recomputes when it is throttled, and every
  decision is reported with predicted and measured times;
- two transfers run at the same time (crossing between the nodes), both exact: there is no
  cluster-wide transfer lock;
- every worker keeps tenants' prefix caches apart, and a server over the cluster (the ingress)
  authenticates and separates tenants as over one engine;
- a stream the consumer abandons leaves nothing on the workers;
- a second ingress attached to the cluster serves the same handles exactly, reads its streams from the
  workers, and moves and resumes one handle at the same time as the first without a wrong token; a
  server process attached to it authorizes every tenant as the server that made the handle would;
- a worker killed mid-stream: the stream finishes on the other worker with the same tokens; a handle
  that lived only there is recomputed from lineage on next use; Ray restarts the actor, which rejoins
  with the handles its journal kept and serves again (its KV moves now go through the object store:
  a torch.distributed group takes no new member).

The order of the tests matters: the worker-kill test runs last on the shared cluster.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import dense_greedy
from kvbaton.bench.corpus import document
from kvbaton.embedded import EmbeddedClient
from kvbaton.errors import HandleReleased, InvalidRequest
from kvbaton.handle import Op
from kvbaton.types import Result, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(max_tokens=10)
SUFFIX = [28, 1217, 314, 253, 3037, 47]  # a handful of ordinary token ids
WAIT_S = 240.0  # how long a restart may take on a busy 2-core machine: never a measured bound
CLUSTER_NAME = "tests"


@pytest.fixture(scope="module")
def ray_nodes():
    from ray.cluster_utils import Cluster as RayNodes

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_worker_niceness", "0")  # as kvbaton's own Ray start does: the workers are the work
        nodes = RayNodes(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        for _ in range(2):
            nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, logging_level="warning", log_to_driver=False, include_dashboard=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_nodes, tmp_path_factory: pytest.TempPathFactory):
    from kvbaton.backend.cluster import Cluster

    tiers = tmp_path_factory.mktemp("tiers")
    c = Cluster(["cpu", "cpu"], engine_options={"kv_budget": "96MiB", "tiers": (f"disk:256MiB:{tiers}",),
                                                "persist": True},
                ray_address=ray_nodes.address, transport="collective", placement_strategy="STRICT_SPREAD",
                worker_threads=1, calibrate=False, calibration_cache=None, name=CLUSTER_NAME)
    c.calibrate(prefill_tokens=(32, 96, 256))  # short probes: enough for the choices these tests make
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(cluster):
    return EmbeddedClient(engine=cluster)


def last_decision(cluster, handle_id: str):
    return [d for d in cluster.stats().cluster.decisions if d.handle == handle_id][-1]


def other(rank: int) -> int:
    return 1 - rank


def until(predicate, what: str) -> None:
    """Wait for a state (polling; the assertion is on the state, never on the time it took)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never got to: {what}"
        time.sleep(0.2)


@pytest.mark.unit
def test_nccl_only_between_workers_with_a_gpu_each_and_skipped_cleanly_without_one():
    import importlib.util
    import sys
    from pathlib import Path

    from kvbaton.backend.cluster.launch import bundle
    from kvbaton.backend.cluster.worker import default_backend

    assert default_backend(["cuda:0", "cuda:1"]) == "nccl"
    assert default_backend(["cuda", "cuda"]) == "gloo"  # two workers sharing one GPU: NCCL refuses that
    assert default_backend(["cpu", "cpu"]) == default_backend(["cuda:0", "cpu"]) == "gloo"
    assert bundle("cuda:1") == {"GPU": 1.0, "CPU": 1.0} and bundle("cpu") == {"CPU": 1.0}
    path = Path(__file__).parent.parent / "scripts" / "gpu_multidevice.py"
    spec = importlib.util.spec_from_file_location("gpu_multidevice", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules.pop("gpu_multidevice", None)
    spec.loader.exec_module(script)  # imports cleanly here
    devices, _, transports, why = script.plan(smoke_cpu=False)
    if not __import__("torch").cuda.is_available():  # CI: the NCCL check says it was skipped, and why
        assert (devices, transports) == ([], []) and "no CUDA device" in why
    assert script.plan(smoke_cpu=True)[0] == ["cpu", "cpu"]


@pytest.mark.unit
def test_a_private_ray_instance_never_joins_another_running_on_the_machine(monkeypatch):
    # Without an address Ray joins the newest cluster in /tmp/ray (another server's, this module's own): a
    # `kvbaton serve --devices` started meanwhile then failed ("num_cpus ... must not be provided").
    from kvbaton.backend.cluster import launch

    calls = []
    monkeypatch.setenv("RAY_worker_niceness", "0")  # what connect() sets, undone after the test
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.ray, "init", lambda **kw: calls.append(kw))
    assert launch.connect(None, ["cpu", "cpu"]) is True
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] >= 2
    assert launch.connect("ray://head:10001", ["cpu"]) is True
    assert calls[-1]["address"] == "ray://head:10001"


def test_engine_exports_and_adopts_kv_exactly(engine, reference, corpus_tokens):
    """The engine-level primitives the workers use: blocks out of one engine, into another."""
    from kvbaton.backend import Engine

    other_engine = Engine(kv_budget="64MiB")
    try:
        context = corpus_tokens[:70]
        result = engine.resume(engine.materialize(context), SUFFIX, GREEDY)  # leaves one token pending
        meta, num_cached, blocks = engine.export_kv(result.handle)
        assert num_cached == meta.num_tokens - 1
        adopted = other_engine.adopt(meta, blocks, num_cached)
        assert (adopted.id, adopted.lineage) == (meta.id, meta.lineage)
        assert other_engine.stats().tokens_prefilled == 0  # nothing recomputed
        more = other_engine.resume(adopted, SUFFIX, GREEDY)
        full = context + SUFFIX + result.token_ids + SUFFIX
        assert more.token_ids == dense_greedy(reference, full, GREEDY.max_tokens)[0]
        with pytest.raises(InvalidRequest, match="already lives"):
            other_engine.adopt(meta)
        recomputed = Engine(kv_budget="64MiB")
        try:  # without blocks: recomputed from the lineage tokens
            assert recomputed.resume(recomputed.adopt(meta), SUFFIX, GREEDY).token_ids == more.token_ids
        finally:
            recomputed.close()
    finally:
        other_engine.close()


def test_single_engine_transfer_is_a_no_op_to_its_device_and_refused_elsewhere(engine):
    client = EmbeddedClient(engine=engine)
    handle = client.materialize("One device only.")
    assert client.transfer(handle, 0) == handle
    assert client.transfer(handle, "cpu") == handle
    with pytest.raises(InvalidRequest, match="multi-device server"):
        client.transfer(handle, 1)


def test_two_calibrated_workers_on_two_nodes(client, cluster):
    stats = client.stats()
    assert stats.device == "cpu,cpu"
    assert [w.rank for w in stats.cluster.workers] == [0, 1]
    assert all(w.alive and w.stats is not None for w in stats.cluster.workers)
    assert len({w.info["node_id"] for w in cluster.workers}) == 2  # one worker per node
    assert cluster.transport == "collective (gloo)"
    assert stats.cluster.bandwidth_bytes_per_s > 0 and stats.cluster.latency_s > 0
    assert all(w.prefill_tokens_per_s > 0 for w in stats.cluster.workers)


def test_handle_transferred_to_the_other_node_resumes_exactly(client, cluster, reference, corpus_tokens):
    context = corpus_tokens[:150]
    handle = client.materialize(context)
    src = handle.placement.worker
    moved = client.transfer(handle, other(src))
    assert moved.id == handle.id and moved.placement.worker == other(src)
    assert moved.lineage[:-1] == handle.lineage and moved.lineage[-1].op is Op.TRANSFER
    assert moved.token_ids() == context
    decision = last_decision(cluster, handle.id)
    assert (decision.src, decision.dst, decision.choice) == (src, other(src), "transfer")
    assert decision.predicted_transfer_s < decision.predicted_recompute_s and decision.actual_s > 0
    result = client.resume(handle.id, SUFFIX, sampling=GREEDY)
    assert result.handle.placement.worker == other(src)
    assert result.token_ids == dense_greedy(reference, context + SUFFIX, GREEDY.max_tokens)[0]
    # Back to the first worker, whose prefix cache still holds the context: recompute is predicted cheap.
    client.transfer(handle, src)
    back = last_decision(cluster, handle.id)
    assert back.predicted_recompute_s < cluster.predict_recompute(src, len(context))
    client.release([handle, result.handle])


def test_transfer_to_its_own_worker_is_a_no_op_and_bad_targets_are_refused(client):
    handle = client.materialize("Short context for transfer targets.")
    here = handle.placement.worker
    assert client.transfer(handle, here) == handle
    with pytest.raises(InvalidRequest, match="use the worker rank"):
        client.transfer(handle, "cpu")  # two workers are on "cpu"
    with pytest.raises(InvalidRequest, match="no worker 7"):
        client.transfer(handle, 7)
    client.release(handle)
    with pytest.raises(HandleReleased):
        client.transfer(handle, other(here))


def test_two_transfers_at_once_cross_between_the_nodes_exactly(client, cluster, reference, corpus_tokens):
    contexts = [corpus_tokens[200:330], corpus_tokens[340:470]]
    a = client.materialize(contexts[0])
    b = client.transfer(client.materialize(contexts[1]), other(a.placement.worker))  # one on each worker
    moved: dict[int, object] = {}
    go = threading.Barrier(2)

    def move(i: int, handle) -> None:
        go.wait()
        moved[i] = cluster.transfer(handle, other(handle.placement.worker), method="transfer")

    threads = [threading.Thread(target=move, args=(i, h)) for i, h in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {moved[0].placement.worker, moved[1].placement.worker} == {0, 1}
    for handle, context in zip((a, b), contexts, strict=True):
        assert last_decision(cluster, handle.id).choice == "transfer"
        out = client.resume(handle, SUFFIX, sampling=GREEDY)
        assert out.token_ids == dense_greedy(reference, context + SUFFIX, GREEDY.max_tokens)[0]
        client.release(out.handle)
    client.release([a, b])


def test_cost_model_recomputes_when_bandwidth_is_throttled(client, cluster, reference, corpus_tokens):
    context = corpus_tokens[480:610]
    handle = client.materialize(context)
    src = handle.placement.worker
    cluster.set_bandwidth_cap(1e6)  # 1 MB/s: the ~6 MB of KV would take seconds, prefill far less
    try:
        client.transfer(handle, other(src))
    finally:
        cluster.set_bandwidth_cap(None)
    decision = last_decision(cluster, handle.id)
    assert decision.choice == "recompute"
    assert decision.predicted_recompute_s < decision.predicted_transfer_s
    assert client.resume(handle, SUFFIX, sampling=GREEDY).token_ids == dense_greedy(
        reference, context + SUFFIX, GREEDY.max_tokens
    )[0]
    client.release(handle)


def test_fork_children_spread_over_both_nodes(client, cluster, reference, corpus_tokens):
    context = corpus_tokens[600:700]
    parent = client.materialize(context)
    children = client.fork(parent, 4)
    results: dict[int, Result] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = client.resume(children[i], SUFFIX[: i + 2], sampling=SamplingParams(max_tokens=4))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    since = client.events().next
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    moved = [d for d in cluster.stats().cluster.decisions if d.handle in {c.id for c in children}]
    assert moved and all(d.reason == "balance" for d in moved)
    # The ingress merges both workers' events, each with its worker's rank.
    resumed = [e for e in client.events(since).events if e.kind == "request" and e.op == "resume"]
    assert sorted(e.handle_out for e in resumed) == sorted(r.handle.id for r in results.values())
    assert {e.worker for e in resumed} == {0, 1}
    for i in range(4):
        assert results[i].token_ids == dense_greedy(reference, context + SUFFIX[: i + 2], 4)[0]
    client.release([parent, *children, *(r.handle for r in results.values())])


def test_merge_of_handles_on_different_nodes_colocates_them_first(client, cluster, reference, corpus_tokens):
    context = corpus_tokens[1200:1260]
    base = client.materialize(context)
    longer = client.extend(base, SUFFIX)
    client.transfer(longer, other(base.placement.worker))  # the two parts now live apart
    merged = client.merge([base, longer])
    assert merged.exact and merged.handle.token_ids() == context + SUFFIX
    assert any(d.reason == "colocate" for d in cluster.stats().cluster.decisions if d.handle in {base.id, longer.id})
    out = client.resume(merged.handle, SUFFIX, sampling=GREEDY)
    assert out.token_ids == dense_greedy(reference, context + SUFFIX + SUFFIX, GREEDY.max_tokens)[0]
    client.release([base, longer, merged.handle, out.handle])


def test_hints_reach_every_worker(cluster):
    cluster.hints({"planner": 0, "critic": 3})
    for w in cluster.stats().cluster.workers:
        assert w.stats.cache.steps_to_execution == {"planner": 0.0, "critic": 3.0}
    cluster.hints({"planner": float("inf"), "critic": float("inf")})


def test_every_worker_keeps_tenants_prefix_caches_apart(client, cluster):
    from kvbaton.backend.tenants import AgentRef, TenantPartition

    prompt = cluster.tokenize("Cluster tenancy notes. " + document(80, seed=5))
    cluster.partition_tenants(TenantPartition(prefix_cache=True))  # what a server with several tokens does
    try:
        # The tenant travels to the worker with each request (an AgentRef in the actor call).
        first = cluster.complete(prompt, GREEDY, agent=AgentRef("ta"))
        again = cluster.complete(prompt, GREEDY, agent=AgentRef("ta", "reader"))  # routed by prefix: the same worker
        other_tenant = cluster.complete(prompt, GREEDY, agent=AgentRef("tb"))
    finally:
        cluster.partition_tenants(TenantPartition())
    assert again.timings.tokens_reused > 0 and other_tenant.timings.tokens_reused == 0
    assert first.token_ids == again.token_ids == other_tenant.token_ids
    client.release([r.handle for r in (first, again, other_tenant)])


def test_the_ingress_authenticates_and_keeps_tenants_apart(cluster):
    from fastapi.testclient import TestClient
    from kvbaton.backend.server import create_app
    from kvbaton.backend.tenants import TenantPartition

    try:
        app = create_app(cluster, token=["ray-tenant-a", "ray-tenant-b"])
        with TestClient(app) as http:
            a = {"Authorization": "Bearer ray-tenant-a"}
            b = {"Authorization": "Bearer ray-tenant-b"}
            assert http.post("/v1/kv/materialize", json={"context": "No token."}).status_code == 401
            made = http.post("/v1/kv/materialize", json={"context": "Tenant A's notes."}, headers=a)
            assert made.status_code == 200, made.text
            hid = made.json()["id"]
            for path, body in (("/v1/kv/resume", {"handle": hid, "suffix": " more", "max_tokens": 2}),
                               ("/v1/kv/transfer", {"handle": hid, "device": 0})):
                assert http.post(path, json=body, headers=b).status_code == 404  # not B's to see
            moved = http.post("/v1/kv/transfer", json={"handle": hid, "device": other(made.json()["placement"]["worker"])},
                              headers=a)
            assert moved.status_code == 200, moved.text
            assert http.post("/v1/kv/release", json={"handles": [hid]}, headers=a).status_code == 200
    finally:
        cluster.partition_tenants(TenantPartition())


def leftovers(cluster) -> tuple[int, int, int]:
    """Handles the workers' engines hold, blocks pinned by anything but the prefix caches, and
    requests in flight on the workers."""
    s = cluster.stats()
    workers = [w for w in s.cluster.workers if w.stats is not None]
    return (sum(w.stats.handles_live for w in workers), s.blocks_used - s.blocks_cache_only,
            sum(w.queue for w in workers))


def test_abandoned_streams_leave_nothing_on_the_workers(cluster, corpus_tokens):
    base = leftovers(cluster)
    handle = cluster.materialize(corpus_tokens[1200:1230])
    # Every chunk read, not the result: the worker has sent it, with the handle it made.
    done = cluster.complete_stream(corpus_tokens[1230:1260], SamplingParams(max_tokens=1, ignore_eos=True))
    assert next(done).token_ids
    done.close()
    # Closed before anything was read: the request runs on a worker all the same.
    cluster.resume_stream(handle, SUFFIX, SamplingParams(max_tokens=8, ignore_eos=True)).close()
    # Closed mid-generation.
    mid = cluster.resume_stream(handle, SUFFIX, SamplingParams(max_tokens=8, ignore_eos=True))
    next(mid)
    mid.close()
    cluster.release(handle)
    # The workers release in their own threads: wait for the state.
    until(lambda: leftovers(cluster) == base, "nothing left on the workers")


@pytest.fixture(scope="module")
def second(cluster):
    """Another ingress over the module's cluster, as a second ``kvbaton serve --attach`` runs one."""
    from kvbaton.backend.cluster import Cluster

    ingress = Cluster.attach(CLUSTER_NAME)
    yield ingress
    ingress.close()


def test_a_second_ingress_serves_the_same_handles_exactly(cluster, second, reference, corpus_tokens):
    assert second.config == cluster.config and second.loaded == cluster.loaded  # what the workers run
    context = corpus_tokens[1300:1380]
    handle = cluster.materialize(context)
    out = second.resume(handle.id, SUFFIX, GREEDY)  # made through one ingress, resumed through the other
    expected = dense_greedy(reference, context + SUFFIX, GREEDY.max_tokens)[0]
    assert out.token_ids == expected
    # A stream read by the second ingress from the worker; the handle it made is the cluster's.
    stream = second.resume_stream(handle, SUFFIX, GREEDY)
    assert [t for chunk in stream for t in chunk.token_ids] == expected
    made = stream.result.handle
    assert cluster.describe(made.id).token_ids() == context + SUFFIX + expected
    moved = second.transfer(handle, other(handle.placement.worker))
    assert cluster.describe(handle.id).placement.worker == moved.placement.worker
    second.release([handle, out.handle, made])
    with pytest.raises(HandleReleased):
        cluster.describe(handle.id)
    assert [w.queue for w in cluster.stats().cluster.workers] == [0, 0]  # every ticket ended


def test_two_ingresses_moving_and_resuming_one_handle_at_once_stay_exact(cluster, second, reference, corpus_tokens):
    from concurrent.futures import ThreadPoolExecutor

    context = corpus_tokens[1400:1460]
    handle = cluster.materialize(context)
    expected = dense_greedy(reference, context + SUFFIX, GREEDY.max_tokens)[0]
    with ThreadPoolExecutor(6) as pool:
        moves = [pool.submit(ingress.transfer, handle.id, rank, method="transfer")
                 for ingress, rank in ((second, 0), (cluster, 1), (second, 1), (cluster, 0))]
        resumes = [pool.submit(ingress.resume, handle.id, SUFFIX, GREEDY) for ingress in (cluster, second)]
        results = [f.result(timeout=WAIT_S) for f in resumes]
        assert all(f.result(timeout=WAIT_S).id == handle.id for f in moves)
    assert all(r.token_ids == expected for r in results)
    assert cluster.describe(handle.id).token_ids() == context  # one copy, on one worker, whole
    cluster.release([handle, *(r.handle for r in results)])


def test_a_server_attached_to_the_cluster_authorizes_tenants_as_the_one_that_made_the_handle(cluster, ray_nodes):
    from fastapi.testclient import TestClient
    from kvbaton.backend.server import create_app
    from kvbaton.backend.tenants import TenantPartition
    from server_fixtures import ServerProcess

    tokens = ["ray-tenant-a", "ray-tenant-b"]
    attached = ServerProcess(["--attach", CLUSTER_NAME, "--ray-address", ray_nodes.address,
                              *(f for t in tokens for f in ("--token", t))], token=tokens[0])
    try:
        attached.start()
        a = {"Authorization": "Bearer ray-tenant-a"}
        b = {"Authorization": "Bearer ray-tenant-b"}
        with TestClient(create_app(cluster, token=tokens)) as first, attached.http() as there:
            made = first.post("/v1/kv/materialize", json={"context": "Tenant A's notes."}, headers=a)
            assert made.status_code == 200, made.text
            hid = made.json()["id"]
            resume = {"handle": hid, "suffix": " more", "max_tokens": 2}
            assert there.post("/v1/kv/resume", json=resume, headers=b).status_code == 404  # not B's to see
            with attached.http(token="") as anonymous:
                assert anonymous.post("/v1/kv/materialize", json={"context": "x"}).status_code == 401
            answer = there.post("/v1/kv/resume", json=resume, headers=a)
            assert answer.status_code == 200, answer.text
            child = answer.json()["handle"]["id"]  # made through the attached server: A's on the first too
            assert first.post("/v1/kv/resume", json={**resume, "handle": child}, headers=b).status_code == 404
            again = first.post("/v1/kv/resume", json={**resume, "handle": child}, headers=a)
            assert again.status_code == 200, again.text
            ids = [hid, child, again.json()["handle"]["id"]]
            assert there.post("/v1/kv/release", json={"handles": ids}, headers=a).status_code == 200
            assert first.post("/v1/kv/resume", json=resume, headers=a).status_code == 410  # released, elsewhere
    finally:
        attached.stop()
        cluster.partition_tenants(TenantPartition())
    assert cluster.healthy()[0]  # a server that attached leaves the cluster running when it stops


def test_killed_worker_stream_finishes_elsewhere_then_the_worker_rejoins(client, cluster, reference, corpus_tokens):
    victim = 1
    context = corpus_tokens[900:1000]
    orphan = client.transfer(client.materialize(context), victim)  # lives only on the victim
    kept = client.transfer(client.materialize(corpus_tokens[1000:1060]), victim)  # its journal keeps it
    busy = client.transfer(client.materialize(corpus_tokens[1100:1150]), victim)
    old_pid = cluster.workers[victim].pid
    stream = client.resume_stream(busy, SUFFIX, max_tokens=16)
    first = next(stream)
    cluster.kill_worker(victim)
    tokens = list(first.token_ids) + [t for chunk in stream for t in chunk.token_ids]
    assert tokens == dense_greedy(reference, corpus_tokens[1100:1150] + SUFFIX, 16)[0]
    assert stream.result.handle.placement.worker == 0
    # The stream's handle was recomputed from its lineage on the other worker, at once.
    decision = last_decision(cluster, busy.id)
    assert (decision.src, decision.dst, decision.reason, decision.choice) == (None, 0, "lost", "recompute")
    assert client.stats().cluster.retries >= 1

    # Another handle of the dead worker: recomputed on the other one if used while its worker is down,
    # else served by the restarted worker from its journal (whichever comes first); exact either way.
    result = client.resume(orphan, SUFFIX, sampling=GREEDY)
    assert result.token_ids == dense_greedy(reference, context + SUFFIX, GREEDY.max_tokens)[0]

    # Ray restarts the actor; it rejoins with the handle its journal kept, and serves again.
    until(lambda: cluster.stats().cluster.workers[victim].alive, "the restarted worker rejoined")
    assert cluster.stats().cluster.workers[victim].pid != old_pid and cluster.healthy() == (True, "ok")
    assert cluster.describe(kept.id).placement.worker == victim
    out = client.resume(kept, SUFFIX, sampling=GREEDY)
    assert out.handle.placement.worker == victim
    assert out.token_ids == dense_greedy(reference, corpus_tokens[1000:1060] + SUFFIX, GREEDY.max_tokens)[0]
    # It left the gloo group (which takes no new member): moves to it go through the object store.
    assert cluster.stats().cluster.workers[victim].collective is False
    if result.handle.placement.worker == victim:
        cluster.transfer(result.handle, 0, method="transfer")
    back = cluster.transfer(result.handle, victim, method="transfer")
    assert back.placement.worker == victim and last_decision(cluster, back.id).choice == "transfer"
    again = client.resume(back, SUFFIX, sampling=GREEDY)
    full = context + SUFFIX + result.token_ids + SUFFIX
    assert again.token_ids == dense_greedy(reference, full, GREEDY.max_tokens)[0]
