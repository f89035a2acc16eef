"""The browser playground: a static page at ``/`` over the server's own OpenAI routes.

Chat with streaming, the tau knob (per request: tau, mode, draft source, block size,
temperature, max tokens; lookup drafts only where the server allows them, adaptive masks only
where ``/health`` says they act, else the box disabled with its reason), per answer its
TPF, decode tokens/s and time to first token, each decode forward's accepted tokens shaded
in the text (``return_step_tokens``), a view that sends one prompt at two values of tau,
and the server's live default tau and load from ``/metrics``. Files in ``static/``
(package data: HTML, one JS and one CSS file, no build step, nothing fetched from
elsewhere). ``python -m runtime.serve --no-ui`` leaves it out.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")


def install_playground(app: FastAPI) -> None:
    """Serve the page at ``GET /`` and its script and style sheet under ``/static/``."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC_DIR / "index.html")
