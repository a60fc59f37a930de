"""CLI commands of this package (registered on the main ``flywheel`` app). Import heavy modules
inside the command functions, never at module level."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's commands to the main app."""
