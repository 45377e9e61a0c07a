"""Persistence across restarts (issue 20), against real ``kvbaton serve --persist`` processes.

Specification:
- with ``--persist`` and a disk tier, a tenant's live handles survive a clean restart (SIGTERM) and a
  crash (SIGKILL): the restarted server resumes the same handle ids with greedy output identical to
  the output before the restart (K/V loaded from saved blocks, or recomputed from the lineage);
- a saved block that is corrupted is recomputed, never used: the output is still identical;
- tenants keep apart across restarts: another tenant gets 404 for the restored handles;
- released handles do not come back; an OpenAI agent's retained handle is retained again (its next
  request replaces it rather than leaving it orphaned);
- no file outlives a restart beyond what the live handles need: after every handle is released and
  a clean exit, no block is left, and the tier's own block files are gone;
- persistence is refused without a disk tier, and on a multi-device server;
- a full volume is never a permanent outage (a real 12 MiB tmpfs shared by the tier and the state):
  while the tier fills it, the journal's reserve keeps every request that makes a handle working;
  while another writer fills it, ``/health`` is 503 ``degraded`` naming the journal and only the
  requests that make handles fail, until space is back, then all is served again by itself; a
  restart on a nearly full volume serves the same handles with the same answers;
- a journal compacted while running (the churn of forks made and released) brings back exactly the
  live handles after a crash, each line's lineage by reference to its parent;
- the journal (unit): slots and releases replay; a torn last line (a kill mid-write) is ignored; a
  journal of another model, dtype or block size is dropped whole; the salt file is private (0600)
  and stable;
- the journal's lineage is by reference: a line holds its own steps after its journaled parent's,
  a restart rebuilds the whole lineage from the chain, and a handle whose parent's line is missing
  is dropped with a warning, never served with a wrong lineage;
- the journal stays bounded while running: it is compacted once its dead lines outnumber its live
  handles (what comes back after a crash is exactly the live handles), and each owner keeps at most
  its bound of journaled handles and bytes (the oldest are released from the journal);
- a record is acknowledged only once it is durable, and records queued meanwhile share one
  ``fsync``; a journal that cannot write fails the records that need it, says why (``failure``
  names it), keeps releases, has the tier give space back on ENOSPC, and recovers by itself.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import kvbaton
import pytest
from kvbaton.backend.cache.journal import COMPACT_MIN_DEAD, RETRY_S, Journal
from kvbaton.backend.cache.persist import Persistence
from kvbaton.bench.soak_harness import fill_volume, small_volume
from kvbaton.errors import HandleNotFound
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions
from server_fixtures import TOKEN_A, TOKEN_B, ServerProcess

WAIT_S = 180.0  # how long a request or a recovery may take on a loaded 2-core machine; never a measured bound

PROMPT = ("The harbour master kept a ledger of every ship that entered the bay, noting its cargo, its crew and the "
          "weather on the day it arrived. ") * 2
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
GREEDY = {"max_tokens": 6, "temperature": 0.0}


def persistent_server(tier: Path, port: int | None = None) -> ServerProcess:
    args = ["--persist", "--tier", f"disk:64 blocks:{tier}", "--kv-budget", "48 blocks", "--max-tokens", "16",
            "--token", TOKEN_A, "--token", TOKEN_B]
    return ServerProcess(args, token=TOKEN_A, port=port)


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("persist") / "tier"


@pytest.fixture(scope="module")
def restarts(tier: Path) -> Iterator[list[ServerProcess]]:
    """The server of this module, restarted by the tests on the same port and tier (all stopped at the end)."""
    procs = [persistent_server(tier).start()]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()
        for proc in procs:
            proc.log.unlink(missing_ok=True)


def restart(procs: list[ServerProcess], tier: Path) -> ServerProcess:
    old = procs[-1]
    old.stop()  # SIGTERM: a clean exit (a no-op once killed)
    new = persistent_server(tier, port=old.port).start()
    procs.append(new)
    return new


def outputs(url: str, handles: dict[str, str]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy continuations of each handle, in order, and the prompt tokens each reused (results released:
    only the originals stay live)."""
    out, reused = {}, {}
    with kvbaton.connect(url, token=TOKEN_A, timeout=WAIT_S) as a:
        for name, hid in handles.items():
            result = a.resume(hid, " Then", **GREEDY)
            out[name], reused[name] = result.token_ids, result.timings.tokens_reused
            a.release(result.handle)
    return out, reused


def chat_as_writer(server: ServerProcess) -> None:
    with server.http(TOKEN_A) as http:
        answer = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                           headers={"X-Kvbaton-Agent": "writer"})
        assert answer.status_code == 200, answer.text


def test_handles_survive_restarts_crashes_and_corruption(restarts: list[ServerProcess], tier: Path) -> None:
    server = restarts[-1]
    with kvbaton.connect(server.url, token=TOKEN_A) as a, kvbaton.connect(server.url, token=TOKEN_B) as b:
        doc = a.materialize(PROMPT, agent="reader")
        chat = a.generate(MESSAGES, max_tokens=4, temperature=0.0).handle
        gone = a.materialize(PROMPT + " A released note.")
        a.release(gone)
        theirs = b.materialize(PROMPT)
    chat_as_writer(server)  # the agent's OpenAI slot retains its result handle
    handles = {"doc": doc.id, "chat": chat.id}
    before, _ = outputs(server.url, handles)

    # A clean restart: blocks were saved for the live handles; the same ids resume identically from them.
    server = restart(restarts, tier)
    assert list((tier / "state" / "blocks").glob("*.safetensors")), "a clean exit saves the live handles' blocks"
    after, reused = outputs(server.url, handles)
    assert after == before
    assert reused["doc"] >= 32, "the saved blocks were loaded, not recomputed"
    with kvbaton.connect(server.url, token=TOKEN_A) as a, kvbaton.connect(server.url, token=TOKEN_B) as b:
        with pytest.raises(HandleNotFound):
            b.resume(doc.id, " Then", **GREEDY)  # another tenant's, even after a restart
        with pytest.raises(HandleNotFound):
            a.resume(theirs.id, " Then", **GREEDY)
        with pytest.raises(HandleNotFound):
            a.resume(gone.id, " Then", **GREEDY)  # released before the restart: stays released
        b.release(b.resume(theirs.id, " Then", **GREEDY).handle)  # the other tenant's own handle is back
        late = a.extend(doc.id, " The ledger was lost in a storm.")  # made after the last clean exit
    handles["late"] = late.id
    before["late"] = outputs(server.url, {"late": late.id})[0]["late"]

    # A crash (the journal is durable) with every saved block corrupted meanwhile: all is recomputed
    # from the lineages, never read as K/V, and the output is still identical.
    restarts[-1].kill()
    blocks = list((tier / "state" / "blocks").glob("*.safetensors"))
    assert blocks
    for block in blocks:
        data = bytearray(block.read_bytes())
        data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
        block.write_bytes(bytes(data))
    server = restart(restarts, tier)
    after, reused = outputs(server.url, handles)
    assert after == before
    assert reused["doc"] == 0, "corrupted blocks are not used"
    chat_as_writer(server)  # the slot still retains the old handle: it is replaced (and released), not orphaned

    # Released everywhere and a clean exit: no block is left, the journal holds its header only.
    with server.http(TOKEN_A) as a, server.http(TOKEN_B) as b:
        assert a.post("/v1/kv/release_all").json()["released"] == 4  # doc, chat, late, the writer's slot
        assert b.post("/v1/kv/release_all").json()["released"] == 1
    restarts[-1].stop()
    assert not list((tier / "state" / "blocks").iterdir())
    assert not list(tier.glob("*.safetensors")), "the tier's own blocks are removed at exit"
    assert len((tier / "state" / "handles.jsonl").read_bytes().splitlines()) == 1, "released handles do not come back"


def test_the_journal_stays_bounded_while_running_and_a_crash_brings_back_the_live_handles(
        restarts: list[ServerProcess], tier: Path) -> None:
    server = restart(restarts, tier)
    journal = tier / "state" / "handles.jsonl"
    sizes = []
    with kvbaton.connect(server.url, token=TOKEN_A) as a:
        doc = a.materialize(PROMPT)
        turn = a.extend(doc.id, " The ledger was lost in a storm.")
        for _ in range(6):  # the churn: fork k=100 of a live handle, release them all, again and again
            forks = a.fork(turn.id, k=100)
            sizes.append(journal.stat().st_size)
            a.release(forks)
    assert max(sizes[3:]) <= max(sizes[:3]) + 1024, f"the journal does not grow with the churn: {sizes}"
    lines = {r["add"]["id"]: r for r in _records(journal)[1:] if "add" in r}
    assert lines[turn.id]["base"] == doc.id, "the extend's line names its parent, not its whole lineage"
    handles = {"doc": doc.id, "turn": turn.id}
    before, _ = outputs(server.url, handles)

    restarts[-1].kill()  # no clean exit: what was compacted while running is what comes back
    server = restart(restarts, tier)
    after, _ = outputs(server.url, handles)
    assert after == before
    with server.http(TOKEN_A) as http:
        assert http.post("/v1/kv/release_all").json()["released"] == 2, "exactly the live handles came back"


def volume_server(tier: Path, port: int | None = None) -> ServerProcess:
    """A persistent server whose disk tier's budget (256 blocks, 180 MiB) is far beyond its volume."""
    args = ["--persist", "--tier", f"disk:256 blocks:{tier}", "--kv-budget", "48 blocks", "--max-tokens", "16",
            "--token", TOKEN_A, "--token", TOKEN_B]
    return ServerProcess(args, token=TOKEN_A, port=port)


def test_a_full_volume_is_never_a_permanent_outage() -> None:
    with small_volume(12) as (volume, why):  # the 12 MB volume
        if why is not None:
            pytest.skip(f"needs a small tmpfs: {why}")
        tier = volume / "tier"
        server = volume_server(tier).start()
        try:
            with server.http(TOKEN_A, timeout=WAIT_S) as http:
                # 1. The tier fills the volume: the journal's reserve keeps every request that makes a handle working.
                statuses, kept = [], []
                for i in range(60):
                    made = http.post("/v1/kv/materialize", json={"context": f"Note {i}. {PROMPT}"})
                    statuses.append(made.status_code)
                    if made.status_code == 200:
                        (kept if i % 20 == 0 else []).append(made.json()["id"])
                        if i % 20:
                            http.post("/v1/kv/release", json={"handles": [made.json()["id"]]})
                assert statuses == [200] * 60
                stats = http.get("/v1/kv/stats").json()
                assert stats["cache"]["nodes_per_tier"]["disk"] > 0 and http.get("/health").status_code == 200

                # 2. Another writer fills the volume (and fills it again when the tier gives its blocks back):
                # degraded, only the requests that make handles fail, until space is back.
                for _ in range(30):
                    fill_volume(volume)
                    made = http.post("/v1/kv/materialize", json={"context": PROMPT})
                    if made.status_code != 200:
                        break
                    http.post("/v1/kv/release", json={"handles": [made.json()["id"]]})
                assert made.status_code == 503 and made.json()["error"]["code"] == "server_unavailable"
                assert "handles.jsonl cannot be written" in made.json()["error"]["message"], made.text
                health = http.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "degraded"
                assert str(tier / "state" / "handles.jsonl") in health.json()["reason"]
                answer = http.post("/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 2})
                assert answer.status_code == 200, "a request that keeps no handle is served meanwhile"
                (volume / "kvbaton-filler").unlink()
                deadline = time.monotonic() + WAIT_S  # back by itself, no request, no restart (however slowly)
                while http.get("/health").status_code != 200:
                    assert time.monotonic() < deadline, f"/health never came back within {WAIT_S} s of space freed"
                    time.sleep(0.1)
                made = http.post("/v1/kv/materialize", json={"context": PROMPT})
                assert made.status_code == 200
                kept.append(made.json()["id"])

            # 3. A clean exit, then the volume fills up all but 1 MiB: the restart serves the same handles.
            handles = {f"h{i}": hid for i, hid in enumerate(kept)}
            before, _ = outputs(server.url, handles)
            server.stop()
            filler = fill_volume(volume)
            os.truncate(filler, max(filler.stat().st_size - 2**20, 0))
            server = volume_server(tier, port=server.port).start()
            after, _ = outputs(server.url, handles)
            assert after == before
            assert server.http(TOKEN_A).get("/health").status_code == 200
        finally:
            server.stop()
            server.log.unlink(missing_ok=True)


# -- the journal on its own ----------------------------------------------------------------------
HEADER = {"version": 1, "model_fingerprint": "m", "dtype": "torch.float32", "block_size": 16}


def _id(name: str) -> str:
    """A handle id that starts with ``name`` where it is hex (readable in assertions), else encodes it."""
    return (name if all(c in "0123456789abcdef" for c in name) else name.encode().hex()).ljust(32, "0")


def _handle(hid: str, tokens: list[int]) -> Handle:
    return Handle(id=_id(hid), model="m", model_fingerprint="m", tokenizer_fingerprint="t",
                  num_tokens=len(tokens), positions=Positions(rope_type="default", rope_theta=10000.0),
                  lineage=(LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)),),
                  placement=Placement(device="cpu"))


def _child(hid: str, parent: Handle, tokens: list[int], op: Op = Op.EXTEND) -> Handle:
    """A handle made from ``parent`` (its lineage, then one step of ``tokens``)."""
    step = LineageStep(op=op, parent=parent.id, token_ids=tuple(tokens))
    return parent.model_copy(update={"id": _id(hid), "num_tokens": parent.num_tokens + len(tokens),
                                     "lineage": parent.lineage + (step,)})


def _crash(journal: Journal) -> None:
    """What a kill leaves: the file as written, no close, no compaction."""
    journal.sync()
    journal._fd and os.close(journal._fd)
    journal._fd = None


def _records(path: Path) -> list[dict]:
    return [json.loads(line.split(b" ", 1)[1]) for line in path.read_bytes().splitlines()]


def _in_writer(fault):
    """``fault`` in the journal's writer thread only (the test's own thread writes as usual)."""
    def hooked(real):
        def call(*args):
            if threading.current_thread().name == "kvbaton-journal":
                return fault(real, *args)
            return real(*args)
        return call
    return hooked


def _full_disk(monkeypatch) -> None:
    """What a nearly full disk does: the next write takes part of its data and says so only by the count;
    the write after it fails with ENOSPC."""
    real_write, calls = os.write, []

    def write(fd: int, data: bytes) -> int:
        calls.append(fd)
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvbaton.backend.cache.journal.os.write", write)


@pytest.mark.unit
def test_a_full_disk_never_tears_the_journal_nor_cuts_it_when_rewritten(tmp_path: Path, monkeypatch) -> None:
    journal = Journal(tmp_path / "j", HEADER)
    journal.add("t-a", [_handle("a1", [1, 2, 3])])
    with monkeypatch.context() as m:
        _full_disk(m)
        with pytest.raises(OSError):
            journal.add("t-a", [_handle("a2", [4])])  # the caller is told: never "durable" when it is not
    journal.add("t-a", [_handle("a3", [5])])  # space again: the next record is whole, not glued to a torn one
    with monkeypatch.context() as m:
        _full_disk(m)
        journal.close()  # the rewrite at exit fails: it must not replace the journal by a cut-off copy
    again = Journal(tmp_path / "j", HEADER)
    assert sorted(e.handle.id[:2] for e in again.live()) == ["a1", "a3"]
    again.close()


@pytest.mark.unit
def test_journal_keeps_whole_lines_drops_a_torn_tail_and_other_models(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", HEADER)
    journal.add("t-a", [_handle("a1", [1, 2, 3]), _handle("a2", [4])])
    journal.release([_handle("a2", [4]).id])
    journal.retain(_handle("a1", [1, 2, 3]).id, "writer", session="thread-1")
    journal.add("t-a", [_handle("a3", [5])])
    journal._fd and os.close(journal._fd)  # a kill: no close, no rewrite
    with (tmp_path / "j").open("ab") as f:
        f.write(b"0badc0de {\"add\": {\"id\"")  # a torn append
    again = Journal(tmp_path / "j", HEADER)
    assert sorted(e.handle.id[:2] for e in again.live()) == ["a1", "a3"]
    assert {e.owner for e in again.live()} == {"t-a"}
    assert {e.handle.id[:2]: e.slot for e in again.live()} == {"a1": "writer", "a3": None}
    assert {e.handle.id[:2]: e.session for e in again.live()} == {"a1": "thread-1", "a3": ""}
    again.close()
    other = Journal(tmp_path / "j", {**HEADER, "model_fingerprint": "other"})
    assert other.live() == [] and other.dropped == 2
    other.close()


@pytest.mark.unit
def test_persistence_needs_a_disk_tier_and_kvbatons_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvbaton import cli
    from kvbaton.backend import Engine
    from kvbaton.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="disk tier"):
        Engine(persist=True)  # refused before the model loads
    # (a multi-device server persists per worker since the Ray backend: tests/test_multidevice*.py)
    assert cli.main(["serve", "--persist", "--engine", "sglang", "--tier", f"disk:1MiB:{tmp_path}"]) == 2
    assert "needs kvbaton's own engine" in capsys.readouterr().err


@pytest.mark.unit
def test_salt_is_private_and_stable(tmp_path: Path) -> None:
    first = Persistence(tmp_path / "s", fingerprint="m", dtype="f", block_size=16)
    first.close()
    assert stat.S_IMODE((tmp_path / "s" / "salt").stat().st_mode) == 0o600
    second = Persistence(tmp_path / "s", fingerprint="m", dtype="f", block_size=16)
    second.close()
    assert first.salt == second.salt and len(first.salt) == 32


@pytest.mark.unit
def test_lineage_is_journaled_by_reference_and_rebuilt_from_the_chain(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", HEADER)
    root = _handle("r1", list(range(1000)))
    turn = _child("c1", root, [7, 8])
    turn2 = _child("c2", turn, [9])
    for handle in (root, turn, turn2):
        journal.add("t-a", [handle])
    last = _records(tmp_path / "j")[-1]
    assert last["base"] == turn.id  # its parent's lineage by reference...
    assert [step["token_ids"] for step in last["add"]["lineage"]] == [[9]]  # ...and its own step only
    journal.release([turn.id])  # a parent released: its child keeps its whole lineage
    _crash(journal)
    again = Journal(tmp_path / "j", HEADER)
    assert {e.handle.id: e.handle for e in again.live()} == {root.id: root, turn2.id: turn2}
    again.close()  # compacted: turn2 now builds on root, the nearest live ancestor
    assert [r.get("base") for r in _records(tmp_path / "j")[1:]] == [None, root.id]
    third = Journal(tmp_path / "j", HEADER)
    assert {e.handle.id: e.handle for e in third.live()} == {root.id: root, turn2.id: turn2}
    third.close()


@pytest.mark.unit
def test_a_handle_whose_parents_line_is_missing_is_dropped_with_a_warning(tmp_path: Path, caplog) -> None:
    journal = Journal(tmp_path / "j", HEADER)
    root, other = _handle("r1", [1, 2, 3]), _handle("o1", [4])
    child = _child("c1", root, [5])
    grandchild = _child("g1", child, [6])
    for handle in (root, child, grandchild, other):
        journal.add("t-a", [handle])
    _crash(journal)
    lines = (tmp_path / "j").read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:40] + bytes([lines[1][40] ^ 1]) + lines[1][41:]  # the root's line fails its checksum
    (tmp_path / "j").write_bytes(b"".join(lines))
    with caplog.at_level(logging.WARNING, logger="kvbaton.backend.cache.journal_format"):
        again = Journal(tmp_path / "j", HEADER)
    assert [e.handle.id for e in again.live()] == [other.id]
    assert again.orphans == 2 and f"is built on handle {root.id}" in caplog.text
    again.close()


@pytest.mark.unit
def test_the_journal_is_compacted_while_running_and_stays_bounded(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", HEADER)
    keep = _handle("k1", list(range(2000)))
    journal.add("t-a", [keep])
    sizes = []
    for round_ in range(8):  # the churn: fork k=200 of a long handle, release them all, again and again
        forks = [_child(f"f{round_}x{i}", keep, [], op=Op.FORK) for i in range(200)]
        journal.add("t-a", forks)
        journal.release([f.id for f in forks])
        sizes.append((tmp_path / "j").stat().st_size)
    assert journal.compactions >= 3
    assert max(sizes[4:]) <= max(sizes[:4]), "the journal does not grow with the churn"
    assert max(sizes) < 200 * 2000, "a fork's line holds no copy of its parent's 2000 tokens (about 10 KB)"
    _crash(journal)
    again = Journal(tmp_path / "j", HEADER)
    assert [e.handle for e in again.live()] == [keep]  # exactly the live handles come back
    again.close()
    assert COMPACT_MIN_DEAD <= 1000


@pytest.mark.unit
def test_each_owner_keeps_at_most_its_bound_of_journaled_handles(tmp_path: Path, caplog) -> None:
    journal = Journal(tmp_path / "j", HEADER, max_handles_per_owner=3, max_bytes_per_owner=20_000)
    mine = [_handle(f"a{i}", [i]) for i in range(5)]
    theirs = [_handle(f"b{i}", [i]) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="kvbaton.backend.cache.journal"):
        for handle in mine:
            journal.add("t-a", [handle])
        journal.add("t-b", theirs)
    assert [e.handle for e in journal.live()] == mine[2:] + theirs  # the oldest of t-a went, t-b is untouched
    assert journal.forgotten == 2 and "no longer journaled" in caplog.text
    big = [_handle(f"c{i}", list(range(1500))) for i in range(3)]  # each line about 8 KB
    for handle in big:
        journal.add("t-c", [handle])
    assert [e.handle for e in journal.live() if e.owner == "t-c"] == big[1:]  # over 20 KB: the oldest went
    _crash(journal)
    again = Journal(tmp_path / "j", HEADER)
    assert [e.handle for e in again.live()] == mine[2:] + theirs + big[1:]
    again.close()


@pytest.mark.unit
def test_a_record_is_acknowledged_once_durable_and_records_waiting_share_one_fsync(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    journal = Journal(tmp_path / "j", HEADER)
    syncing, go, fsyncs = threading.Event(), threading.Event(), []

    def slow_fsync(real, fd):
        fsyncs.append(fd)
        syncing.set()
        assert go.wait(60)
        return real(fd)

    monkeypatch.setattr(os, "fsync", _in_writer(slow_fsync)(os.fsync))
    first = journal.submit_add("t-a", [_handle("h0", [0])])
    assert syncing.wait(60)
    waiting = [journal.submit_add("t-a", [_handle(f"h{i}", [i])]) for i in range(1, 21)]
    assert not first.done() and not any(w.done() for w in waiting), "nothing is acknowledged before its fsync"
    go.set()
    for done in (first, *waiting):
        journal.wait(done)
    assert len(fsyncs) == 2, "the 20 records that waited were written by one group commit"
    monkeypatch.undo()
    _crash(journal)
    again = Journal(tmp_path / "j", HEADER)
    assert len(again.live()) == 21
    again.close()


@pytest.mark.unit
def test_a_journal_that_cannot_write_fails_its_records_gives_space_back_and_recovers(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    freed: list[int] = []
    full = threading.Event()

    def no_space(real, fd, data):
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    def reclaim(nbytes: int) -> int:  # the disk tier gives its blocks back: space again
        freed.append(nbytes)
        full.clear()
        return nbytes

    journal = Journal(tmp_path / "j", HEADER, reclaim=reclaim)
    monkeypatch.setattr(os, "write", _in_writer(no_space)(os.write))
    full.set()
    journal.add("t-a", [_handle("a1", [1])])  # ENOSPC, the tier gave space back, the retry made it
    assert freed and journal.failure is None

    journal = Journal(tmp_path / "k", HEADER)  # nothing to give back: the journal cannot write
    journal.add("t-a", [_handle("a1", [1])])
    full.set()
    with pytest.raises(OSError) as failed:
        journal.add("t-a", [_handle("a2", [2])])
    assert str(tmp_path / "k") in journal.failure and "No space left" in journal.failure
    assert failed.value.strerror == journal.failure
    journal.release([_handle("a1", [1]).id])  # a release stands (logged); its line is owed
    assert journal.live() == []
    full.clear()  # space is back: the idle writer writes what it owes and recovers by itself
    for _ in range(600):
        if journal.failure is None:
            break
        threading.Event().wait(0.1)
    assert journal.failure is None
    _crash(journal)
    again = Journal(tmp_path / "k", HEADER)
    assert again.live() == [], "the release made while the journal could not write was written after"
    again.close()
    assert RETRY_S < 60
