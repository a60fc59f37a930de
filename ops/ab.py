"""Paired A/B on fresh production traffic: two checkpoints serve the same requests, simulated developers answer.

The requests are fresh traffic at the production request mix: by default the ``fresh`` split of
``functions`` (``evals/functions_splits.toml``: kinds of request no cycle trains on, at production
difficulty, each reference at least 3 code-skeleton tokens from every trained one), drawn with the
production mix of difficulty levels (:data:`ops.simulator.PRODUCTION_MIX`,
:func:`ops.simulator.choose_tasks`). ``split = "fresh_hard"`` draws the kinds base rarely solves (the
``fresh`` split before 2026-12-02). ``split = "test_params"`` is the older draw: training templates
with parameters no training cycle used (every task fails each training variant's reference, yet
most are a one- or two-token edit of a trained request). Each of ``tasks x samples`` (task, sample) pairs is
served once by each arm through the product harness (:func:`evals.harness.agent.run_agent_session`,
the simulator's) at the serving temperature, on the EVAL engine (:func:`evals.runner.eval_engine`:
with vLLM the eval server, so production's server is never touched), with serving latency as the
simulator measures it (:class:`ops.simulator.ModelledLatency`), and answered by a simulated
developer (:class:`ops.developer.DeveloperReaction`). The sampling seed and the developer's random
stream are seeded by (seed, task, sample), so both arms of a pair face the same developer draw.

Invariants:

- Measurement, never training: the harness runs with ``emit=None`` and the developer's events go
  to an in-memory :class:`ops.developer.DeveloperSignals`; no A/B session reaches the event stream.
- Paired: a (task, sample) enters the comparison only when both arms completed it; an errored
  session is infrastructure, reported, never stored, and run again by the next A/B.
- Each arm's sessions are stored per (checkpoint, settings fingerprint) under
  ``$FLYWHEEL_HOME/ab/``, one JSON line per session, so an interrupted A/B resumes and a smaller A/B
  with the same settings (a prefix of the same task draw) reuses them.

Every metric is a ratio over sessions (:data:`METRICS`); the paired difference of each has a
delta-method interval clustered by template (``cluster_by``; tasks of one template are not
independent) or by task (:func:`app.core.intervals.paired_ratio_diff_interval`).

Size: over 400 lines: one comparison read top to bottom, the draw, both arms' sessions and the
paired read-out (the developer's signals are :mod:`ops.developer`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.core.errors import ConfigurationError, InfrastructureError
from app.core.intervals import clustered_ratio_interval, paired_ratio_diff_interval
from app.core.settings import flywheel_home
from app.inference.engine import InferenceEngine, SamplingParams
from evals.config import source_packages
from evals.harness.agent import AgentBudget, run_agent_session
from evals.harness.sandbox import SandboxLimits
from evals.plan import task_hash
from evals.runner import default_workers, eval_engine
from evals.tasks import load_tasks
from evals.tasks.functions import template_of
from evals.tasks.model import Task
from ops.developer import DeveloperModel, DeveloperReaction, DeveloperSignals
from ops.simulator import PRODUCTION_MIX, ModelledLatency, SimulatorConfig, choose_tasks

SOURCE = "functions"
SPLITS = ("fresh", "fresh_hard", "test_params")
"""Splits an A/B may draw: ``fresh`` (new kinds of request at production difficulty, the default),
``fresh_hard`` (new kinds base rarely solves) or ``test_params`` (unseen parameters of the training
templates)."""

Key = tuple[str, int]


class ABConfig(BaseModel):
    """Settings of one A/B (``flywheel ab`` flags); serving settings default to ``flywheel simulate``'s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    split: Literal["fresh", "fresh_hard", "test_params"] = "fresh"
    """Where the requests come from (:data:`SPLITS`): ``fresh``, kinds of request never trained on
    nor held out, at production difficulty; ``fresh_hard``, such kinds that base rarely solves;
    ``test_params``, the older draw of unseen parameters of the training templates."""
    tasks: int | None = Field(default=None, ge=2)
    """Distinct tasks drawn with the mix (None: every task of the split at the mix's levels)."""
    samples: int = Field(default=4, ge=1, le=64)
    """Sessions per task and arm (independent samples at ``temperature``)."""
    difficulty_mix: dict[int, float] | None = Field(default_factory=lambda: dict(PRODUCTION_MIX))
    """Relative weight of each difficulty level when drawing tasks, as the simulator's
    ``difficulty_mix``; default the production mix (:data:`ops.simulator.PRODUCTION_MIX`); None:
    every level alike."""
    cluster_by: Literal["template", "task"] = "template"
    """The unit the intervals resample: the task's template (``evals.tasks.functions.template_of``),
    or the task (its samples only)."""
    max_turns: int = Field(default=6, ge=1)
    """Model turns per session."""
    max_tokens: int = Field(default=1024, ge=16)
    """Completion tokens per session."""
    max_tokens_per_turn: int = Field(default=256, ge=8)
    """Completion tokens per turn."""
    context_tokens: int = Field(default=3072, ge=256)
    """Context kept before self-summarization (tokens)."""
    temperature: float = Field(default=0.7, ge=0.0)
    """Sampling temperature (the serving temperature: the simulator's)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass."""
    developer: DeveloperModel = DeveloperModel()
    """How the simulated developers react to outcomes."""
    run_timeout_s: float = Field(default=60.0, gt=0)
    """Wall-clock limit of one ``run`` tool call and of the hidden tests (seconds)."""
    seed: int = 0
    """Seeds the task draw, every session's sampling and every developer's draws."""
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
    """Level of the intervals (two-sided; the pass rate's lower bound is one-sided at this level)."""
    workers: int | None = Field(default=None, ge=1)
    """Sessions in flight per arm (None: ``evals.runner.default_workers`` for the engine)."""

    def fingerprint(self) -> str:
        """12 hex over what shapes one session (budgets, sampling, developer, seed), not over which
        tasks or how many samples: a smaller A/B with the same settings reuses stored sessions."""
        shaping = self.model_dump(
            mode="json", exclude={"split", "tasks", "samples", "difficulty_mix", "cluster_by", "confidence", "workers"}
        )
        blob = json.dumps({"source": SOURCE, "split": self.split, **shaping}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ArmSession:
    """What one session of one arm produced (rates' numerators and denominators per session)."""

    task_id: str
    sample: int
    task_hash: str
    checkpoint_id: str
    passed: bool
    outcome: str
    accepted: int
    rejected: int
    persisted_sum: float
    persisted_n: int
    followups: int
    completion_tokens: int
    latency_s: float
    turns: int
    reason: str


#: metric -> (session -> (numerator, denominator), True when higher is better)
METRICS: dict[str, tuple[Callable[[ArmSession], tuple[float, float]], bool]] = {
    "pass_rate": (lambda s: (float(s.passed), 1.0), True),
    "edit_acceptance": (lambda s: (float(s.accepted), float(s.accepted + s.rejected)), True),
    "edit_persistence": (lambda s: (s.persisted_sum, float(s.persisted_n)), True),
    "dissatisfied_followup_rate": (lambda s: (float(s.followups), 1.0), False),
    "mean_completion_tokens": (lambda s: (float(s.completion_tokens), 1.0), False),
    "mean_latency_s": (lambda s: (s.latency_s, 1.0), False),
}


@dataclass
class ArmRun:
    """One arm's sessions by (task, sample), and what happened to the rest."""

    checkpoint_id: str
    sessions: dict[Key, ArmSession] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    ran: int = 0
    reused: int = 0


def pair_seed(seed: int, stream: str, task_id: str, sample: int) -> int:
    """A 31-bit seed of one (task, sample) for ``stream`` (``sampling`` | ``developer``), the same for
    every checkpoint."""
    digest = hashlib.sha256(f"{seed}:{stream}:{task_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def plan_pairs(config: ABConfig) -> list[tuple[Task, int]]:
    """The (task, sample) pairs: ``config.tasks`` tasks of the split drawn with the mix in the
    simulator's way (a smaller draw is a prefix of a larger one), ``config.samples`` each.

    Raises:
        ConfigurationError: a mix that weighs no level of the split above 0.
    """
    tasks = load_tasks(SOURCE, config.split)
    mix = config.difficulty_mix or {t.metadata["difficulty"]: 1.0 for t in tasks}
    chosen = choose_tasks(tasks, config.tasks or len(tasks), mix, config.seed)
    return [(t, s) for t in chosen for s in range(config.samples)]


def run_session(engine, config: ABConfig, task: Task, sample: int, workdir: Path) -> ArmSession:
    """One session of ``task`` served by ``engine`` and answered by its seeded developer."""
    limits = SandboxLimits(timeout_s=config.run_timeout_s, packages=source_packages(SOURCE))
    reactions = SimulatorConfig(
        source=SOURCE, developer=config.developer, run_timeout_s=config.run_timeout_s, seed=config.seed
    )
    session_id = f"ab-{pair_seed(config.seed, 'session', task.id, sample):08x}-{sample}"
    envelope = dict(session_id=session_id, user_id="ab", org_id="default", privacy_mode=False)
    signals = DeveloperSignals()
    developer = DeveloperReaction(
        reactions,
        random.Random(pair_seed(config.seed, "developer", task.id, sample)),
        task,
        workdir,
        envelope,
        signals.emit,
        signals.schedule,
    )
    result = run_agent_session(
        engine,
        task,
        workdir,
        AgentBudget(
            max_turns=config.max_turns,
            max_completion_tokens=config.max_tokens,
            context_tokens=config.context_tokens,
            max_tokens_per_turn=config.max_tokens_per_turn,
        ),
        SamplingParams(
            max_tokens=config.max_tokens_per_turn,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=pair_seed(config.seed, "sampling", task.id, sample),
        ),
        emit=None,
        session_id=session_id,
        user_id="ab",
        limits=limits,
        on_end=developer,
    )
    return ArmSession(
        task_id=task.id,
        sample=sample,
        task_hash=task_hash(task),
        checkpoint_id=engine.checkpoint_id,
        passed=bool(developer.passed),
        outcome=developer.outcome,
        accepted=developer.accepted,
        rejected=developer.rejected,
        persisted_sum=sum(signals.persisted),
        persisted_n=len(signals.persisted),
        followups=signals.followups,
        completion_tokens=result.completion_tokens,
        latency_s=float(result.latency_s),
        turns=result.turns,
        reason=result.reason,
    )


def _store_path(root: Path, checkpoint_id: str, config: ABConfig) -> Path:
    return root / re.sub(r"[^A-Za-z0-9_.-]+", "_", checkpoint_id) / f"{config.fingerprint()}.jsonl"


def _load_stored(path: Path, checkpoint_id: str, hashes: dict[str, str]) -> dict[Key, ArmSession]:
    """Stored sessions of tasks whose content is unchanged (a torn last line is skipped)."""
    out: dict[Key, ArmSession] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            s = ArmSession(**json.loads(line))
        except (ValueError, TypeError):
            continue
        if s.checkpoint_id == checkpoint_id and hashes.get(s.task_id) == s.task_hash:
            out[(s.task_id, s.sample)] = s
    return out


def run_arm(
    checkpoint_id: str,
    config: ABConfig,
    pairs: list[tuple[Task, int]],
    *,
    engine_for: Callable[[str], InferenceEngine] = eval_engine,
    store: Path | None = None,
    on_session: Callable[[ArmSession], None] | None = None,
) -> ArmRun:
    """Serve ``pairs`` with ``checkpoint_id`` (stored sessions reused); the engine is built by
    ``engine_for`` only when work remains and closed afterwards.

    Raises:
        ConfigurationError: the engine serves another checkpoint than the arm's.
    """
    path = _store_path(store or flywheel_home() / "ab", checkpoint_id, config)
    wanted = {(t.id, s) for t, s in pairs}
    stored = _load_stored(path, checkpoint_id, {t.id: task_hash(t) for t, _ in pairs})
    arm = ArmRun(checkpoint_id, sessions={k: v for k, v in stored.items() if k in wanted})
    arm.reused = len(arm.sessions)
    todo = [(t, s) for t, s in pairs if (t.id, s) not in arm.sessions]
    if not todo:
        return arm
    engine = engine_for(checkpoint_id)
    root = Path(tempfile.mkdtemp(prefix="flywheel-ab-"))
    try:
        if engine.checkpoint_id != checkpoint_id:
            raise ConfigurationError(f"the A/B arm {checkpoint_id} got an engine serving {engine.checkpoint_id}")
        served = ModelledLatency(engine)
        path.parent.mkdir(parents=True, exist_ok=True)
        workers = max(1, config.workers or default_workers(engine))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ab") as pool, path.open("a") as out:
            pending: dict[Future, Key] = {}
            queue = list(enumerate(todo))
            while queue or pending:
                # at most 2 x workers in flight, so an interrupted arm leaves little half-done work
                while queue and len(pending) < 2 * workers:
                    i, (task, sample) = queue.pop(0)
                    pending[pool.submit(run_session, served, config, task, sample, root / str(i))] = (task.id, sample)
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    task_id, sample = pending.pop(fut)
                    if (exc := fut.exception()) is not None:
                        arm.errors.append(f"{task_id}#{sample}: {type(exc).__name__}: {exc}")
                        continue
                    s = fut.result()
                    out.write(json.dumps(asdict(s)) + "\n")
                    out.flush()
                    arm.sessions[(task_id, sample)] = s
                    arm.ran += 1
                    if on_session is not None:
                        on_session(s)
    finally:
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    return arm


def compare_arms(
    base: ArmRun,
    final: ArmRun,
    pairs: list[tuple[Task, int]],
    confidence: float = 0.95,
    cluster_by: Literal["template", "task"] = "template",
) -> dict:
    """Both arms on the pairs each completed: every :data:`METRICS` entry as ``{"base", "final",
    "diff", "ci", "base_ci", "final_ci", "higher_is_better"}`` (values in the metric's unit, None
    where undefined: no denominator or fewer than two clusters), and the pass rate's one-sided lower
    bound of ``final - base`` at ``confidence``; the intervals cluster the pairs by ``cluster_by``
    (a task without a template is its own cluster). ``tasks`` counts distinct tasks, ``clusters``
    the clusters, ``split`` the tasks' split(s)."""
    keys = [(t.id, s) for t, s in pairs if (t.id, s) in base.sessions and (t.id, s) in final.sessions]
    b = [base.sessions[k] for k in keys]
    f = [final.sessions[k] for k in keys]
    clusters = [k[0] if cluster_by == "task" else template_of(k[0]) or k[0] for k in keys]
    metrics: dict[str, dict[str, Any]] = {}
    for name, (parts, better_up) in METRICS.items():
        bx, by = zip(*(parts(s) for s in b)) if b else ((), ())
        fx, fy = zip(*(parts(s) for s in f)) if f else ((), ())
        eb = clustered_ratio_interval(clusters, bx, by, confidence=confidence)
        ef = clustered_ratio_interval(clusters, fx, fy, confidence=confidence)
        d = paired_ratio_diff_interval(clusters, fx, fy, bx, by, confidence=confidence)
        metrics[name] = {
            "base": eb and eb.value,
            "final": ef and ef.value,
            "diff": d and d.value,
            "ci": d and [d.low, d.high],
            "base_ci": eb and [eb.low, eb.high],
            "final_ci": ef and [ef.low, ef.high],
            "higher_is_better": better_up,
        }
    passed = [(float(x.passed), 1.0, float(y.passed), 1.0) for x, y in zip(f, b)]
    one_sided = (
        paired_ratio_diff_interval(clusters, *zip(*passed), confidence=confidence, two_sided=False) if passed else None
    )
    levels = Counter(t.metadata.get("difficulty") for t, s in pairs if s == 0)
    return {
        "base": base.checkpoint_id,
        "final": final.checkpoint_id,
        "source": SOURCE,
        "split": ",".join(sorted({t.split for t, _ in pairs})),
        "pairs": len(keys),
        "tasks": len({k[0] for k in keys}),
        "cluster_by": cluster_by,
        "clusters": len(set(clusters)),
        "tasks_by_difficulty": {str(k): v for k, v in sorted(levels.items(), key=lambda kv: str(kv[0]))},
        "confidence": confidence,
        "pass_rate_lower_bound": one_sided and one_sided.low,
        "metrics": metrics,
        "errors": base.errors + final.errors,
        "sessions": {
            "base": {"ran": base.ran, "reused": base.reused},
            "final": {"ran": final.ran, "reused": final.reused},
        },
    }


def run_ab(
    base_id: str,
    final_id: str,
    config: ABConfig,
    *,
    engine_for: Callable[[str], InferenceEngine] = eval_engine,
    store: Path | None = None,
    on_session: Callable[[ArmSession], None] | None = None,
) -> dict:
    """The paired A/B of ``final_id`` against ``base_id`` (module docstring): each arm in turn on the
    eval engine, then :func:`compare_arms`.

    Raises:
        ConfigurationError: see :func:`plan_pairs` and :func:`run_arm`.
        InfrastructureError: every session of an arm errored (nothing to compare).
    """
    pairs = plan_pairs(config)
    arms = [
        run_arm(c, config, pairs, engine_for=engine_for, store=store, on_session=on_session)
        for c in (base_id, final_id)
    ]
    for arm in arms:
        if not arm.sessions and arm.errors:
            raise InfrastructureError(f"every session of {arm.checkpoint_id} errored; first: {arm.errors[0]}")
    return {
        **compare_arms(arms[0], arms[1], pairs, config.confidence, config.cluster_by),
        "config": config.model_dump(mode="json"),
    }
