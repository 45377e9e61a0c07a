"""The server API reference (docs/api.md), rendered from the app's own OpenAPI schema.

``python -m kvbaton.backend.server.apidoc [out.md]`` regenerates it; a test checks the committed file matches,
so the reference cannot drift from the server.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HEADER = """# Server API reference

Generated from the server's OpenAPI schema by `python -m kvbaton.backend.server.apidoc docs/api.md`; do not
edit by hand. The running server serves the same schema at `/openapi.json` (and Swagger UI at
`/docs`). Every error has the body `{"error": {"code": ..., "message": ...}}`; codes and statuses are
listed in [server.md](server.md). Guide: [server.md](server.md).
"""


def _type(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[-1]}`"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type(s, defs) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}), defs)}"
    if kind == "object" and "additionalProperties" in schema:
        return "object"
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    return str(kind or "any")


def _fields(name: str, defs: dict[str, Any]) -> list[str]:
    schema = defs.get(name, {})
    props = schema.get("properties", {})
    if not props:
        return []
    required = set(schema.get("required", ()))
    lines = [f"#### `{name}`", "", "| field | type | required | default | description |", "|---|---|---|---|---|"]
    for field, spec in props.items():
        default = f"`{spec['default']}`" if "default" in spec and spec["default"] not in ({}, []) else ""
        desc = " ".join(str(spec.get("description", "")).split()).replace("|", "\\|")
        lines.append(f"| `{field}` | {_type(spec, defs)} | {'yes' if field in required else ''} | {default} | {desc} |")
    return [*lines, ""]


def render(schema: dict[str, Any]) -> str:
    defs = schema.get("components", {}).get("schemas", {})
    out = [HEADER]
    models: list[str] = []
    for tag in ("native", "openai", None):
        rows = []
        for path, ops in sorted(schema.get("paths", {}).items()):
            for method, op in ops.items():
                tags = op.get("tags") or [None]
                if (tag in tags) if tag else not set(tags) & {"native", "openai"}:
                    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
                    ok = next((r for c, r in op.get("responses", {}).items() if c.startswith("2")), {})
                    resp = ok.get("content", {}).get("application/json", {}).get("schema")
                    for s in (body, resp):
                        if s and "$ref" in s and s["$ref"].rsplit("/", 1)[-1] not in models:
                            models.append(s["$ref"].rsplit("/", 1)[-1])
                    summary = " ".join(str(op.get("description") or op.get("summary") or "").split())
                    rows.append(f"| `{method.upper()} {path}` | {_type(body, defs) if body else ''} | "
                                f"{_type(resp, defs) if resp else ''} | {summary.replace('|', '/')} |")
        title = {"native": "Native handle API", "openai": "OpenAI-compatible API", None: "Other endpoints"}[tag]
        out += [f"## {title}", "", "| endpoint | request | response | description |", "|---|---|---|---|", *rows, ""]
    out += ["## Bodies", ""]
    for name in models:
        out += _fields(name, defs)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvbaton.backend.server.apidoc",
        description="Render the server API reference (docs/api.md) from the app's own OpenAPI schema.")
    parser.add_argument("out", nargs="?", type=Path, help="the Markdown file to write (default: standard output)")
    args = parser.parse_args(argv)  # --help prints this and exits; it is never taken for a file name

    from .. import Engine
    from . import create_app

    engine = Engine(kv_budget="1 blocks", prefix_cache=False)
    try:
        text = render(create_app(engine).openapi())
    finally:
        engine.close()
    if args.out is not None:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
