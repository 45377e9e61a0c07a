"""The committed API reference is the one the server's OpenAPI schema renders today."""

from __future__ import annotations

from pathlib import Path

from kvbaton.backend.apidoc import render
from kvbaton.backend.server import create_app


def test_docs_api_md_matches_the_openapi_schema(engine):
    committed = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    assert committed == render(create_app(engine).openapi()), (
        "docs/api.md is stale: run `python -m kvbaton.backend.apidoc docs/api.md`"
    )
