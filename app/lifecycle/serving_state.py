"""What serving runs right now, as reported by the serving watcher (``serving/watcher.py``).

Invariant: ``$FLYWHEEL_HOME/serving.json`` is replaced atomically (write a temp file, fsync,
``os.replace``), so a reader sees the previous report or the next one, never a torn file.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.core.settings import flywheel_home

SERVING_FILE = "serving.json"


def serving_state_path(home: Path | None = None) -> Path:
    """``$FLYWHEEL_HOME/serving.json`` (or under ``home``)."""
    return (home or flywheel_home()) / SERVING_FILE


def read_serving_state(home: Path | None = None) -> dict[str, Any] | None:
    """The last report: ``{"checkpoint_id", "method", "updated_at", "event_id", ...}`` or None."""
    path = serving_state_path(home)
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_serving_state(state: dict[str, Any], home: Path | None = None) -> Path:
    """Atomically replace the report; adds ``updated_at`` (UTC ISO 8601). Returns the file path."""
    path = serving_state_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {**state, "updated_at": datetime.now(UTC).isoformat()}
    fd, tmp = tempfile.mkstemp(prefix=".serving-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
