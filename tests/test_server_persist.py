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
- the journal (unit): slots and releases replay; a torn last line (a kill mid-write) is ignored; a
  journal of another model, dtype or block size is dropped whole; the salt file is private (0600)
  and stable.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import kvbaton
import pytest
from kvbaton.backend.persist import Journal, Persistence
from kvbaton.errors import HandleNotFound
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions
from server_fixtures import TOKEN_A, TOKEN_B, ServerProcess

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
    with kvbaton.connect(url, token=TOKEN_A) as a:
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


# -- the journal on its own ----------------------------------------------------------------------
HEADER = {"version": 1, "model_fingerprint": "m", "dtype": "torch.float32", "block_size": 16}


def _handle(hid: str, tokens: list[int]) -> Handle:
    return Handle(id=hid.ljust(32, "0"), model="m", model_fingerprint="m", tokenizer_fingerprint="t",
                  num_tokens=len(tokens), positions=Positions(rope_type="default", rope_theta=10000.0),
                  lineage=(LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)),),
                  placement=Placement(device="cpu"))


def _full_disk(monkeypatch) -> None:
    """What a nearly full disk does: the next write takes part of its data and says so only by the count;
    the write after it fails with ENOSPC."""
    real_write, calls = os.write, []

    def write(fd: int, data: bytes) -> int:
        calls.append(fd)
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvbaton.backend.persist.os.write", write)


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
def test_persistence_needs_a_disk_tier_and_one_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvbaton import cli
    from kvbaton.backend import Engine
    from kvbaton.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="disk tier"):
        Engine(persist=True)  # refused before the model loads
    assert cli.main(["serve", "--persist", "--devices", "cpu,cpu", "--tier", f"disk:1MiB:{tmp_path}"]) == 2
    assert "single-device" in capsys.readouterr().err


@pytest.mark.unit
def test_salt_is_private_and_stable(tmp_path: Path) -> None:
    first = Persistence(tmp_path / "s", fingerprint="m", dtype="f", block_size=16)
    first.close()
    assert stat.S_IMODE((tmp_path / "s" / "salt").stat().st_mode) == 0o600
    second = Persistence(tmp_path / "s", fingerprint="m", dtype="f", block_size=16)
    second.close()
    assert first.salt == second.salt and len(first.salt) == 32
