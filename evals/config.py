"""Typed configs of the eval side: suites (``evals/suites/*.toml``) and the gate (``evals/gate.toml``).

Invariant: every knob that changes which tasks run or how they are scored lives in a validated,
``extra="forbid"`` model, and a suite's *effective version* (:func:`SuiteConfig.fingerprint`)
changes whenever any of those knobs change, so cached results are never reused across a change.
Hand-written TOML in, resolved JSON out (stored in ``eval_run.config`` and gate reports).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.errors import ConfigurationError
from app.core.settings import flywheel_home

SUITES_DIR = Path(__file__).parent / "suites"
GATE_TOML = Path(__file__).parent / "gate.toml"

MonitorName = Literal[
    "invalid_tool_call_rate",
    "clarifying_question_rate",
    "edit_rate",
    "mean_completion_tokens",
    "mean_latency_s",
    "p90_latency_s",
    "sandbox_denial_rate",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- suites --------------------------------------------------------------------------------------


class BudgetConfig(_Strict):
    """Per-session agent budget (mirrors ``evals.harness.agent.AgentBudget``)."""

    max_turns: int = Field(default=8, ge=1)
    """Model turns before the session is cut off."""
    max_completion_tokens: int = Field(default=2048, ge=1)
    """Completion tokens over the whole session (tokens)."""
    context_tokens: int = Field(default=4096, ge=256)
    """Context window the harness keeps before it self-summarizes (tokens)."""
    max_tokens_per_turn: int = Field(default=512, ge=1)
    """Completion tokens of one model turn (tokens)."""


class SamplingConfig(_Strict):
    """Decoding for eval sessions (mirrors ``app.inference.engine.SamplingParams``)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """0 means greedy. With ``samples_per_task`` > 1 use the serving temperature (0.7,
    ``app.inference.engine.SamplingParams``): greedy samples are identical and add no information."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""


class GradingConfig(_Strict):
    """Sandbox limits for the hidden tests (mirrors ``evals.harness.sandbox.SandboxLimits``)."""

    timeout_s: float = Field(default=60.0, gt=0)
    """Wall-clock limit of one hidden-test run (seconds)."""
    memory_mb: int = Field(default=2048, ge=64)
    """Address-space limit of the test process (MiB)."""


class SuiteConfig(_Strict):
    """One eval suite: where its tasks come from and how each is run."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9_\-]+$")
    """Suite name (the TOML file stem)."""
    version: str = Field(min_length=1, max_length=32)
    """Human version; bump when the suite's meaning changes (the fingerprint catches the rest)."""
    description: str = ""
    """What the suite measures."""
    source: Literal["dataframebench", "humaneval", "functions", "functions_long", "mined"]
    """Task source: a ``evals.tasks`` adapter, or ``mined`` (the ``eval_task`` table)."""
    split: str = "test"
    """Split of the source; the ``train`` split of DataFrameBench, functions and functions_long is
    for training and refused here."""
    samples_per_task: int = Field(default=1, ge=1, le=64)
    """Independent agent sessions per task, K (paired by ``sample_index`` in the gate; the run
    summary reports pass@1, pass@K and best-of-K). Sized with ``tolerance`` by
    ``bench/gate_power.py`` (docs/gate.md)."""
    limit: int | None = Field(default=None, ge=1)
    """Maximum number of tasks (a seeded subset); None runs every task."""
    seed: int = 0
    """Seed of the task subset and of per-sample sampling seeds."""
    budget: BudgetConfig = BudgetConfig()
    """Agent turn and token budgets."""
    sampling: SamplingConfig = SamplingConfig()
    """Decoding parameters."""
    grading: GradingConfig = GradingConfig()
    """Hidden-test sandbox limits."""

    @model_validator(mode="after")
    def _no_training_split(self) -> "SuiteConfig":
        if self.source in ("dataframebench", "functions", "functions_long") and self.split == "train":
            raise ValueError(f"{self.source}'s train split is for training; evaluate on a held-out split")
        return self

    def with_limit(self, limit: int | None) -> "SuiteConfig":
        """A copy with another task limit (``None`` keeps the suite's own)."""
        return self if limit is None else self.model_copy(update={"limit": limit})

    def with_overrides(
        self,
        *,
        limit: int | None = None,
        max_turns: int | None = None,
        max_tokens_per_turn: int | None = None,
        samples_per_task: int | None = None,
        temperature: float | None = None,
    ) -> "SuiteConfig":
        """A validated copy with a task limit, another number of samples per task, another sampling
        temperature and/or smaller budgets (smoke runs on a CPU; the gate's ``samples``; a gate on
        fewer samples than the suite was sized for has less power).

        ``max_tokens_per_turn`` also caps the session budget at ``max_turns * max_tokens_per_turn``.
        """
        budget = self.budget.model_dump()
        if max_turns is not None:
            budget["max_turns"] = max_turns
        if max_tokens_per_turn is not None:
            budget["max_tokens_per_turn"] = max_tokens_per_turn
            budget["max_completion_tokens"] = min(
                budget["max_completion_tokens"], budget["max_turns"] * max_tokens_per_turn
            )
        data = self.model_dump()
        data["budget"] = budget
        if limit is not None:
            data["limit"] = limit
        if samples_per_task is not None:
            data["samples_per_task"] = samples_per_task
        if temperature is not None:
            data["sampling"] = {**data["sampling"], "temperature": temperature}
        return SuiteConfig.model_validate(data)

    def fingerprint(self, task_keys: list[str]) -> str:
        """The effective suite version: ``<version>-<12 hex>`` over the resolved config and the
        ordered task keys (task id plus content hash), so results are cached only for an identical
        plan (``eval_run.suite_version``)."""
        blob = json.dumps({"config": self.model_dump(mode="json"), "tasks": task_keys}, sort_keys=True)
        return f"{self.version}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def suite_path(name: str, suites_dir: Path | None = None) -> Path:
    """The TOML file of suite ``name``."""
    return (suites_dir or SUITES_DIR) / f"{name}.toml"


def load_suite(name_or_path: str | Path, suites_dir: Path | None = None) -> SuiteConfig:
    """Load a suite by name (``evals/suites/<name>.toml``) or by path.

    Raises:
        ConfigurationError: no such suite, or the TOML is invalid.
    """
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = suite_path(str(name_or_path), suites_dir)
    if not path.exists():
        known = ", ".join(list_suites(suites_dir)) or "none"
        raise ConfigurationError(f"unknown suite {name_or_path!r} (known: {known})")
    data = tomllib.loads(path.read_text())
    data.setdefault("name", path.stem)
    try:
        return SuiteConfig.model_validate(data)
    except ValueError as exc:
        raise ConfigurationError(f"invalid suite {path.name}: {exc}") from None


def list_suites(suites_dir: Path | None = None) -> list[str]:
    """Names of the shipped (or given directory's) suites, sorted."""
    d = suites_dir or SUITES_DIR
    return sorted(p.stem for p in d.glob("*.toml")) if d.exists() else []


# ---- gate ----------------------------------------------------------------------------------------


class MonitorBound(_Strict):
    """A behaviour monitor: how far the candidate may drift from production in the bad direction.

    The allowed drift is ``max(abs_tolerance, rel_tolerance * |production|)`` over the tolerances
    that are set (an absolute tolerance keeps a relative bound from tripping on a tiny baseline);
    ``limit`` is an absolute bound on the candidate's own value (a ceiling when ``worse`` is
    ``increase``, a floor when ``decrease``). Which drift is compared, the observed one or its
    confidence bound, is :attr:`GateConfig.monitor_rule`.
    """

    metric: MonitorName
    """Which behaviour statistic (see ``evals.gate.monitor_values``)."""
    worse: Literal["increase", "decrease"] = "increase"
    """The direction that is a regression (e.g. ``decrease`` for the edit rate)."""
    abs_tolerance: float | None = Field(default=None, ge=0)
    """Allowed drift in the metric's own unit (a rate, tokens, seconds)."""
    rel_tolerance: float | None = Field(default=None, ge=0)
    """Allowed drift as a fraction of production's value."""
    limit: float | None = None
    """Absolute bound on the candidate's value regardless of production."""

    @model_validator(mode="after")
    def _some_bound(self) -> "MonitorBound":
        if self.abs_tolerance is None and self.rel_tolerance is None and self.limit is None:
            raise ValueError(f"monitor {self.metric}: set abs_tolerance, rel_tolerance or limit")
        return self


class SuiteGate(_Strict):
    """Per-suite gate settings; unset fields fall back to the gate-wide defaults."""

    gated: bool = True
    """Whether this suite decides the gate (ungated suites are reported only)."""
    tolerance: float | None = Field(default=None, ge=0, le=1)
    """Non-inferiority margin (pass-rate points as a fraction, 0.02 = 2 points): the suite fails when
    the lower confidence bound of pass@1(candidate) - pass@1(production) is at or below
    ``-tolerance``. Not the regression the gate must detect: with standard error ``se`` of the
    difference, an equal candidate fails with probability about ``Phi(1.645 - tolerance / se)``, so
    the margin and the suite size are chosen together (docs/gate.md, ``bench/gate_power.py``)."""
    floor: float = Field(default=0.0, ge=0, le=1)
    """Absolute minimum pass rate of the candidate."""
    min_pairs: int | None = Field(default=None, ge=1)
    """Fewest paired (task, sample) outcomes that can support a decision."""
    allow_empty: bool = False
    """When the suite's plan holds no task on both sides (e.g. ``mined`` before any task was mined)
    or neither side ran it, the suite is ``not_gated`` (reported, never a pass); otherwise an empty
    suite is insufficient evidence and a suite missing on one side fails."""
    samples: int | None = Field(default=None, ge=1, le=64)
    """k: samples per task the gate runs this suite at, paired by sample index and clustered with
    their task's template (``cluster_by``). Above 1 the samples are drawn at
    :attr:`GateConfig.serving_temperature` (greedy samples would be identical); 1 runs the suite's
    own decoding once; None keeps the suite's ``samples_per_task`` and sampling. The power reported
    beside each decision is for the plan's k x tasks pairs (docs/gate.md sizes k)."""
    role: Literal["guardrail", "success"] = "guardrail"
    """How the suite enters the decision (Spotify Confidence's rule, Schultzberg et al. 2024): a
    ``guardrail`` passes when its lower bound clears ``-tolerance`` (significantly non-inferior); a
    ``success`` suite passes only when its lower bound is above 0 (significantly better). The gate
    passes when every gated guardrail passes and, if any success suite is gated, at least one
    success suite passes."""


ONLINE_SIGNALS = (
    "edit_acceptance",
    "edit_persistence",
    "dissatisfied_followup_rate",
    "latency_per_token",
    "mean_reward",
)


class OnlinePolicy(_Strict):
    """``[online]``: whether promotion also needs a canary whose online signals did not regress.

    The gate stores this resolved with its decision; ``app.lifecycle.changes`` reads it from there
    (``app.lifecycle.online_stats.OnlinePolicy``), so the policy in force is the one the candidate
    was gated under. A signal regresses when the whole per-user clustered interval of
    (canary - production) lies on its bad side (Deng et al. 2018 delta method)."""

    required: bool = False
    """Refuse promotion without such a canary (fail closed: no canary, too few sessions, or a
    signal that cannot be compared yet all refuse)."""
    min_sessions: int = Field(default=100, ge=2)
    """Fewest finalized sessions on EACH arm before the comparison can allow a promotion."""
    signals: list[Literal[ONLINE_SIGNALS]] = Field(default_factory=lambda: list(ONLINE_SIGNALS))  # type: ignore[valid-type]
    """Signals that must not regress significantly."""
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
    """Two-sided level of each signal's interval."""


class GateConfig(_Strict):
    """The promotion gate: statistical non-inferiority, floors and behaviour monitors."""

    method: Literal["newcombe", "bootstrap", "mcnemar"] = "newcombe"
    """Interval for the paired difference. ``newcombe``: Newcombe's (1998) paired score interval,
    which keeps its coverage at small n and at rates near 0 or 1; with several samples per task,
    the wider of it and the task-clustered bootstrap (which carries the clustering). ``bootstrap``:
    the task-clustered percentile bootstrap alone (zero width when no pair is discordant).
    ``mcnemar``: the exact conditional interval (Clopper-Pearson on discordant pairs)."""
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
    """Confidence level of the interval."""
    two_sided: bool = False
    """False: the lower bound is one-sided at ``confidence`` (a non-inferiority test at level
    1 - confidence); True: the lower end of a two-sided interval (stricter)."""
    tolerance: float = Field(default=0.02, ge=0, le=1)
    """Default non-inferiority margin: pass if lower bound of (candidate - production) > -tolerance
    (see :attr:`SuiteGate.tolerance` for how it relates to suite size and power)."""
    bootstrap_resamples: int = Field(default=10_000, ge=200, le=1_000_000)
    """Bootstrap replicates (B)."""
    seed: int = 0
    """Seed of the bootstrap (with the suite name, so each suite's stream is fixed)."""
    min_pairs: int = Field(default=1, ge=1)
    """Default fewest paired outcomes per suite."""
    min_power: float = Field(default=0.8, ge=0, le=1)
    """The design power (:mod:`evals.power`: the probability that an equal candidate clears the
    margin, at the observed pairs and production's rate). Reported with each suite and never
    withholds a pass whose interval clears the margin; it decides only what an interval that reaches
    below the margin means: ``fail`` on a suite with this power, ``insufficient_evidence`` below it."""
    cluster_by: Literal["template", "task"] = "template"
    """The unit the bootstrap interval and the confidence sequence resample: ``template`` clusters
    the tasks generated from one template (``evals.tasks.functions.template_of``; other tasks are
    their own cluster), ``task`` clusters only the samples of one task."""
    decide_by: Literal["interval", "sequential"] = "interval"
    """Which bounds decide. ``interval``: the fixed-n interval of ``method``, valid when the suite is
    looked at once, complete. ``sequential``: the confidence sequence (``sequence``) over clusters
    in a seeded random order (:mod:`evals.sequential`), which may decide before the last
    cluster (``stopped_at_pairs``); both are always reported."""
    early_stop: bool = False
    """Stop a gated suite's candidate run as soon as its confidence sequence decides (its lower bound
    clears the threshold, or its upper bound falls below 0): the runner runs the candidate's samples
    cluster by cluster in the sequence's seeded order against production's complete run, and the
    gate decides the stopped run's prefix by the sequence (``stopped_at_pairs``, ``run_stopped``).
    Needs ``decide_by = "sequential"``: the fixed-n interval read after looks along the way loses its
    level. Off, or with sharded eval runs (``FLYWHEEL_EVAL_SHARDS`` > 1), every run is complete."""
    sequence: Literal["normal_mixture", "betting"] = "normal_mixture"
    """The confidence sequence (:mod:`evals.sequential`): ``normal_mixture``, asymptotic and tuned to
    the suite's cluster count (usable at tens of clusters); ``betting``, exact at every n and about
    three times as wide at 21 clusters."""
    sequence_burn_in: int = Field(default=10, ge=1)
    """Clusters before the normal-mixture sequence takes its first look."""
    serving_temperature: float = Field(default=0.7, gt=0.0)
    """Temperature of a suite's samples when its gate runs it at ``samples`` > 1: the temperature
    production serves at (``app.inference.engine.SamplingParams`` and the simulator's default), so
    the k samples estimate what users get."""
    power_sims: int = Field(default=20_000, ge=100, le=1_000_000)
    """Simulated tables behind each power figure (seeded with ``seed``)."""
    max_error_fraction: float = Field(default=0.0, ge=0, le=1)
    """Largest fraction of samples whose session errored (harness/infrastructure) before the gate
    fails closed for that suite."""
    suites: dict[str, SuiteGate] = Field(default_factory=dict)
    """Suites by name; every suite with ``gated = true`` must have paired results to pass."""
    monitors: list[MonitorBound] = Field(default_factory=list)
    """Behaviour monitors applied to every gated suite."""
    online: OnlinePolicy = Field(default_factory=OnlinePolicy)
    """The online (canary) requirement of promotion."""
    monitor_rule: Literal["significant", "point"] = "significant"
    """When a monitor breaches. ``significant``: the lower confidence bound (at ``confidence``,
    one- or two-sided as ``two_sided``; task-clustered bootstrap of the paired outcomes) of the drift
    in the bad direction is above the allowed drift, i.e. the data show a regression beyond the
    allowance rather than noise (a guardrail test). ``point``: the observed drift is above it, which
    fails an unchanged checkpoint often on few pairs (at 20 pairs the edit rate's paired drift has a
    standard error near 10 points). ``p90_latency_s`` and ``limit`` always use the point value."""

    @model_validator(mode="after")
    def _early_stop_reads_the_sequence(self) -> "GateConfig":
        if self.early_stop and self.decide_by != "sequential":
            raise ValueError(
                'early_stop needs decide_by = "sequential": a fixed-n interval read after the sequence '
                "looked along the way is no longer at its level"
            )
        return self

    def with_min_pairs(self, min_pairs: int | None) -> "GateConfig":
        """A copy whose every suite needs ``min_pairs`` paired outcomes (smoke runs on few tasks);
        None keeps the policy. The resolved config is stored with each decision."""
        if min_pairs is None:
            return self
        suites = {n: s.model_copy(update={"min_pairs": min_pairs}) for n, s in self.suites.items()}
        return self.model_copy(update={"min_pairs": min_pairs, "suites": suites})

    def gating_only(self, names: list[str] | None) -> "GateConfig":
        """A copy in which only ``names`` decide the gate (every other suite is reported only); None
        keeps the policy. An explicit narrowing (smoke runs, a bench on one suite), stored with the
        decision like every resolved config.

        Raises:
            ConfigurationError: a name the policy has no suite for.
        """
        if names is None:
            return self
        unknown = sorted(set(names) - set(self.suites))
        if unknown:
            raise ConfigurationError(f"the gate policy has no suite {', '.join(unknown)}")
        suites = {n: s.model_copy(update={"gated": n in names}) for n, s in self.suites.items()}
        return self.model_copy(update={"suites": suites})

    def plan_suite(self, suite: SuiteConfig) -> SuiteConfig:
        """The suite as the gate runs it: at this policy's ``samples`` for it (sampled at
        ``serving_temperature`` when above 1), else unchanged."""
        k = self.suites.get(suite.name, SuiteGate()).samples
        if k is None:
            return suite
        return suite.with_overrides(samples_per_task=k, temperature=self.serving_temperature if k > 1 else None)

    def gated_suites(self) -> list[str]:
        """Names of the suites that decide the gate, sorted."""
        return sorted(n for n, s in self.suites.items() if s.gated)

    def for_suite(self, name: str) -> SuiteGate:
        """The resolved settings of one suite (defaults filled in)."""
        s = self.suites.get(name, SuiteGate())
        return s.model_copy(
            update={
                "tolerance": self.tolerance if s.tolerance is None else s.tolerance,
                "min_pairs": self.min_pairs if s.min_pairs is None else s.min_pairs,
            }
        )


def load_gate_config(path: Path | None = None) -> GateConfig:
    """Load the gate policy (default: the shipped ``evals/gate.toml``).

    Raises:
        ConfigurationError: missing file or invalid TOML.
    """
    path = path or GATE_TOML
    if not path.exists():
        raise ConfigurationError(f"gate config {path} not found")
    try:
        return GateConfig.model_validate(tomllib.loads(path.read_text()))
    except ValueError as exc:
        raise ConfigurationError(f"invalid gate config {path.name}: {exc}") from None


# ---- automation ----------------------------------------------------------------------------------


class EvalSettings(BaseSettings):
    """How the Celery automation gates candidates (``FLYWHEEL_EVAL_*``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_EVAL_", extra="ignore")
    gate_config: Path | None = None
    """Gate policy TOML; default the shipped ``evals/gate.toml``."""
    limit: int | None = Field(default=None, ge=1)
    """Task limit per suite for automated gates (None: the suites' own)."""
    workers: int | None = Field(default=None, ge=1)
    """Concurrent sessions per run of an automated gate; None: the engine's default (64 on a vLLM
    server, which batches concurrent requests; ``evals.runner.default_workers``)."""
    max_turns: int | None = Field(default=None, ge=1)
    """Turn budget override (smoke deployments on CPUs)."""
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    """Per-turn completion token override."""
    scan_batch: int = Field(default=1, ge=1)
    """Candidates dispatched per beat scan."""
    min_pairs: int | None = Field(default=None, ge=1)
    """Override every suite's ``min_pairs`` (smoke deployments with a small ``limit``)."""
    gate_on: list[str] | None = None
    """Run and decide the automated gate on these suites only (JSON list, e.g. ``["functions"]``);
    None: every gated suite of the policy. The narrowing is stored with each decision."""
    shards: int = Field(default=1, ge=1)
    """Shards per eval run (``evals.shards``): 1 runs each run in the gating worker; N > 1 splits
    its tasks into N shards that every Celery worker (the gating one included) claims."""
    shard_timeout_s: float = Field(default=120.0, gt=0)
    """A running shard whose heartbeat is older than this (seconds) is presumed lost and re-queued."""
    shard_heartbeat_s: float = Field(default=10.0, gt=0)
    """Seconds between a running shard's heartbeats (well under ``shard_timeout_s``)."""
    shard_attempts: int = Field(default=3, ge=1)
    """Lost claims per shard before the run gives it up as failed (a rerun retries it)."""


def eval_settings() -> EvalSettings:
    """The ``FLYWHEEL_EVAL_*`` settings (environment, then the local stack's env file)."""
    return EvalSettings(_env_file=(flywheel_home() / "stack.env",))  # type: ignore[call-arg]
