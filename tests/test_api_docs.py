"""The committed API reference is the one the server's OpenAPI schema renders today."""

from __future__ import annotations

from pathlib import Path

from kvbaton.backend.server import create_app
from kvbaton.backend.server.apidoc import render


def test_docs_api_md_matches_the_openapi_schema(engine):
    committed = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    assert committed == render(create_app(engine).openapi()), (
        "docs/api.md is stale: run `python -m kvbaton.backend.server.apidoc docs/api.md`"
    )


def test_the_generator_answers_help_instead_of_writing_a_file_named_help(tmp_path, capsys, monkeypatch):
    import pytest
    from kvbaton.backend.server.apidoc import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "OpenAPI" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
