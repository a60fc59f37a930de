"""Where downloaded data and materialized models are cached (shared across FLYWHEEL_HOMEs)."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """``FLYWHEEL_DATA_DIR``, else ``$XDG_CACHE_HOME/flywheel`` (default ``~/.cache/flywheel``)."""
    if env := os.environ.get("FLYWHEEL_DATA_DIR"):
        return Path(env).resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "flywheel"
