"""Gating a candidate: make sure both checkpoints have runs of every gated suite, decide, record.

This is the one function behind ``flywheel gate`` and the Celery tasks in ``evals.automation``.

Invariants:
- Candidate and production run the *same plan* per suite (the plan is fixed once and handed to both
  runs), so their results pair; production's succeeded run of a plan is reused (cached per suite
  fingerprint), never re-run.
- The decision is recorded by ``app.lifecycle.gating.record_gate_decision`` in one transaction
  (the ``gate_decision`` row, the checkpoint's status and ``decision`` column, its audit entry,
  the ``gate.decided`` outbox message); the report files are written first, so a decision never
  points at a missing report. ``insufficient_evidence`` and ``not_gated`` leave the checkpoint
  ``gate_failed`` with that ``decision`` (promotable only with a written override).
- One gate per candidate at a time (advisory lock).
- Under ``early_stop`` a gated suite's candidate run may stop once its confidence sequence decides
  (:mod:`evals.gate.early_stop`); production's run of the plan is always complete (it is reused), and
  the gate re-derives the stop from the stored outcomes rather than trusting the runner.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.core.db import session_scope
from app.core.errors import ConflictError
from app.core.metrics import GATE_DECISIONS
from app.core.telemetry import link_references, span_reference, traced
from app.lifecycle.gating import record_gate_decision
from app.lifecycle.status import GATEABLE
from app.models import EvalRun
from app.repositories.checkpoints import get_checkpoint, require_production
from evals import store
from evals.config import load_suite
from evals.gate.decision import decide_gate
from evals.gate.early_stop import SequentialStop
from evals.gate.models import GateResult, SuiteOutcomes
from evals.gate.policy import GateConfig, load_gate_config
from evals.plan import plan_run
from evals.report import write_report
from evals.runner import RunSummary, run_suite

if TYPE_CHECKING:
    from app.inference.engine import InferenceEngine
    from evals.tasks.model import Task

EngineFactory = Callable[[str], "InferenceEngine"]


@dataclass
class GateOutcome:
    """What :func:`gate_candidate` did: the decision, the runs it used, where the report is."""

    decision_id: str
    candidate_id: str
    production_id: str
    result: GateResult
    report_path: str
    runs: dict[str, dict[str, RunSummary]] = field(default_factory=dict)


def _resolve(candidate_id: str, production_id: str | None) -> str:
    with session_scope() as session:
        cand = get_checkpoint(session, candidate_id)
        if cand.status not in GATEABLE:
            raise ConflictError(
                f"checkpoint {candidate_id} is {cand.status}; only {', '.join(GATEABLE)} checkpoints are gated"
            )
        if production_id is None:
            production_id = require_production(session, "nothing to compare against (flywheel model init)").id
        else:
            get_checkpoint(session, production_id)
    if production_id == candidate_id:
        raise ConflictError(f"checkpoint {candidate_id} is the production checkpoint; nothing to gate")
    return production_id


def _early_stop(
    name: str,
    planned: list[tuple[str, int]],
    production: RunSummary | None,
    config: GateConfig,
    run_kwargs: dict[str, Any] | None,
) -> SequentialStop | None:
    """The stop rule of a gated suite's candidate run under ``early_stop``, against production's
    complete run of the plan; None where the policy does not stop early, the suite is not gated,
    production's run is not complete, or another executor (shards) runs the samples."""
    if (
        not config.early_stop
        or name not in config.gated_suites()
        or production is None
        or production.status != "succeeded"
        or (run_kwargs or {}).get("execute") is not None
    ):
        return None
    with session_scope() as session:
        outs = store.outcomes(session, session.get_one(EvalRun, uuid.UUID(production.run_id))).outcomes
    return SequentialStop(name, planned, {o.key: o.passed for o in outs}, config)


@traced("evals.gate", attrs=("candidate_id", "production_id"))
def gate_candidate(
    candidate_id: str,
    *,
    production_id: str | None = None,
    config: GateConfig | None = None,
    suites: list[str] | None = None,
    limit: int | None = None,
    overrides: dict[str, int] | None = None,
    workers: int | None = None,
    engine_factory: EngineFactory | None = None,
    tasks: dict[str, list["Task"]] | None = None,
    on_run: Callable[[str, str, RunSummary], None] | None = None,
    run_kwargs: dict[str, Any] | None = None,
) -> GateOutcome:
    """Evaluate ``candidate_id`` against production on every gated suite and record the decision.

    Args:
        candidate_id: a ``candidate`` (or previously gated) checkpoint.
        production_id: baseline; default the current production checkpoint.
        config: gate policy; default ``evals/gate.toml``.
        suites: suites to run (default: the config's gated suites; a gated suite left out fails closed).
        limit: task limit per suite (changes the suite fingerprint for both sides alike).
        overrides: budget overrides (``max_turns``, ``max_tokens_per_turn``, ``samples_per_task``),
            both sides alike, applied after the policy's ``samples`` (:meth:`GateConfig.plan_suite`).
        workers: concurrent sessions per run; None: the engine's default
            (:func:`evals.runner.default_workers`: 64 on a vLLM server, which batches them).
        engine_factory: ``checkpoint_id -> engine`` (tests); default the configured engine.
        tasks: explicit tasks per suite instead of the suites' sources (tests).
        on_run: called after each run with ``(suite, "candidate" | "production", summary)``.
        run_kwargs: extra keyword arguments for :func:`evals.runner.run_suite` (e.g. ``on_result``).

    Returns:
        A :class:`GateOutcome`. The decision is stored whatever it is.

    Raises:
        NotFoundError: unknown checkpoint. ConflictError: not gateable, or gated elsewhere right now.
    """
    config = config or load_gate_config()
    production_id = _resolve(candidate_id, production_id)
    names = suites or config.gated_suites()
    runs: dict[str, dict[str, RunSummary]] = {}
    cand_out: dict[str, SuiteOutcomes] = {}
    prod_out: dict[str, SuiteOutcomes] = {}
    with store.advisory_lock("gate", candidate_id):
        for name in names:
            suite = config.plan_suite(load_suite(name)).with_overrides(limit=limit, **(overrides or {}))
            plan = plan_run(suite, (tasks or {}).get(name))
            runs[name] = {}
            for role, ckpt in (("production", production_id), ("candidate", candidate_id)):
                stop = _early_stop(name, plan.planned, runs[name].get("production"), config, run_kwargs)
                summary = run_suite(
                    ckpt,
                    plan.suite,
                    tasks=plan.tasks,
                    workers=workers,
                    engine=engine_factory(ckpt) if engine_factory else None,
                    early_stop=stop if role == "candidate" else None,
                    **(run_kwargs or {}),
                )
                runs[name][role] = summary
                if on_run is not None:
                    on_run(name, role, summary)
            with session_scope() as session:
                for role, target in (("candidate", cand_out), ("production", prod_out)):
                    run = session.get_one(EvalRun, uuid.UUID(runs[name][role].run_id))
                    target[name] = store.outcomes(session, run)
                    link_references([((run.summary or {}).get("trace"), {"flywheel.link": f"eval_run.{role}"})])
        result = decide_gate(cand_out, prod_out, config)
        decision_id = uuid.uuid4()
        run_ids = {s: {r: v.run_id for r, v in d.items()} for s, d in runs.items()}
        report, path = write_report(str(decision_id), candidate_id, production_id, result, run_ids)
        failed = [r.message for r in result.failures()]
        with session_scope() as session:
            record_gate_decision(
                session,
                decision_id=decision_id,
                candidate_id=candidate_id,
                production_id=production_id,
                decision=result.decision,
                reasons=[r.model_dump(mode="json") for r in result.reasons],
                report={**report, "trace": span_reference()},  # the promotion links to this gate
                report_path=str(path),
                failures=failed,
                suites={n: {"decision": s.decision, "power": s.power} for n, s in result.suites.items() if s.gated},
            )
    GATE_DECISIONS.add(1, {"decision": result.decision})
    return GateOutcome(
        decision_id=str(decision_id),
        candidate_id=candidate_id,
        production_id=production_id,
        result=result,
        report_path=str(path),
        runs=runs,
    )
