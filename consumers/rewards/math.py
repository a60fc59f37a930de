"""Reward math: a pure function from a trajectory's implicit signals to a scalar reward.

Invariant: ``compute_reward`` depends only on its arguments (no clock, no database), so a label is
reproducible from ``event_log`` by relabel and replay.

The reward is a sum of components, each off unless the spec turns it on, then clipped:

- ``edit_accepted``   ``+w * a / (a + r)``  with ``a``/``r`` the accepted/rejected edits
- ``edit_rejected``   ``-w * r / (a + r)``
- ``edit_persistence`` ``+w * (mean_p - baseline)`` over accepted edits whose persistence was
  measured (``p`` = fraction of the edit still present later, the strongest implicit signal: an
  accepted edit the developer rewrote did not help). With ``zero_if_not_kept`` each rejected edit
  adds a 0 to the mean and a session with no decided edit scores ``p = (0,)``: the share of what
  the model proposed that the developer kept, a session that proposed nothing keeping nothing
- ``dissatisfied_followups`` ``-w * min(n, cap)``
- ``latency``         ``-w * min(max(0, L - free_s) / scale_s, max_units)`` with ``L`` serving seconds
- ``length``          ``-c * log1p(T / s)`` or ``-c * sqrt(T / s)`` with ``T`` completion tokens. Concave:
  the marginal cost ``c / (s + T)`` (log1p) falls as ``T`` grows, so short answers to easy tasks
  are pushed shorter while a hard task that needs a long trajectory is not punished per extra
  token as hard as a linear penalty would (Cursor, "Composer: building a fast frontier model with
  RL", 2025, on a nonlinear length penalty). With ``difficulty`` on, times the task's weight
  ``w = max(p, floor)``, ``p`` the posterior mean of the task's solve rate over its earlier
  trajectories (``consumers.rewards.difficulty``): ``-c * w * log1p(T / s)``. An easy task (``p``
  near 1) pays the most per token, a hard one (``p`` near 0) down to ``floor``, so length is cut
  where it is not needed and left alone where it is. This is the Adaptive Length Penalty (Xiang et
  al., "Just Enough Thinking: Efficient Reasoning with Adaptive Length Penalties Reinforcement
  Learning", 2025, arXiv 2506.05256): ``r = 1[correct] - (beta / N) * max(p_solved, 1 / K) * |y|``
  with ``p_solved`` the prompt's solve rate over ``K`` rollouts. Here ``p`` comes from the task's
  finalized trajectories (the loop's own history) rather than a group of fresh rollouts, with a
  Beta prior for tasks seen rarely or never, ``floor`` takes the place of ``1 / K``, and the
  concave ``log1p`` shape of the plain penalty is kept.
- ``test_outcome``    ``+w`` last test run passed, ``-w`` failed, 0 without a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from consumers.rewards.difficulty import TaskHistory, solve_rate
from consumers.rewards.spec import Length, RewardSpec


@dataclass(frozen=True)
class RewardInputs:
    """What a reward can see about one trajectory.

    Attributes:
        accepted: edits whose last decision was accept.
        rejected: edits whose last decision was reject.
        persistence: fraction persisted (0..1) of each accepted edit that was measured.
        dissatisfied_followups: follow-ups flagged as complaints / redo requests.
        latency_s: total serving latency over all turns, seconds.
        completion_tokens: model tokens over all segments.
        last_test_passed: outcome of the agent's last test run, None without one.
        task_history: outcomes of the task's trajectories finalized before this one (only a spec
            with ``length.difficulty`` reads it; empty: the prior alone).
    """

    accepted: int = 0
    rejected: int = 0
    persistence: tuple[float, ...] = ()
    dissatisfied_followups: int = 0
    latency_s: float = 0.0
    completion_tokens: int = 0
    last_test_passed: bool | None = None
    task_history: TaskHistory = TaskHistory()


@dataclass(frozen=True)
class RewardResult:
    """A reward and the per-component values that sum to it before clipping."""

    spec: str
    reward: float
    components: dict[str, float] = field(default_factory=dict)


def inputs_from_signals(
    signals: dict[str, Any], completion_tokens: int, task_history: TaskHistory = TaskHistory()
) -> RewardInputs:
    """Reward inputs from a trajectory's ``signals`` JSON (see ``consumers.projection``) and its
    task's history."""
    edits = signals.get("edits", {}) or {}
    accepted = [e for e in edits.values() if e.get("decision") == "accepted"]
    rejected = sum(1 for e in edits.values() if e.get("decision") == "rejected")
    persistence = tuple(float(e["persisted"]) for e in accepted if e.get("persisted") is not None)
    return RewardInputs(
        accepted=len(accepted),
        rejected=rejected,
        persistence=persistence,
        dissatisfied_followups=int(signals.get("dissatisfied_followups", 0)),
        latency_s=float(signals.get("latency_s", 0.0)),
        completion_tokens=int(completion_tokens),
        last_test_passed=signals.get("last_test_passed"),
        task_history=task_history,
    )


def length_penalty(tokens: int, kind: str, coef: float, scale_tokens: float) -> float:
    """The (negative) concave length penalty for ``tokens`` completion tokens."""
    x = max(0, tokens) / scale_tokens
    return -coef * (math.log1p(x) if kind == "log1p" else math.sqrt(x))


def difficulty_weight(length: Length, history: TaskHistory) -> float:
    """The factor on the length penalty: ``max(solve rate, floor)`` with ``length.difficulty``
    (in [floor, 1]), 1.0 without it."""
    d = length.difficulty
    if d is None:
        return 1.0
    return max(solve_rate(history, d.prior_solved, d.prior_failed), d.floor)


def compute_reward(spec: RewardSpec, inputs: RewardInputs) -> RewardResult:
    """The reward of one trajectory under ``spec``.

    Returns:
        ``RewardResult`` whose ``components`` hold every enabled component (floats, rounded to 1e-9
        so labels compare exactly across runs) and ``reward = clip(sum(components))``.
    """
    c = spec.components
    comp: dict[str, float] = {}
    decided = inputs.accepted + inputs.rejected
    if c.edit_accepted is not None:
        comp["edit_accepted"] = c.edit_accepted.weight * inputs.accepted / decided if decided else 0.0
    if c.edit_rejected is not None:
        comp["edit_rejected"] = -c.edit_rejected.weight * inputs.rejected / decided if decided else 0.0
    if c.edit_persistence is not None:
        p = inputs.persistence
        if c.edit_persistence.zero_if_not_kept:
            p = p + (0.0,) * inputs.rejected
            if not decided:  # no edit proposed: nothing of the request is in the developer's code
                p = (0.0,)
        comp["edit_persistence"] = (
            c.edit_persistence.weight * (sum(p) / len(p) - c.edit_persistence.baseline) if p else 0.0
        )
    if c.dissatisfied_followups is not None:
        d = c.dissatisfied_followups
        comp["dissatisfied_followups"] = -d.weight * min(inputs.dissatisfied_followups, d.cap)
    if c.latency is not None:
        lat = c.latency
        units = min(max(0.0, inputs.latency_s - lat.free_s) / lat.scale_s, lat.max_units)
        comp["latency"] = -lat.weight * units
    if c.length is not None:
        ln = c.length
        coef = ln.coef * difficulty_weight(ln, inputs.task_history)
        comp["length"] = length_penalty(inputs.completion_tokens, ln.kind, coef, ln.scale_tokens)
    if c.test_outcome is not None:
        t = inputs.last_test_passed
        comp["test_outcome"] = 0.0 if t is None else (c.test_outcome.weight if t else -c.test_outcome.weight)
    comp = {k: round(v, 9) + 0.0 for k, v in comp.items()}  # + 0.0 turns -0.0 into 0.0
    lo, hi = spec.clip
    reward = round(min(max(sum(comp.values()), lo), hi), 9)
    return RewardResult(spec=spec.id, reward=reward, components=comp)
