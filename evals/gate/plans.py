"""A gated suite's plan (tasks x k samples at the serving temperature), its power, and the smaller
plan a demo or a bench may run to fit its time, which says it is underpowered.

The shipped plan (``evals/gate.toml``) meets the project's sizing rule (``bench/gate_power.py``,
docs/gate.md): power >= ``min_power`` (0.8) to tell an equal candidate from one a margin worse, on
the held-out ``functions`` suite k = 8 samples a task at the serving temperature, 896 pairs (power
0.82 at production's 16.5 %). A smaller plan (fewer samples, :func:`smaller_plan`, rendered as a
policy file by :func:`policy_toml`) has a :class:`PlanPower` whose line says UNDERPOWERED wherever it
is shown, so no output of a smaller plan reads like the shipped gate's.

Invariant: pure, like the rest of the gate (the caller writes the file); the smaller plan differs
from the policy it comes from in that suite's ``samples`` and ``min_pairs`` only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import tomlkit

from app.core.errors import ConfigurationError
from evals.gate.policy import GateConfig, SuiteGate
from evals.gate.power import non_inferiority_power

HELD_OUT_BASE_RATE = 0.165
"""Base's pass rate on the held-out ``functions`` tasks at the serving temperature (T = 0.7;
docs/gate.md), the rate the held-out plan's power is stated at."""


@dataclass(frozen=True)
class PlanPower:
    """How one gated suite is planned and how much power that plan has.

    Attributes:
        suite: the suite's name.
        samples: k, samples per task of the plan.
        tasks: tasks of the plan.
        pairs: ``tasks * samples``.
        power: probability that an equal candidate's lower bound clears ``-margin`` (evals.gate.power).
        min_power: the policy's design power.
        margin: the suite's non-inferiority margin (pass-rate fraction, 0-1).
        shipped_samples: k of the shipped policy's plan for this suite.
        base_rate: production's pass rate the power is computed at.
    """

    suite: str
    samples: int
    tasks: int
    pairs: int
    power: float
    min_power: float
    margin: float
    shipped_samples: int
    base_rate: float

    @property
    def underpowered(self) -> bool:
        """Whether the plan falls short of the design power."""
        return self.power < self.min_power

    def line(self) -> str:
        """One line for a terminal or a log: the plan, its power and, below the design power,
        ``UNDERPOWERED`` and the shipped plan."""
        head = (
            f"gate plan {self.suite}: k = {self.samples} x {self.tasks} tasks ({self.pairs} pairs), power "
            f"{self.power:.2f} to tell an equal candidate from one {100 * self.margin:.1f} points worse"
        )
        if not self.underpowered:
            return f"{head} (design {self.min_power:.2f})"
        return (
            f"{head}: UNDERPOWERED (design {self.min_power:.2f}; the shipped plan runs k = "
            f"{self.shipped_samples}): a realistic bad update can pass this gate"
        )

    def rich_line(self) -> str:
        """:meth:`line` in rich markup: bold yellow when underpowered, dim otherwise."""
        return f"[{'bold yellow' if self.underpowered else 'dim'}]{self.line()}[/]"

    def as_dict(self) -> dict[str, object]:
        """The fields and ``underpowered``, for a JSON line."""
        return {**asdict(self), "underpowered": self.underpowered}


def suite_samples(config: GateConfig, suite: str, own_samples: int = 1) -> int:
    """k the policy runs ``suite`` at: its ``samples``, else ``own_samples`` (the suite's own
    ``samples_per_task``)."""
    k = config.suites.get(suite, SuiteGate()).samples
    return k if k is not None else own_samples


def plan_power(
    config: GateConfig,
    suite: str,
    tasks: int,
    shipped: GateConfig,
    *,
    own_samples: int = 1,
    base_rate: float = HELD_OUT_BASE_RATE,
) -> PlanPower:
    """The plan of ``suite`` under ``config`` at ``tasks`` tasks and its power at ``base_rate``;
    ``shipped`` is the shipped policy (``evals/gate.toml``), whose k the line names.

    Raises:
        ConfigurationError: the suite has no margin (a ``deterioration`` check is not sized).
    """
    k = suite_samples(config, suite, own_samples)
    margin = config.for_suite(suite).margin
    if margin is None:
        raise ConfigurationError(f"suite {suite} has no margin to size a plan against (check = deterioration)")
    power = non_inferiority_power(
        tasks * k,
        base_rate,
        margin,
        confidence=config.confidence,
        two_sided=config.two_sided,
        sims=config.power_sims,
        seed=config.seed,
    )
    return PlanPower(
        suite=suite,
        samples=k,
        tasks=tasks,
        pairs=tasks * k,
        power=power,
        min_power=config.min_power,
        margin=margin,
        shipped_samples=suite_samples(shipped, suite, own_samples),
        base_rate=base_rate,
    )


def smaller_plan(config: GateConfig, suite: str, samples: int, tasks: int) -> GateConfig:
    """``config`` with ``suite`` run at ``samples`` per task and ``min_pairs`` = ``tasks * samples``
    (so a truncated run still cannot pass on fewer pairs than this plan); nothing else changes."""
    current = config.suites.get(suite, SuiteGate())
    changed = current.model_copy(update={"samples": samples, "min_pairs": tasks * samples})
    return config.model_copy(update={"suites": {**config.suites, suite: changed}})


def policy_toml(config: GateConfig, note: str) -> str:
    """``config`` as a gate policy TOML (``load_gate_config`` reads it back to the same policy),
    headed by the comment ``note``."""
    return f"# {note}\n" + tomlkit.dumps(config.model_dump(mode="json", exclude_none=True))
