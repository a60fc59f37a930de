"""Stopping a candidate's eval run early: the gate's confidence sequence, updated as results land.

Invariant: the sequence looks at clusters in the order fixed before any outcome is seen
(:func:`evals.gate.checks.sequence_order` over the plan's clusters), a cluster only once all its
planned pairs are in on both sides and every cluster before it in that order was looked at. So the
place this stops is the place :mod:`evals.gate` finds again from the stored outcomes
(:func:`evals.gate.checks.stopped_prefix`), and a stop keeps the sequence's level: it is valid at
every look (:mod:`evals.gate.sequential`). Pure: no DB, no IO.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from evals.gate.checks import cluster_of, sequence_order, sequence_verdict
from evals.gate.models import Key, SequentialReport
from evals.gate.policy import GateConfig

if TYPE_CHECKING:
    from evals.tasks.model import Task


class SequentialStop:
    """The early-stop rule of one gated suite's candidate run (``GateConfig.early_stop``).

    Args:
        suite: the suite's name (seeds the look order, as in the gate).
        planned: the run's planned ``(task_id, sample_index)`` keys.
        production: production's pass indicator per key, from its complete run of the same plan.
        config: the gate policy (``cluster_by``, ``seed``, ``sequence``, the suite's role and margin).
    """

    def __init__(self, suite: str, planned: Sequence[Key], production: Mapping[Key, bool], config: GateConfig):
        sg = config.for_suite(suite)
        self.suite = suite
        self.config = config
        self.guardrail = sg.role == "guardrail"
        self.threshold = -(sg.margin or 0.0) if self.guardrail else 0.0
        self.production = dict(production)
        self.members: dict[str, list[Key]] = defaultdict(list)
        for key in planned:
            self.members[cluster_of(key[0], config)].append(key)
        self.order = sequence_order(suite, set(self.members), config)
        self.rank = {c: i for i, c in enumerate(self.order)}
        self.results: dict[Key, bool] = {}
        self.means: list[float] = []
        self.sizes: list[int] = []
        self.report: SequentialReport | None = None

    @property
    def decided(self) -> bool:
        """Whether a look has decided the suite (the run may stop)."""
        return self.report is not None

    def sort(self, todo: list[tuple["Task", int]]) -> list[tuple["Task", int]]:
        """``(task, sample)`` pairs in look order: by the rank of the task's cluster, then task and
        sample, so the clusters complete one after another."""
        end = len(self.rank)
        return sorted(todo, key=lambda p: (self.rank.get(cluster_of(p[0].id, self.config), end), p[0].id, p[1]))

    def observe(self, task_id: str, sample_index: int, passed: bool) -> bool:
        """Record one candidate result; look at every cluster it completes (in order).

        Returns:
            Whether the sequence has decided (now or before).
        """
        self.results[(task_id, sample_index)] = bool(passed)
        if self.report is not None:
            return True
        grew = False
        while len(self.means) < len(self.order):
            keys = self.members[self.order[len(self.means)]]
            if not all(k in self.results and k in self.production for k in keys):
                break
            self.means.append(float(np.mean([int(self.results[k]) - int(self.production[k]) for k in keys])))
            self.sizes.append(len(keys))
            grew = True
        if grew:
            report = sequence_verdict(
                np.array(self.means),
                np.array(self.sizes),
                len(self.order),
                self.threshold,
                self.config,
                guardrail=self.guardrail,
            )
            if report.stopped_at_pairs is not None:
                self.report = report
        return self.report is not None

    def summary(self) -> dict[str, Any]:
        """What the run stores about the stop (``eval_run.summary["stopped"]``): ``decision``,
        ``stopped_at_clusters`` of ``clusters``, ``stopped_at_pairs``, the bounds ``low``/``high``;
        empty when nothing decided."""
        if self.report is None:
            return {}
        return self.report.model_dump(mode="json")
