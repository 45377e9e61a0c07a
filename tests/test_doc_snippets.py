"""Every Python snippet in README.md and docs/*.md runs as written.

Each page is run like a notebook: its ```python fences in order, in one namespace, in a folder
holding ``notes.txt`` (a small meeting-notes document). The names a page reads without defining
(``notes``, ``text``, ``doc``, ``long_document``: that document's text) are given, nothing else.
Where a page shows the server at ``http://127.0.0.1:8470``, it is a real ``kvbaton serve`` process
on loopback (the test server's address replaces the documented one). Top-level ``await`` runs, as in
``python -m asyncio``.

A fence that cannot run here is marked on the line before it with
``<!-- snippet: skip: why -->`` (a GPU, SGLang, a remote host, a signature listing), and the reason
is shown as the skip; ``>>>`` console transcripts and fences in other languages are not run.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCUMENTED_SERVER = re.compile(r"https?://(?:127\.0\.0\.1|localhost):8470")
SKIP = re.compile(r"<!--\s*snippet:\s*skip:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # the reason, when the page marks the fence


def snippets(page: Path) -> list[Snippet]:
    out: list[Snippet] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        code = "\n".join(body)
        if lang != "python" or code.lstrip().startswith(">>>"):
            continue
        marker = SKIP.search(lines[start - 1]) if start else None
        out.append(Snippet(page.name, start + 1, code, marker.group(1) if marker else None))
    return out


def needs_server(page: Path) -> bool:
    return any(DOCUMENTED_SERVER.search(s.code) for s in snippets(page) if s.skip is None)


RUNNABLE = [p for p in PAGES if any(s.skip is None for s in snippets(p))]


def fixture_document() -> str:
    from kvbaton.bench.corpus import document

    return document(220, seed=11)


def run_page(page: Path, tmp_path: Path, server_url: str | None) -> None:
    text = fixture_document()
    (tmp_path / "notes.txt").write_text(text)
    namespace: dict[str, object] = {"__name__": "__snippet__", "notes": text, "text": text, "doc": text,
                                     "long_document": text}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for snip in snippets(page):
            if snip.skip is not None:
                continue
            code = DOCUMENTED_SERVER.sub(server_url, snip.code) if server_url else snip.code
            compiled = compile(code, f"{snip.page}:{snip.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    result = eval(compiled, namespace)  # noqa: S307 - the project's own docs
                    if inspect.iscoroutine(result):
                        asyncio.run(result)
            except Exception as exc:
                raise AssertionError(f"{snip.page} line {snip.line}: the snippet fails as written: {exc!r}") from exc
    finally:
        os.chdir(cwd)
        for value in namespace.values():  # engines and clients the page made: closed, not left to GC
            close = getattr(value, "close", None)
            if callable(close) and type(value).__module__.startswith("kvbaton"):
                with contextlib.suppress(Exception):
                    closing = close()
                    if inspect.iscoroutine(closing):
                        asyncio.run(closing)


@pytest.mark.parametrize("page", [p for p in RUNNABLE if not needs_server(p)], ids=lambda p: p.name)
def test_page_snippets_run_on_the_embedded_engine(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path, None)


@pytest.mark.parametrize("page", [p for p in RUNNABLE if needs_server(p)], ids=lambda p: p.name)
def test_page_snippets_run_against_a_real_server(page: Path, tmp_path: Path, server) -> None:
    run_page(page, tmp_path, server.url)


@pytest.mark.unit
def test_every_skipped_snippet_says_why() -> None:
    skipped = [s for p in PAGES for s in snippets(p) if s.skip is not None]
    assert all(len(s.skip) >= 10 for s in skipped), [s for s in skipped if len(s.skip) < 10]
    run = sum(1 for p in PAGES for s in snippets(p) if s.skip is None)
    assert run > 2 * len(skipped), f"{run} snippets run, {len(skipped)} skipped: most snippets must run"
