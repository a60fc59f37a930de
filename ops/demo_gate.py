"""The held-out gate's plan in the demo and the bench: the shipped one (``evals/gate.toml``, sized),
or under ``--gate-samples K`` a smaller one written as the loop's gate policy file, whose line and
JSON say UNDERPOWERED (``evals.gate.plans``; docs/gate.md).

Invariant: the demo runs a smaller plan than the policy's only when asked (``gate_samples``), and
then every plan line it prints comes from that smaller plan's :class:`~evals.gate.plans.PlanPower`.
"""

from __future__ import annotations

from pathlib import Path

from evals.config import load_suite
from evals.gate.plans import PlanPower, plan_power, policy_toml, smaller_plan
from evals.gate.policy import load_gate_config
from evals.tasks import load_tasks

GATED_SUITE = "functions"  # the held-out suite whose plan --gate-samples makes smaller


def _policy(gate_config: str | None) -> Path | None:
    return Path(gate_config).resolve() if gate_config else None


def _tasks(eval_tasks: int | None) -> int:
    return eval_tasks or len(load_tasks(GATED_SUITE, "test"))


def smaller_gate_file(
    home: Path, gate_config: str | None, gate_samples: int | None, eval_tasks: int | None
) -> Path | None:
    """With ``gate_samples``, the gate policy file of the smaller plan (from ``gate_config``, else
    the shipped policy), written under ``home`` and checked to load back; else None.

    Raises:
        ConfigurationError: the written policy does not load back.
    """
    if gate_samples is None:
        return None
    smaller = smaller_plan(load_gate_config(_policy(gate_config)), GATED_SUITE, gate_samples, _tasks(eval_tasks))
    path = home / "demo" / "gate.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        policy_toml(smaller, f"A smaller plan than the shipped gate's ({GATED_SUITE} at k = {gate_samples}).")
    )
    load_gate_config(path)
    return path


def gate_plan(
    home: Path, gate_config: str | None, gate_samples: int | None, eval_tasks: int | None
) -> tuple[Path | None, PlanPower]:
    """The smaller plan's file (:func:`smaller_gate_file`, None without ``gate_samples``) and the plan
    the loop's held-out gate runs, with its power: its line says UNDERPOWERED below the design power."""
    path = smaller_gate_file(home, gate_config, gate_samples, eval_tasks)
    config = load_gate_config(path or _policy(gate_config))
    own = load_suite(GATED_SUITE).samples_per_task
    return path, plan_power(config, GATED_SUITE, _tasks(eval_tasks), load_gate_config(), own_samples=own)
