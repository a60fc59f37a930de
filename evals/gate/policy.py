"""The promotion gate's typed policy (``evals/gate.toml``): per-suite margins, floors, roles,
behaviour monitors and the ``[online]`` canary requirement.

Invariant: every knob that changes a gate decision lives in a validated, ``extra="forbid"`` model;
the resolved policy is stored with each decision (``GateResult.config``), so a decision can be
re-read under the policy it was made by.
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import tomlkit
from pydantic import Field, model_validator
from tomlkit.items import Comment, Table, Whitespace

from app.core.errors import ConfigurationError
from evals.config import StrictConfig, SuiteConfig

GATE_TOML = Path(__file__).parents[1] / "gate.toml"

MonitorName = Literal[
    "invalid_tool_call_rate",
    "clarifying_question_rate",
    "edit_rate",
    "mean_completion_tokens",
    "mean_latency_s",
    "p90_latency_s",
    "sandbox_denial_rate",
]


class MonitorBound(StrictConfig):
    """A behaviour monitor: how far the candidate may drift from production in the bad direction.

    The allowed drift is ``max(abs_tolerance, rel_tolerance * |production|)`` over the margins
    that are set (an absolute tolerance keeps a relative bound from tripping on a tiny baseline);
    ``limit`` is an absolute bound on the candidate's own value (a ceiling when ``worse`` is
    ``increase``, a floor when ``decrease``). Which drift is compared, the observed one or its
    confidence bound, is :attr:`GateConfig.monitor_rule`.
    """

    metric: MonitorName
    """Which behaviour statistic (see ``evals.gate.monitors.monitor_values``)."""
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


def refuse_tolerance(data: Any) -> Any:
    """Refuse the margin's former name (before validation), naming the key to rename.

    Raises:
        ValueError: ``data`` is a mapping with a ``tolerance`` key.
    """
    if isinstance(data, Mapping) and "tolerance" in data:
        raise ValueError(
            "`tolerance` is now `margin` (the non-inferiority margin, same meaning and units): "
            "rename the key in the gate policy"
        )
    return data


class SuiteGate(StrictConfig):
    """Per-suite gate settings; unset fields fall back to the gate-wide defaults."""

    _refuse_tolerance = model_validator(mode="before")(refuse_tolerance)

    gated: bool = True
    """Whether this suite decides the gate (ungated suites are reported only)."""
    margin: float | None = Field(default=None, ge=0, le=1)
    """Non-inferiority margin (pass-rate points as a fraction, 0.02 = 2 points): the suite fails when
    the lower confidence bound of pass@1(candidate) - pass@1(production) is at or below
    ``-margin``. Not the regression the gate must detect: with standard error ``se`` of the
    difference, an equal candidate fails with probability about ``Phi(1.645 - margin / se)``, so
    the margin and the suite size are chosen together (docs/gate.md, ``bench/gate_power.py``)."""
    floor: float = Field(default=0.0, ge=0, le=1)
    """Absolute minimum pass rate of the candidate (its passed samples over its paired ones): a
    backstop below the non-inferiority test, derived from production's measured outcomes so that
    an equal candidate falls below it at most 1 % of the time (:mod:`evals.gate.floors`,
    ``flywheel eval floors``)."""
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
    check: Literal["non_inferiority", "deterioration"] = "non_inferiority"
    """Which test a guardrail's interval gets. ``non_inferiority``: it passes when the lower bound
    clears ``-margin`` (the suite is sized for it: docs/gate.md). ``deterioration``: it fails only
    when the whole interval lies below 0 (the candidate is significantly worse), and otherwise its
    floor and monitors decide: the form of a guardrail that cannot be powered (Schultzberg et al.
    2024's deterioration metrics), for a suite where production's pass rate is too low for any
    candidate, even an identical one, to clear a margin (DataFrameBench for SmolLM2-135M: 0/100 gives
    an identical candidate a bound of -2.6 points), or a suite still growing (``mined``). No power is
    reported for it. Only a guardrail takes it."""
    role: Literal["guardrail", "success"] = "guardrail"
    """How the suite enters the decision (Spotify Confidence's rule, Schultzberg et al. 2024): a
    ``guardrail`` passes when its lower bound clears ``-margin`` (significantly non-inferior); a
    ``success`` suite passes only when its lower bound is above 0 (significantly better). The gate
    passes when every gated guardrail passes and, if any success suite is gated, at least one
    success suite passes."""

    @model_validator(mode="after")
    def _deterioration_is_a_guardrail(self) -> "SuiteGate":
        if self.check == "deterioration" and self.role != "guardrail":
            raise ValueError(
                "check = 'deterioration' is a guardrail's test; a success suite needs its superiority test"
            )
        return self


ONLINE_SIGNALS = (
    "edit_acceptance",
    "edit_persistence",
    "dissatisfied_followup_rate",
    "latency_per_token",
    "mean_reward",
)


class OnlinePolicy(StrictConfig):
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


class GateConfig(StrictConfig):
    """The promotion gate: statistical non-inferiority, floors and behaviour monitors."""

    _refuse_tolerance = model_validator(mode="before")(refuse_tolerance)

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
    margin: float = Field(default=0.02, ge=0, le=1)
    """Default non-inferiority margin: pass if lower bound of (candidate - production) > -margin
    (see :attr:`SuiteGate.margin` for how it relates to suite size and power)."""
    bootstrap_resamples: int = Field(default=10_000, ge=200, le=1_000_000)
    """Bootstrap replicates (B)."""
    seed: int = 0
    """Seed of the bootstrap (with the suite name, so each suite's stream is fixed)."""
    min_pairs: int = Field(default=1, ge=1)
    """Default fewest paired outcomes per suite."""
    min_power: float = Field(default=0.8, ge=0, le=1)
    """The design power (:mod:`evals.gate.power`: the probability that an equal candidate clears the
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
    in a seeded random order (:mod:`evals.gate.sequential`), which may decide before the last
    cluster (``stopped_at_pairs``); both are always reported."""
    early_stop: bool = False
    """Stop a gated suite's candidate run as soon as its confidence sequence decides (its lower bound
    clears the threshold, or its upper bound falls below 0): the runner runs the candidate's samples
    cluster by cluster in the sequence's seeded order against production's complete run, and the
    gate decides the stopped run's prefix by the sequence (``stopped_at_pairs``, ``run_stopped``).
    Needs ``decide_by = "sequential"``: the fixed-n interval read after looks along the way loses its
    level. Off, or with sharded eval runs (``FLYWHEEL_EVAL_SHARDS`` > 1), every run is complete."""
    sequence: Literal["normal_mixture", "betting"] = "normal_mixture"
    """The confidence sequence (:mod:`evals.gate.sequential`): ``normal_mixture``, asymptotic and tuned to
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
        """A copy whose every suite needs ``min_pairs`` paired outcomes and has no floor (smoke runs
        on few tasks); None keeps the policy. A floor holds its 1 % refusal of an equal candidate
        only at the suite size it was derived at (:mod:`evals.gate.floors`): on 4 pairs a 8.5 % floor
        refuses a candidate that, like production, solves none. The resolved config is stored with
        each decision."""
        if min_pairs is None:
            return self
        suites = {n: s.model_copy(update={"min_pairs": min_pairs, "floor": 0.0}) for n, s in self.suites.items()}
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
                "margin": self.margin if s.margin is None else s.margin,
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


def _comment_column(table: Table) -> int:
    """The column the comments of ``table``'s keys start at (the first commented key's), else 30."""
    for key, item in table.value.body:
        if key is not None and item.trivia.comment:
            return len(f"{key.as_string().strip()} = {item.as_string()}") + len(item.trivia.comment_ws)
    return 30


def _continuations(table: Table, at: int) -> int:
    """How many indented comment lines (a key's comment continued) start at body index ``at``."""
    body = table.value.body
    n = 0
    while at + n < len(body) and body[at + n][0] is None:
        item = body[at + n][1]
        if not (isinstance(item, Comment) and item.trivia.indent):
            break
        n += 1
    return n


def _after_last_key(table: Table) -> int:
    """Where a new key goes in ``table``: after its last key and that key's continued comment,
    before a blank line or the comments that introduce what follows (appending would put it below
    those)."""
    at = max(i for i, (key, _) in enumerate(table.value.body) if key is not None) + 1
    return at + _continuations(table, at)


def write_floors(path: Path, floors: Mapping[str, tuple[float, str]]) -> None:
    """Set ``[suites.NAME] floor`` of each named suite in the policy file at ``path`` to its value,
    with its comment (where the number comes from) on that line; every other line, comment and
    key order stays as it was (tomlkit round-trips the rest byte for byte). Written to a temporary
    file in the same folder and renamed over ``path`` only after the result validates.

    Args:
        path: a gate policy TOML (``evals/gate.toml`` or the configured ``FLYWHEEL_EVAL_GATE_CONFIG``).
        floors: ``suite -> (floor, comment)``; every suite must have a ``[suites.NAME]`` table.

    Raises:
        ConfigurationError: a missing or invalid file, a suite without its table, or a result that
            does not validate as a :class:`GateConfig`.
    """
    if not path.exists():
        raise ConfigurationError(f"gate config {path} not found")
    try:
        doc = tomlkit.parse(path.read_text())
    except tomlkit.exceptions.ParseError as exc:
        raise ConfigurationError(f"invalid gate config {path.name}: {exc}") from None
    suites = doc.get("suites")
    for name, (floor, comment) in floors.items():
        table = suites.get(name) if suites is not None else None
        if not isinstance(table, Table):
            raise ConfigurationError(f"gate config {path.name} has no [suites.{name}] table")
        old = table.get("floor")
        item = tomlkit.item(float(floor))
        if old is not None:
            item.trivia.indent = old.trivia.indent
        item.comment(comment)
        item.trivia.comment_ws = " " * max(1, _comment_column(table) - len(f"floor = {item.as_string()}"))
        if old is not None:
            table["floor"] = item
            body = table.value.body
            at = next(i for i, (key, _) in enumerate(body) if key is not None and key.key == "floor") + 1
            for i in range(at, at + _continuations(table, at)):  # the old comment's further lines
                body[i] = (None, Whitespace(""))  # in place: the container's key index stays right
        elif (at := _after_last_key(table)) < len(table.value.body):
            table.value._insert_at(at, "floor", item)  # noqa: SLF001 - tomlkit has no public insert
        else:
            table["floor"] = item
    text = tomlkit.dumps(doc)
    try:
        GateConfig.model_validate(tomllib.loads(text))
    except ValueError as exc:
        raise ConfigurationError(f"the floors would make {path.name} invalid: {exc}") from None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, path.stat().st_mode)
    os.replace(tmp, path)
