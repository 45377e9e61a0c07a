"""The handle journal's file format (``state/handles.jsonl``, written by :mod:`.journal`).

One line per event, ``<crc32> <json>``: a header (journal version, model fingerprint, dtype, block
size), ``add`` (an exact handle, its owner and agent; its lineage by reference: ``base`` names the
journaled parent whose lineage comes first, and the line holds only the steps after it), ``slot``
(an OpenAI agent's slot retains the handle), ``release`` (ids).

Invariants: a line is whole or rejected: a kill mid-append leaves at most one torn last line, which
its checksum rejects. At open (:func:`read`) the file is read one line at a time, never whole; a
journal of another model, dtype or block size is dropped whole (with a warning); a line whose
``base`` is missing (its line torn, corrupted or released) is dropped with a warning, with every
handle built on it: never served with a wrong lineage.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbaton.handle import Handle, LineageStep

log = logging.getLogger(__name__)

JOURNAL_VERSION = 2  # 2: lineage by reference (``base``); a version 1 journal (whole lineages) is read as well


@dataclass(frozen=True)
class Entry:
    """A live handle of the journal: the handle (with its lineage), who owns it, its agent."""

    handle: Handle
    owner: str | None
    agent: str | None
    slot: str | None = None  # the agent whose OpenAI slot retains it (server/tenancy.AgentSlots)
    session: str = ""  # that slot's session ("" the default one)


@dataclass
class Replayed:
    """What :func:`read` found: the live entries in their order of use, each with its line's bytes."""

    entries: dict[str, tuple[Entry, int]] = field(default_factory=dict)
    lines: int = 0  # lines after the header
    dropped: int = 0  # entries of another model/dtype/block size
    orphans: int = 0  # entries whose base's line is missing


def encode(record: dict[str, Any]) -> bytes:
    """One line of the journal: the record's checksum, then the record."""
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode(raw: bytes) -> dict[str, Any] | None:
    """The record of one line (without its newline); None when torn or corrupted."""
    crc, _, body = raw.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def add_line(entry: Entry, live: Mapping[str, Entry], written: Callable[[str], bool]) -> bytes:
    """The ``add`` line of an entry: its lineage after the nearest ``live`` ancestor already ``written``
    to the file (``base``), whole when there is none."""
    handle = entry.handle
    lineage, base = handle.lineage, None
    for i in range(len(lineage) - 1, 0, -1):
        parent_id = lineage[i].parent
        parent = live.get(parent_id) if parent_id is not None and written(parent_id) else None
        if parent is not None and parent.handle.lineage == lineage[:i]:
            lineage, base = lineage[i:], parent_id
            break
    body = {**handle.model_dump(mode="json", exclude={"lineage"}), "lineage": [s.model_dump(mode="json")
                                                                               for s in lineage]}
    record: dict[str, Any] = {"add": body, "owner": entry.owner, "agent": entry.agent}
    if base is not None:
        record["base"] = base
    if entry.slot is not None:
        record.update(slot=entry.slot, session=entry.session)
    return encode(record)


def read(path: Path, header: dict[str, Any]) -> Replayed:
    """Replay the journal at ``path`` (none: nothing) for an engine whose header is ``header``."""
    found = Replayed()
    if not path.exists():
        return found
    with path.open("rb") as lines:
        first: dict[str, Any] | None = None
        for raw in _lines(lines):
            record = decode(raw)
            if record is None:
                if raw:  # a kill mid-append leaves at most the last line torn
                    log.warning("handle journal %s: a torn or corrupted line was ignored", path)
                continue
            if first is None:
                first = record.get("header")
                if not _compatible(first, header):
                    log.warning("handle journal %s was written by %s, this engine runs %s: its handles are "
                                "dropped", path, first, header)
                    found.dropped = sum(1 for r in _lines(lines) if (p := decode(r)) is not None and "add" in p)
                    return found
                continue
            found.lines += 1
            _replay(path, found, record, len(raw) + 1)
    if found.orphans:
        log.warning("handle journal %s: %d handle(s) built on a handle whose line is missing were dropped",
                    path, found.orphans)
    return found


def _compatible(found: Any, header: dict[str, Any]) -> bool:
    if not isinstance(found, dict):
        return False
    if found == header:
        return True
    return found.get("version") == 1 and {**found, "version": JOURNAL_VERSION} == header  # whole lineages


def _replay(path: Path, found: Replayed, record: dict[str, Any], size: int) -> None:
    live = found.entries
    if "add" in record:
        try:
            handle = Handle.model_validate(record["add"])
        except ValueError:
            log.warning("handle journal %s: an unreadable handle record was skipped", path)
            return
        base = record.get("base")
        if base is not None:
            parent = live.get(base)
            if parent is None:  # its base's line is torn, corrupted or released: never guess a lineage
                found.orphans += 1
                log.warning("handle journal %s: handle %s is built on handle %s, whose line is missing: it is "
                            "dropped", path, handle.id, base)
                return
            lineage: tuple[LineageStep, ...] = parent[0].handle.lineage + handle.lineage
            handle = handle.model_copy(update={"lineage": lineage})
        live.pop(handle.id, None)  # added again: the newest place in the order
        live[handle.id] = (Entry(handle, record.get("owner"), record.get("agent"), record.get("slot"),
                                 record.get("session", "")), size)
    elif "slot" in record:
        known = live.get(record["slot"])
        if known is not None:  # the same owner: its place in the order and its cost stay
            entry, cost = known
            live[record["slot"]] = (Entry(entry.handle, entry.owner, entry.agent, record.get("agent"),
                                          record.get("session", "")), cost)
    elif "release" in record:
        for hid in record["release"]:
            live.pop(hid, None)


def _lines(file: Iterable[bytes]) -> Iterator[bytes]:
    """A file's lines without their newline, read one at a time (a journal is not read whole)."""
    for raw in file:
        yield raw.rstrip(b"\n")
