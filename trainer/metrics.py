"""Cycle metrics: the summary written to ``metrics.json``, the curves PNG, and the progress bar.

Invariant: ``metrics.json`` holds only JSON numbers/strings derived from the step history and the
cycle's data, so it can be diffed across checkpoints; plotting never touches a display (Agg).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trainer.step_metrics import StepMetrics

CURVES = (
    "loss",
    "pg_loss",
    "kl",
    "mismatch_kl",
    "is_clip_frac",
    "ppo_clip_frac",
    "entropy",
    "grad_norm",
    "tokens_per_s",
)


def data_summary(rewards: list[float], advantages: list[float], groups: int) -> dict[str, float]:
    """Reward and advantage statistics over the cycle's trajectories."""

    def stats(prefix: str, xs: list[float]) -> dict[str, float]:
        if not xs:
            return {}
        return {
            f"{prefix}_mean": statistics.fmean(xs),
            f"{prefix}_std": statistics.pstdev(xs),
            f"{prefix}_min": min(xs),
            f"{prefix}_max": max(xs),
        }

    return {
        **stats("reward", rewards),
        **stats("advantage", advantages),
        "groups": groups,
        "trajectories": len(rewards),
    }


def summarize(
    history: list[StepMetrics], *, data: dict[str, Any], mismatch: dict[str, float], seconds: float
) -> dict[str, Any]:
    """``metrics.json``: per-step history, final-step values, data statistics, timing, and
    ``stopped_early`` (``{"step", "reason"}`` of the step the update watch stopped at, or None)."""
    steps = [asdict(m) for m in history]
    last = steps[-1] if steps else {}
    tokens = sum(m.tokens for m in history)
    train_seconds = sum(m.seconds for m in history)
    return {
        "steps": len(history),
        "final": {k: last.get(k) for k in CURVES + ("behaviour_kl", "ratio", "advantage_mean", "lr")} if last else {},
        "stopped_early": {"step": last["step"], "reason": last["stopped_early"]} if last.get("stopped_early") else None,
        "data": data,
        "mismatch_before_training": mismatch,
        "tokens": tokens,
        "trainable_tokens": sum(m.trainable_tokens for m in history),
        "computed_tokens": sum(m.computed_tokens for m in history),
        "train_seconds": train_seconds,
        "tokens_per_s": tokens / train_seconds if train_seconds else 0.0,
        "cycle_seconds": seconds,
        "history": steps,
    }


def plot_curves(history: list[StepMetrics], path: Path, title: str = "") -> Path:
    """Write a grid of per-step curves (loss, KL, clip fractions, entropy, ...) to a PNG (a bare
    ``Figure``: no pyplot, no GUI backend, the PNG is drawn by Agg)."""
    fig = Figure(figsize=(11, 8), constrained_layout=True)
    axes = fig.subplots(3, 3)
    xs = [m.step for m in history]
    for ax, name in zip(axes.flat, CURVES):
        ax.plot(xs, [getattr(m, name) for m in history], marker="o", markersize=3)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=80)
    return path


@contextlib.contextmanager
def step_progress(total: int, enabled: bool = True) -> Iterator:
    """A rich progress bar over optimizer steps; yields ``advance(StepMetrics)`` (a no-op if disabled)."""
    if not enabled:
        yield lambda m: None
        return
    with Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        transient=False,
    ) as progress:
        task = progress.add_task("train", total=total, info="")

        def advance(m: StepMetrics) -> None:
            progress.update(
                task,
                advance=1,
                info=f"loss {m.loss:+.4f}  kl {m.kl:.2e}  ent {m.entropy:.2f}  {m.tokens_per_s:.0f} tok/s",
            )

        yield advance
