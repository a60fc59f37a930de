"""``flywheel eval floors``: derive each gated suite's floor from a checkpoint's stored eval results
(:mod:`evals.gate.floors`), print them beside the policy's, and with ``--write`` set them in the gate
policy file. A suite without a succeeded run of that checkpoint is reported and left unchanged."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.console import Console, Group
from rich.table import Table

if TYPE_CHECKING:
    from evals.config import SuiteConfig
    from evals.gate.floors import FloorEstimate
    from evals.gate.policy import GateConfig


@dataclass(frozen=True)
class SuiteFloor:
    """One suite's row: the policy's floor now and, where the checkpoint has a succeeded run, the
    derived one (``estimate``) with the run it came from."""

    suite: str
    current: float
    estimate: FloorEstimate | None = None
    run_id: str | None = None
    suite_version: str | None = None
    matches_plan: bool = False
    """Whether the run sampled as the gate plans the suite (samples per task, temperature, limit)."""

    def comment(self, checkpoint: str) -> str:
        """Where the number comes from, for the policy file's floor line."""
        e = self.estimate
        assert e is not None, "only a suite with results has a floor to write"
        run = f"{checkpoint}'s run {self.run_id[:8] if self.run_id else '?'}: {e.passed}/{e.n} passed"
        if e.passed == 0:
            return f"{run}; a lower bound at a measured 0 is 0 (flywheel eval floors)"
        clustered = f", deff {e.design_effect:.2f}" if e.design_effect > 1 else ""
        return (
            f"{run}{clustered}, {e.confidence:.0%} lower bound {e.lower_bound:.3f}; an equal candidate "
            f"falls below {e.equal_refusal:.1%} of the time (flywheel eval floors)"
        )


def _plan_matches(config: dict[str, Any], planned: SuiteConfig) -> bool:
    """Whether a run's stored plan (``eval_run.config``) sampled as ``planned``."""
    suite = config.get("suite") or {}
    return (
        suite.get("samples_per_task") == planned.samples_per_task
        and (suite.get("sampling") or {}).get("temperature") == planned.sampling.temperature
        and suite.get("limit") == planned.limit
    )


def measure_floors(checkpoint: str, names: list[str], policy: GateConfig, confidence: float) -> list[SuiteFloor]:
    """Each suite's row from ``checkpoint``'s newest succeeded run of it, preferring a run sampled
    as the gate plans the suite (``GateConfig.plan_suite``).

    Raises:
        NotFoundError: unknown checkpoint.
    """
    from app.core.db import session_scope
    from app.repositories.checkpoints import get_checkpoint
    from evals import store
    from evals.config import load_suite
    from evals.gate.checks import cluster_of
    from evals.gate.floors import derive_floor

    rows = []
    with session_scope() as session:
        get_checkpoint(session, checkpoint)
        for name in names:
            current = policy.for_suite(name).floor
            runs = store.succeeded_runs(session, checkpoint, name)
            planned = policy.plan_suite(load_suite(name))
            matching = [r for r in runs if _plan_matches(r.config or {}, planned)]
            candidates = matching or runs
            run = candidates[0] if candidates else None
            outcomes = store.outcomes(session, run).outcomes if run is not None else []
            if run is None or not outcomes:
                rows.append(SuiteFloor(name, current))
                continue
            estimate = derive_floor(
                [o.passed for o in outcomes], [cluster_of(o.task_id, policy) for o in outcomes], confidence=confidence
            )
            rows.append(SuiteFloor(name, current, estimate, str(run.id), run.suite_version, bool(matching)))
    return rows


def _table(checkpoint: str, rows: list[SuiteFloor], path: Path, confidence: float) -> Group:
    t = Table(title=f"floors from {checkpoint}'s stored results", box=box.SIMPLE_HEAD)
    t.add_column("suite")
    t.add_column("run")
    for col in ("passed", "deff", "bound", "floor", "now", "refused"):
        t.add_column(col, justify="right")
    notes = []
    for r in rows:
        e = r.estimate
        if e is None:
            t.add_row(r.suite, "-", "", "", "", "-", f"{r.current:.3f}", "")
            notes.append(f"{r.suite}: {checkpoint} has no succeeded run of it; its floor stays")
            continue
        if not r.matches_plan:
            notes.append(f"{r.suite}*: no run sampled as the gate plans it; read the newest run {r.run_id}")
        t.add_row(
            r.suite,
            (r.run_id or "")[:8] + ("" if r.matches_plan else "*"),
            f"{e.passed}/{e.n}",
            f"{e.design_effect:.2f}",
            f"{e.lower_bound:.3f}",
            f"[bold]{e.floor:.3f}[/bold]",
            f"{r.current:.3f}",
            f"{e.equal_refusal:.2%}",
        )
    level, cap = f"{confidence * 100:.3g} %", f"{(1 - confidence) * 100:.3g} %"
    legend = (
        f"bound: the one-sided {level} Wilson lower bound of the pass rate on n / deff (deff: the "
        "clusters' design effect); floor: the largest half point at or below it that an equal candidate "
        f"falls below at most {cap} of the time (refused); now: in {path}"
    )
    return Group(t, *notes, legend)


def eval_floors(
    checkpoint: str | None = typer.Option(None, "--checkpoint", "-c", help="measured checkpoint (default: production)"),
    suite: list[str] | None = typer.Option(None, "--suite", "-s", help="suites (default: the gated ones)"),
    config: Path | None = typer.Option(
        None,
        "--config",
        dir_okay=False,
        help="gate policy TOML (default FLYWHEEL_EVAL_GATE_CONFIG, else evals/gate.toml)",
    ),
    confidence: float = typer.Option(
        0.99, "--confidence", min=0.51, max=0.9999, help="one-sided level; 1 - it caps an equal candidate's refusal"
    ),
    write: bool = typer.Option(False, "--write", help="set the derived floors in the policy file (comments kept)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON line per suite"),
) -> None:
    """Derive each gated suite's floor from a checkpoint's stored results: the largest half point at or
    below the one-sided Wilson lower bound of its pass rate (widened for the suite's clusters) that an
    equal candidate falls below at most 1 - confidence of the time (docs/gate.md)."""
    from app.core.db import session_scope
    from app.core.errors import ConfigurationError
    from app.repositories.checkpoints import require_production
    from evals.config import eval_settings
    from evals.gate.policy import GATE_TOML, load_gate_config, write_floors

    path = config or eval_settings().gate_config or GATE_TOML
    policy = load_gate_config(path)
    if checkpoint is None:
        with session_scope() as session:
            checkpoint = require_production(session, "name one with --checkpoint").id
    names = suite or policy.gated_suites()
    unknown = sorted(set(names) - set(policy.suites))
    if unknown:
        raise ConfigurationError(f"the gate policy {path.name} has no suite {', '.join(unknown)}")
    rows = measure_floors(checkpoint, names, policy, confidence)
    if as_json:
        for r in rows:
            e = None if r.estimate is None else asdict(r.estimate)
            typer.echo(json.dumps({**asdict(r), "estimate": e, "checkpoint_id": checkpoint}))
    else:
        Console().print(_table(checkpoint, rows, path, confidence))
    if write:
        found = {r.suite: (r.estimate.floor, r.comment(checkpoint)) for r in rows if r.estimate is not None}
        if found:
            write_floors(path, found)
        message = f"wrote {len(found)} floor(s) to {path}" if found else f"no stored results: {path} unchanged"
        typer.echo(message, err=as_json)
