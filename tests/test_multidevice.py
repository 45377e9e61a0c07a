"""Multi-device backend: two CPU workers (real processes, real model, gloo) behind one coordinator.

Specification:
- a handle materialized on one worker and resumed on the other after a KV transfer gives exactly
  the tokens of dense prefill under greedy decoding; so does one recomputed from lineage;
- the cost model transfers when the link is fast and recomputes when it is throttled, and every
  decision is reported with predicted and measured times;
- fork children are spread over idle workers when requests pile up on one;
- a stream the consumer abandons (before its first chunk, mid-generation, or after its last chunk
  with the result already sent) leaves nothing on the workers: no handle, no pinned block, no
  request in flight (issue 20's soak);
- a worker killed mid-stream: the stream finishes on the other worker with the same tokens, and
  handles that lived only on the dead worker are recomputed from lineage on next use;
- multi-node: ``kvbaton serve --rank 0/1 --world-size 2`` on loopback rendezvous through
  MASTER_ADDR/MASTER_PORT; the HTTP ``transfer`` endpoint moves a handle between them, and the
  server keeps answering after the rank-1 process is killed.

The order of the tests matters: the worker-kill test runs last on the shared cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import kvbaton
import pytest
from conftest import dense_greedy
from kvbaton.backend.cluster import Cluster
from kvbaton.bench.corpus import document
from kvbaton.embedded import EmbeddedClient
from kvbaton.errors import HandleReleased, InvalidRequest
from kvbaton.handle import Op
from kvbaton.types import Result, SamplingParams
from server_fixtures import ServerProcess, dies_with_parent, free_port

GREEDY = SamplingParams(max_tokens=10)
SUFFIX = [28, 1217, 314, 253, 3037, 47]  # a handful of ordinary token ids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two workers + the test process share a couple of cores
        c = Cluster(["cpu", "cpu"], engine_options={"kv_budget": "192MiB"},
                    calibration_cache=tmp_path_factory.mktemp("cal") / "calibration.json")
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(cluster):
    return EmbeddedClient(engine=cluster)


def last_decision(cluster, handle_id: str):
    return [d for d in cluster.stats().cluster.decisions if d.handle == handle_id][-1]


def other(rank: int) -> int:
    return 1 - rank


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


def test_cluster_reports_two_calibrated_workers(client):
    stats = client.stats()
    assert stats.device == "cpu,cpu"
    assert [w.rank for w in stats.cluster.workers] == [0, 1]
    assert all(w.alive and w.stats is not None for w in stats.cluster.workers)
    assert stats.cluster.bandwidth_bytes_per_s > 0 and stats.cluster.latency_s > 0
    assert all(w.prefill_tokens_per_s > 0 for w in stats.cluster.workers)


def test_handle_transferred_to_the_other_worker_resumes_exactly(client, cluster, reference, corpus_tokens):
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
    assert back.predicted_recompute_s < cluster.costs.predict_recompute(src, len(context))
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


def test_cost_model_recomputes_when_bandwidth_is_throttled(client, cluster, reference, corpus_tokens):
    context = corpus_tokens[300:430]
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
    # Unthrottled again, the same kind of move is a transfer.
    fresh = client.materialize(corpus_tokens[450:580])
    client.transfer(fresh, other(fresh.placement.worker))
    assert last_decision(cluster, fresh.id).choice == "transfer"
    client.release([handle, fresh])


def test_fork_children_spread_over_idle_workers(client, cluster, reference, corpus_tokens):
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
    # The coordinator merges both workers' events, each with its worker's rank.
    resumed = [e for e in client.events(since).events if e.kind == "request" and e.op == "resume"]
    assert sorted(e.handle_out for e in resumed) == sorted(r.handle.id for r in results.values())
    assert {e.worker for e in resumed} == {0, 1}
    for i in range(4):
        assert results[i].token_ids == dense_greedy(reference, context + SUFFIX[: i + 2], 4)[0]
    client.release([parent, *children, *(r.handle for r in results.values())])


def test_merge_of_handles_on_different_workers_colocates_them_first(client, cluster, reference, corpus_tokens):
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


def test_every_worker_keeps_tenants_prefix_caches_apart(client, cluster):
    from kvbaton.backend.tenants import AgentRef, TenantPartition

    prompt = cluster.tokenize("Cluster tenancy notes. " + document(80, seed=5))
    cluster.partition_tenants(TenantPartition(prefix_cache=True))  # what a server with several tokens does
    try:
        # The tenant travels to the worker with each request (an AgentRef over the control connection).
        first = cluster.complete(prompt, GREEDY, agent=AgentRef("ta"))
        again = cluster.complete(prompt, GREEDY, agent=AgentRef("ta", "reader"))  # routed by prefix: the same worker
        other = cluster.complete(prompt, GREEDY, agent=AgentRef("tb"))
    finally:
        cluster.partition_tenants(TenantPartition())
    assert again.timings.tokens_reused > 0 and other.timings.tokens_reused == 0
    assert first.token_ids == again.token_ids == other.token_ids
    client.release([r.handle for r in (first, again, other)])


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
    deadline = time.monotonic() + 120  # the workers release in their own threads: wait for the state
    while leftovers(cluster) != base and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(cluster) == base


def test_killed_worker_streams_finish_elsewhere_and_its_handles_are_recomputed(
    client, cluster, reference, corpus_tokens
):
    victim = 1
    context = corpus_tokens[900:1000]
    orphan = client.transfer(client.materialize(context), victim)  # lives only on the victim
    busy = client.transfer(client.materialize(corpus_tokens[1100:1150]), victim)
    stream = client.resume_stream(busy, SUFFIX, max_tokens=16)
    first = next(stream)
    cluster.kill_worker(victim)
    tokens = list(first.token_ids) + [t for chunk in stream for t in chunk.token_ids]
    assert tokens == dense_greedy(reference, corpus_tokens[1100:1150] + SUFFIX, 16)[0]
    assert stream.result.handle.placement.worker == 0

    result = client.resume(orphan, SUFFIX, sampling=GREEDY)
    assert result.token_ids == dense_greedy(reference, context + SUFFIX, GREEDY.max_tokens)[0]
    decision = last_decision(cluster, orphan.id)
    assert (decision.src, decision.dst, decision.reason, decision.choice) == (None, 0, "lost", "recompute")
    stats = client.stats()
    assert not stats.cluster.workers[victim].alive and stats.cluster.retries >= 1
    assert client.complete("One more request after the crash:", max_tokens=3).finish_reason == "length"


def test_two_process_rendezvous_on_loopback_serves_transfers_and_survives_a_kill(reference, corpus_tokens):
    master_port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "OMP_NUM_THREADS": "1",
           "KVBATON_CONTROL_PORT": str(free_port())}
    env.pop("KVBATON_TOKEN", None)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("MASTER_ADDR", "MASTER_PORT", "KVBATON_CONTROL_PORT", "OMP_NUM_THREADS"):
            mp.setenv(key, env[key])
        rank0 = ServerProcess(["--rank", "0", "--world-size", "2", "--device", "cpu", "--kv-budget", "128MiB"])
        rank0.start(wait=False)
    rank1 = subprocess.Popen(
        dies_with_parent([sys.executable, "-m", "kvbaton.cli", "serve", "--rank", "1", "--world-size", "2",
                          "--device", "cpu", "--kv-budget", "128MiB", "--log-level", "warning"]),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    try:
        rank0.wait_healthy()
        with kvbaton.connect(rank0.url, timeout=300) as remote:
            stats = remote.stats()
            assert [w.rank for w in stats.cluster.workers] == [0, 1]
            assert stats.cluster.workers[1].pid == rank1.pid
            context = corpus_tokens[:120]
            handle = remote.materialize(context)
            moved = remote.transfer(handle, 1 - handle.placement.worker)
            assert moved.placement.worker == 1 - handle.placement.worker
            expected = dense_greedy(reference, context + SUFFIX, 8)[0]
            assert remote.resume(moved, SUFFIX, max_tokens=8).token_ids == expected
            on_rank1 = moved if moved.placement.worker == 1 else remote.transfer(moved, 1)
            rank1.kill()
            rank1.wait(10)
            assert remote.resume(on_rank1, SUFFIX, max_tokens=8).token_ids == expected
            assert not remote.stats().cluster.workers[1].alive
    finally:
        if rank1.poll() is None:
            rank1.kill()
        rank0.stop()
        rank0.log.unlink(missing_ok=True)
