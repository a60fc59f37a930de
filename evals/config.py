"""Typed configs of the eval side: suites (``evals/suites/*.toml``) and the automation's settings;
the gate's (``evals/gate.toml``) are :mod:`evals.gate.policy`.

Invariant: every knob that changes which tasks run or how they are scored lives in a validated,
``extra="forbid"`` model, and a suite's *effective version* (:func:`SuiteConfig.fingerprint`)
changes whenever any of those knobs change, so cached results are never reused across a change.
Hand-written TOML in, resolved JSON out (stored in ``eval_run.config`` and gate reports).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.errors import ConfigurationError
from app.core.settings import flywheel_home

SUITES_DIR = Path(__file__).parent / "suites"


class StrictConfig(BaseModel):
    """A config model that refuses unknown keys and is immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- suites --------------------------------------------------------------------------------------


class BudgetConfig(StrictConfig):
    """Per-session agent budget (mirrors ``evals.harness.agent.AgentBudget``)."""

    max_turns: int = Field(default=8, ge=1)
    """Model turns before the session is cut off."""
    max_completion_tokens: int = Field(default=2048, ge=1)
    """Completion tokens over the whole session (tokens)."""
    context_tokens: int = Field(default=4096, ge=256)
    """Context window the harness keeps before it self-summarizes (tokens)."""
    max_tokens_per_turn: int = Field(default=512, ge=1)
    """Completion tokens of one model turn (tokens)."""


class SamplingConfig(StrictConfig):
    """Decoding for eval sessions (mirrors ``app.inference.engine.SamplingParams``)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """0 means greedy. With ``samples_per_task`` > 1 use the serving temperature (0.7,
    ``app.inference.engine.SamplingParams``): greedy samples are identical and add no information."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""


class GradingConfig(StrictConfig):
    """Sandbox limits for the hidden tests (mirrors ``evals.harness.sandbox.SandboxLimits``)."""

    timeout_s: float = Field(default=60.0, gt=0)
    """Wall-clock limit of one hidden-test run (seconds)."""
    memory_mb: int = Field(default=2048, ge=64)
    """Address-space limit of the test process (MiB)."""


class SandboxConfig(StrictConfig):
    """What a suite's sandboxed runs (the agent's ``run`` tool, the hidden tests) may import."""

    packages: tuple[str, ...] = ()
    """Distributions importable besides the standard library, with their requirement closure
    (``evals.harness.environment.allowed_environment``); empty: the standard library only. A mined
    task's own environment is added to it. Not installed here: left out (tests importing it fail)."""


class SuiteConfig(StrictConfig):
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
    summary reports pass@1, pass@K and best-of-K). Sized with ``margin`` by
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
    sandbox: SandboxConfig = SandboxConfig()
    """The sandbox's allow-list (``[sandbox] packages``)."""

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


@lru_cache(maxsize=16)
def source_packages(source: str, suites_dir: Path | None = None) -> tuple[str, ...]:
    """The sandbox allow-list of ``source``'s tasks outside a suite (training sessions, the A/B, a
    reference check): every package the suites of that source allow (sorted; empty when none; read
    once per process).

    Raises:
        ConfigurationError: a suite's TOML is invalid.
    """
    names: set[str] = set()
    for name in list_suites(suites_dir):
        suite = load_suite(name, suites_dir)
        if suite.source == source:
            names.update(suite.sandbox.packages)
    return tuple(sorted(names))


def list_suites(suites_dir: Path | None = None) -> list[str]:
    """Names of the shipped (or given directory's) suites, sorted."""
    d = suites_dir or SUITES_DIR
    return sorted(p.stem for p in d.glob("*.toml")) if d.exists() else []


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
    """Override every suite's ``min_pairs`` and set its floor to 0 (smoke deployments with a small
    ``limit``: a floor holds its 1 % refusal of an equal candidate only at the suite's full size)."""
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
    return EvalSettings(_env_file=(flywheel_home() / "stack.env",))
