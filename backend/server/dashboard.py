"""The dashboard: one static page (HTML + plain JS + SVG, shipped in the package, no CDN) that draws
the engine's events as a per-agent timeline, the agents' steps-to-execution, cache occupancy per
tier and reuse ratios over time (docs/dashboard.md).

Live, ``kvbaton serve`` answers the page at ``/dashboard`` without a token (it holds no data); the
page reads ``/v1/kv/events`` and ``/v1/kv/stats`` with the token it is given (a form, or the URL
fragment ``#token=...``, which browsers never send to the server), so the data stays behind auth
and scoped to the token's tenant. Offline, :func:`offline_page` embeds saved events (and stats) in
a self-contained copy of the same page (``kvbaton dashboard --events FILE --out page.html``).
"""

from __future__ import annotations

import importlib.resources
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from kvbaton.errors import InvalidRequest
from kvbaton.types import Event, Events

PAGE_PATH = "/dashboard"
SCRIPT_PATH = "/dashboard/dashboard.js"
PUBLIC_PATHS = frozenset({PAGE_PATH, SCRIPT_PATH})  # the auth middleware lets these through: no data in them
_DATA_MARK = "<!-- kvbaton:data -->"
_SCRIPT_TAG = '<script src="dashboard.js"></script>'
# The page may run only its own script and talk only to its own server.
_CSP = "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:"


def _static(name: str) -> str:
    return importlib.resources.files("kvbaton.backend.server").joinpath("static", name).read_text(encoding="utf-8")


def add_dashboard_routes(app: FastAPI) -> None:
    @app.get(PAGE_PATH, response_class=HTMLResponse, tags=["server"], include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        # The script is referenced relative to the page: served from /dashboard/dashboard.js.
        page = _static("dashboard.html").replace(_SCRIPT_TAG, '<script src="/dashboard/dashboard.js"></script>')
        return HTMLResponse(page, headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-store"})

    @app.get(SCRIPT_PATH, tags=["server"], include_in_schema=False)
    async def script() -> Response:
        return Response(_static("dashboard.js"), media_type="text/javascript",
                        headers={"Cache-Control": "no-store"})


def read_events(path: str | Path) -> list[Event]:
    """Events saved as the JSON of ``client.events()`` (an ``Events`` object), a JSON list of events,
    or JSON lines (one event each); anything else is an ``InvalidRequest``."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data: Any = json.loads(text)
    except ValueError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as exc:
            raise InvalidRequest(f"{path}: neither JSON nor JSON lines of events: {exc}") from None
    if isinstance(data, dict) and "events" not in data:
        data = [data]  # JSON lines of one event
    items = data.get("events") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise InvalidRequest(f"{path}: expected the JSON of client.events() or a list of events")
    try:
        return [Event.model_validate(item) for item in items]
    except ValueError as exc:
        raise InvalidRequest(f"{path}: not kvbaton events: {exc}") from None


def offline_page(events: Iterable[Event] | Events, stats: dict[str, Any] | None = None, title: str = "") -> str:
    """The dashboard page with its script inlined and ``events`` (and optional stats) embedded: one
    self-contained HTML file that needs no server."""
    items = events.events if isinstance(events, Events) else list(events)
    data = {"events": [e.model_dump(mode="json") for e in items], "stats": stats, "title": title}
    # "</" never appears inside the inline script or data, so neither can close its tag early.
    payload = json.dumps(data).replace("</", "<\\/")
    script = _static("dashboard.js").replace("</", "<\\/")
    page = _static("dashboard.html")
    page = page.replace(_DATA_MARK, f'<script id="kvbaton-data" type="application/json">{payload}</script>')
    return page.replace(_SCRIPT_TAG, f"<script>{script}</script>")
