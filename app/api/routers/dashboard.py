"""``GET /``: the release manager's dashboard, one static page (vanilla JS, no build step)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
router = APIRouter(include_in_schema=False)


@router.get("/")
def dashboard() -> FileResponse:
    """The dashboard page; it calls this API with the token the user pastes (kept in localStorage)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})
