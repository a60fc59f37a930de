"""The eval runner: a suite through the production agent harness and sandbox, resumably.

Invariants:
- The plan (which tasks, how many samples, which budgets) is fixed before the first session and
  its fingerprint is the run's ``suite_version``; a restarted run with the same checkpoint, suite
  and fingerprint reuses the unfinished ``eval_run`` and runs only the (task, sample) pairs that
  have no stored result. Every result is committed as soon as its task is graded.
- Sessions run through :func:`evals.harness.agent.run_agent_session` (the simulator's harness, with
  ``emit=None``: eval sessions never reach the event stream or training) and are graded by the hidden
  tests in the sandbox (:func:`evals.harness.agent.grade`). An exception escaping a session is
  infrastructure, not a model failure: it is *not* stored, the run ends ``failed`` and a rerun
  retries exactly those samples (the gate fails closed on the missing results meanwhile).
- One process at a time per (checkpoint, suite, fingerprint) (a Postgres advisory lock). That
  process runs the remaining samples on a thread pool (:func:`execute_samples`), or hands them to
  another executor such as :class:`evals.shards.ShardedExecution` (Celery workers); either way the
  summary is computed from the stored results alone.
- A run given the gate's stop rule (``early_stop``, :mod:`evals.gate.early_stop`) runs its samples in
  the rule's cluster order and ends ``stopped`` when the rule decides; a later run of the same plan
  resumes a ``stopped`` run like a ``failed`` one.

Size: over 400 lines: one job, running a suite's sessions and storing them; resume, the executors and
the early stop share that one loop (the plan is :mod:`evals.plan`).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.db import session_scope
from app.core.errors import ConfigurationError
from app.core.intervals import wilson_interval
from app.core.settings import flywheel_home
from app.core.telemetry import link_references, span_reference, traced
from app.inference.engine import SamplingParams
from app.repositories.checkpoints import get_checkpoint
from evals import store
from evals.config import SuiteConfig, load_suite
from evals.gate.monitors import monitor_values
from evals.gate.passk import sampling_report
from evals.harness.agent import AgentBudget, grade_result, run_agent_session
from evals.harness.sandbox import SandboxLimits
from evals.plan import RunPlan, plan_run, sample_seed
from serving.engine import setup_engine
from serving.openai_engine import OpenAICompatEngine
from serving.reference_engine import ReferenceEngine

if TYPE_CHECKING:
    from app.inference.engine import InferenceEngine
    from evals.gate.early_stop import SequentialStop
    from evals.tasks.model import Task

ResultCallback = Callable[[str, int, dict[str, Any]], None]
SampleExecutor = Callable[
    [
        uuid.UUID,
        "RunPlan",
        list[tuple["Task", int]],
        str,
        "int | None",
        "InferenceEngine | None",
        "ResultCallback | None",
    ],
    list[str],
]
"""Runs a run's remaining (task, sample) pairs and stores their results:
``(run_id, plan, todo, checkpoint_id, workers, engine, on_result) -> errors``
(:func:`execute_samples`, :class:`evals.shards.ShardedExecution`)."""


class EarlyStopped(Exception):
    """Raised by an ``on_result`` callback to end a run early: :func:`execute_samples` submits
    nothing more, cancels what has not started and stores what is already running."""


RESUMABLE = ("running", "failed", "stopped")
"""Statuses of a run that a later :func:`run_suite` of the same plan resumes, in preference order
(``stopped``: an early-stopped candidate run, completed when the checkpoint is later production)."""


@dataclass
class RunSummary:
    """The state of a run after :func:`run_suite` returns."""

    run_id: str
    checkpoint_id: str
    suite: str
    suite_version: str
    status: str
    planned: int
    done: int
    passed: int
    pass_rate: float
    low: float
    high: float
    ran: int = 0
    reused: int = 0
    cached: bool = False
    errors: list[str] = field(default_factory=list)
    monitors: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    samples_per_task: int = 1
    pass_at_k: dict[str, float] = field(default_factory=dict)
    """Unbiased pass@k (Chen et al. 2021, eq. 1) by k ("1" and str(samples_per_task))."""
    best_of_k: float | None = None
    """Share of tasks with at least one passing sample of ``samples_per_task`` (evals.gate.passk)."""
    stopped_at_pairs: int | None = None
    """Where an early-stopped run's confidence sequence decided (status ``stopped``); else None."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _harness_args(suite: SuiteConfig, seed: int):
    b = suite.budget
    budget = AgentBudget(
        max_turns=b.max_turns,
        max_completion_tokens=b.max_completion_tokens,
        context_tokens=b.context_tokens,
        max_tokens_per_turn=b.max_tokens_per_turn,
    )
    sampling = SamplingParams(
        max_tokens=b.max_tokens_per_turn, temperature=suite.sampling.temperature, top_p=suite.sampling.top_p, seed=seed
    )
    limits = SandboxLimits(
        timeout_s=suite.grading.timeout_s, memory_mb=suite.grading.memory_mb, packages=suite.sandbox.packages
    )
    return budget, sampling, limits


def run_sample(
    engine: "InferenceEngine", suite: SuiteConfig, task: "Task", sample_index: int, work_root: Path, run_id: str
) -> dict[str, Any]:
    """One agent session on a fresh copy of the task, graded by its hidden tests in the sandbox.

    Returns:
        The ``eval_result`` fields: passed, attempts (the agent's test runs), turns, completion
        tokens, latency (seconds), tool calls and errors, asked_question, edited, detail.
    """
    budget, sampling, limits = _harness_args(suite, sample_seed(suite, task.id, sample_index))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", task.id)[:80]
    workdir = Path(tempfile.mkdtemp(prefix=f"{safe}-{sample_index}-", dir=work_root))
    try:
        started = time.perf_counter()
        result = run_agent_session(
            engine,
            task,
            workdir / "repo",
            budget,
            sampling,
            emit=None,
            limits=limits,
            session_id=f"eval-{run_id[:8]}-{safe}-{sample_index}",
            user_id="eval",
        )
        graded = grade_result(task, workdir / "repo", limits)
        return {
            "passed": graded.ok,
            "attempts": result.test_runs,
            "turns": result.turns,
            "completion_tokens": result.completion_tokens,
            "latency_s": float(result.latency_s),
            "tool_calls": result.tool_calls,
            "tool_call_errors": result.tool_call_errors,
            "asked_question": bool(result.asked_question),
            "edited": bool(result.edited),
            "detail": {
                "end_reason": result.reason,
                "segments": result.segments,
                "agent_tests_passed": result.passed,
                "grade_exit_code": graded.exit_code,
                "grade_killed": graded.killed_reason,
                # what the session's commands and the graded code tried and the sandbox refused
                "sandbox_denials": result.sandbox_denials + graded.denial_count,
                "grade_s": round(graded.duration_s, 3),
                "grade_output": graded.observation(1500) if not graded.ok else "",
                "wall_s": round(time.perf_counter() - started, 3),
            },
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _summarize(run, plan: RunPlan, errors: list[str]) -> dict[str, Any]:
    """The run's stored summary: pass rate with its Wilson interval over all samples, pass@1 and
    pass@K (K = the plan's samples per task) and best-of-K over tasks (:mod:`evals.gate.passk`), monitors."""
    with session_scope() as session:
        outs = store.outcomes(session, session.merge(run)).outcomes
    k, n = sum(o.passed for o in outs), len(outs)
    low, high = wilson_interval(k, n)
    samp = sampling_report(outs, plan.suite.samples_per_task)
    return {
        "planned": len(plan.planned),
        "done": n,
        "passed": k,
        "pass_rate": k / n if n else 0.0,
        "low": low,
        "high": high,
        "errors": errors[:20],
        "monitors": monitor_values(outs),
        "samples_per_task": plan.suite.samples_per_task,
        "pass_at_k": samp.pass_at_k if samp else {},
        "best_of_k": samp.best_of_k if samp else None,
    }


def _summary_fields(s: dict[str, Any]) -> dict[str, Any]:
    """The :class:`RunSummary` fields of a stored summary (older summaries lack pass@k: empty)."""
    return {
        "planned": s.get("planned", 0),
        "done": s.get("done", 0),
        "passed": s.get("passed", 0),
        "pass_rate": s.get("pass_rate", 0.0),
        "low": s.get("low", 0.0),
        "high": s.get("high", 1.0),
        "monitors": s.get("monitors", {}),
        "samples_per_task": s.get("samples_per_task", 1),
        "pass_at_k": s.get("pass_at_k", {}),
        "best_of_k": s.get("best_of_k"),
        "stopped_at_pairs": (s.get("stopped") or {}).get("stopped_at_pairs"),
    }


@traced("evals.run", attrs=("checkpoint_id", "suite"))
def run_suite(
    checkpoint_id: str,
    suite: SuiteConfig | str,
    *,
    limit: int | None = None,
    workers: int | None = None,
    engine: "InferenceEngine | None" = None,
    tasks: list["Task"] | None = None,
    force: bool = False,
    on_result: ResultCallback | None = None,
    on_plan: Callable[[RunPlan, int], None] | None = None,
    execute: SampleExecutor | None = None,
    early_stop: "SequentialStop | None" = None,
) -> RunSummary:
    """Run (or resume, or reuse) ``suite`` against ``checkpoint_id``.

    Args:
        checkpoint_id: a registered checkpoint (the engine serves its weights).
        suite: a :class:`SuiteConfig` or a suite name.
        limit: override the suite's task limit (changes the fingerprint).
        workers: concurrent sessions (sandboxes); None: :func:`default_workers` for the engine (64
            for a server or the reference engine, so generation overlaps other sessions' sandboxed
            tests; 1 otherwise).
        engine: an engine already serving the checkpoint (tests pass a scripted one); default
            :func:`serving.engine.setup_engine` for the checkpoint, built only if work remains.
        tasks: explicit tasks instead of the suite's source (tests).
        force: start a new run even if a succeeded run of the same plan exists.
        on_result: called in the main thread after each stored result ``(task_id, sample, fields)``.
        on_plan: called once with the plan and the number of samples still to run.
        execute: runs the remaining samples (default :func:`execute_samples`, a thread pool here;
            :class:`evals.shards.ShardedExecution` spreads them over Celery workers).
        early_stop: the gate's stop rule for this run (:class:`evals.gate.early_stop.SequentialStop`):
            samples run cluster by cluster in its look order, results already stored (a resumed
            run) are looked at first, and the run ends ``stopped`` as soon as it decides (the
            in-process executor only).

    Returns:
        A :class:`RunSummary`; ``cached`` when an existing succeeded run was reused;
        ``status = "stopped"`` with ``stopped_at_pairs`` when ``early_stop`` ended it.

    Raises:
        NotFoundError: unknown checkpoint. ConflictError: the same run is active elsewhere.
        ConfigurationError: ``early_stop`` with another executor.
    """
    if early_stop is not None and execute is not None:
        raise ConfigurationError("an early stop runs in-process; a sharded run goes to the end")
    t0 = time.perf_counter()
    suite = load_suite(suite) if isinstance(suite, str) else suite
    plan = plan_run(suite.with_limit(limit), tasks)
    with session_scope() as session:
        manifest = get_checkpoint(session, checkpoint_id).manifest or {}
    link_references([(manifest.get("trace"), {"flywheel.link": "training_cycle"})])
    with store.advisory_lock("eval", checkpoint_id, plan.suite.name, plan.suite_version):
        with session_scope() as session:
            done_run = (
                None
                if force
                else store.find_run(session, checkpoint_id, plan.suite.name, plan.suite_version, status="succeeded")
            )
            if done_run is not None:
                return RunSummary(
                    run_id=str(done_run.id),
                    checkpoint_id=checkpoint_id,
                    suite=plan.suite.name,
                    suite_version=plan.suite_version,
                    status="succeeded",
                    cached=True,
                    elapsed_s=time.perf_counter() - t0,
                    **_summary_fields(done_run.summary),
                )
            run = next(
                filter(
                    None,
                    (
                        store.find_run(session, checkpoint_id, plan.suite.name, plan.suite_version, status=status)
                        for status in RESUMABLE
                    ),
                ),
                None,
            )
            if run is None:
                run = store.create_run(session, checkpoint_id, plan.suite.name, plan.suite_version, plan.config_json())
            run.status = "running"
            done = store.done_keys(session, run.id)
            stored = store.outcomes(session, run).outcomes if early_stop is not None and done else []
        todo = [(t, s) for t in plan.tasks for s in range(plan.suite.samples_per_task) if (t.id, s) not in done]
        if early_stop is not None:
            for o in stored:
                early_stop.observe(o.task_id, o.sample_index, o.passed)
            todo = [] if early_stop.decided else early_stop.sort(todo)
            on_result = _stopping(on_result, early_stop)
        if on_plan is not None:
            on_plan(plan, len(todo))
        errors = (execute or execute_samples)(run.id, plan, todo, checkpoint_id, workers, engine, on_result)
        summary = {**_summarize(run, plan, errors), "trace": span_reference()}  # the gate links to this run
        complete = summary["done"] == len(plan.planned)
        status = "succeeded" if complete else "failed"
        if not complete and early_stop is not None and early_stop.decided and not errors:
            status, summary["stopped"] = "stopped", early_stop.summary()
        with session_scope() as session:
            store.finish_run(session, session.merge(run), status, summary)
    return RunSummary(
        run_id=str(run.id),
        checkpoint_id=checkpoint_id,
        suite=plan.suite.name,
        suite_version=plan.suite_version,
        status=status,
        ran=len(todo),
        reused=len(done),
        errors=errors,
        elapsed_s=time.perf_counter() - t0,
        **_summary_fields(summary),
    )


def _stopping(on_result: ResultCallback | None, early_stop: "SequentialStop") -> ResultCallback:
    """``on_result`` followed by a look of the stop rule, which raises :class:`EarlyStopped` once it
    has decided."""

    def call(task_id: str, sample: int, fields: dict[str, Any]) -> None:
        if on_result is not None:
            on_result(task_id, sample, fields)
        if early_stop.observe(task_id, sample, bool(fields["passed"])):
            raise EarlyStopped(f"{task_id}#{sample}")

    return call


def execute_samples(
    run_id: uuid.UUID,
    plan: RunPlan,
    todo: list[tuple["Task", int]],
    checkpoint_id: str,
    workers: int | None,
    engine: "InferenceEngine | None",
    on_result: ResultCallback | None,
) -> list[str]:
    """Run ``todo`` on a thread pool, committing each result as it completes (a :data:`SampleExecutor`).

    Args:
        run_id: the eval run the results belong to.
        plan: the run's plan (its suite's budgets and sampling).
        todo: (task, sample index) pairs to run.
        checkpoint_id: the checkpoint the engine serves.
        workers: concurrent sessions; None: :func:`default_workers` for the engine.
        engine: an engine serving the checkpoint; None: :func:`eval_engine`, built here only if
            ``todo`` is not empty, and closed here.
        on_result: called in this thread after each stored result; an exception it raises stops
            the run after the samples in flight; :class:`EarlyStopped` stops it sooner: samples not
            yet started are cancelled, the running ones stored (without further calls).

    Returns:
        One ``"task#sample: Error: message"`` line per sample whose session raised (not stored).
    """
    if not todo:
        return []
    own_engine = engine is None
    if engine is None:
        engine = eval_engine(checkpoint_id)
    workers = workers or default_workers(engine)
    # Each executor its own root: shards of one run may execute side by side on one host.
    (flywheel_home() / "evals" / "work").mkdir(parents=True, exist_ok=True)
    work_root = Path(tempfile.mkdtemp(prefix=f"{run_id}-", dir=flywheel_home() / "evals" / "work"))
    errors: list[str] = []
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="eval") as pool:
            pending: dict[Future, tuple[str, int]] = {}
            queue = list(todo)
            # Submit lazily (at most 2 x workers in flight) so an interrupted run leaves little
            # half-done work and results land in plan order.
            stopped = False
            while (queue and not stopped) or pending:
                while queue and not stopped and len(pending) < 2 * max(1, workers):
                    task, s = queue.pop(0)
                    pending[pool.submit(run_sample, engine, plan.suite, task, s, work_root, str(run_id))] = (task.id, s)
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    task_id, s = pending.pop(fut)
                    if fut.cancelled():
                        continue
                    exc = fut.exception()
                    if exc is not None:
                        errors.append(f"{task_id}#{s}: {type(exc).__name__}: {exc}")
                        continue
                    fields = fut.result()
                    with session_scope() as session:
                        store.add_result(session, run_id, task_id, s, **fields)
                    if on_result is not None and not stopped:
                        try:
                            on_result(task_id, s, fields)
                        except EarlyStopped:
                            stopped = True
                            for other in pending:
                                other.cancel()  # only those not started; the running ones are stored
    finally:
        if own_engine and engine is not None:
            engine.close()
        shutil.rmtree(work_root, ignore_errors=True)
    return errors


SESSION_WORKERS = 64


def eval_engine(checkpoint_id: str) -> "InferenceEngine":
    """The engine a candidate's evals run on: with vLLM the eval server (``FLYWHEEL_SERVING_EVAL_URL``),
    never the server that serves production; with the reference engine its own in-process one.

    Raises:
        ConfigurationError: vLLM without an eval server, or an eval server that is the production one.
    """
    return setup_engine(checkpoint_id=checkpoint_id, role="eval")


def default_workers(engine: "InferenceEngine | None" = None) -> int:
    """Default session concurrency: ``SESSION_WORKERS`` (64) for a vLLM / OpenAI-compatible server,
    which batches concurrent requests together, and for the thread-safe reference engine (one prompt
    at a time, while other sessions run their sandboxed tests); 1 for any other engine (a scripted
    engine need not be thread-safe)."""
    return SESSION_WORKERS if isinstance(engine, OpenAICompatEngine | ReferenceEngine) else 1
