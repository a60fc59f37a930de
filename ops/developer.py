"""The simulated developer: how a developer reacts to what an agent session did.

:class:`DeveloperModel` holds the probabilities (docs/simulator.md states the model);
:class:`DeveloperReaction` applies them to one session: it grades the edited repository with the
task's hidden tests, classifies the outcome the developer sees (``works``, ``looks_right``,
``broken``, ``no_edit``), accepts or rejects each edit now, and schedules the late signals (edit
persistence, a dissatisfied follow-up). Every draw comes from the session's seeded
``random.Random``.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from evals.harness.agent import grade_result
from evals.harness.apply import apply_target
from evals.harness.sandbox import SandboxLimits
from producers.events.types import (
    EditAccepted,
    EditAcceptedEvent,
    EditPersistenceMeasured,
    EditPersistenceMeasuredEvent,
    EditRejected,
    EditRejectedEvent,
    EventBase,
    FollowupSent,
    FollowupSentEvent,
)

FOLLOWUPS = (
    "This doesn't work, the tests still fail.",
    "That broke it. Please redo this.",
    "No, that's not what I asked for.",
)


class DeveloperModel(BaseModel):
    """How a simulated developer reacts to a session's outcome (the noise model, seeded per session).

    Outcomes, from what the developer can see:

    - ``works``: the hidden tests pass on the session's final repository;
    - ``looks_right``: the main file passes the visible check (parses, defines the entry point);
    - ``broken``: an edit was made but fails the visible check; ``no_edit``: nothing to accept.

    Per edit: accept with ``accept[outcome]``, else reject. An accepted edit's measured persistence
    is the share of its added lines still in the file at the end of the session times a factor
    drawn uniformly from ``keep_if_works`` when the code works (the developer keeps it) or from
    ``keep_if_fails`` when it does not (the developer rewrites most of it). A dissatisfied
    follow-up is sent with ``followup[outcome]``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    accept_if_works: float = Field(default=0.95, ge=0.0, le=1.0)
    """P(accept) when the hidden tests pass."""
    accept_if_looks_right: float = Field(default=0.5, ge=0.0, le=1.0)
    """P(accept) when the visible check passes but the hidden tests fail."""
    accept_if_broken: float = Field(default=0.05, ge=0.0, le=1.0)
    """P(accept) when the edited code fails the visible check."""
    keep_if_works: tuple[float, float] = (0.85, 1.0)
    """Range of the persisted share of an accepted edit whose code works."""
    keep_if_fails: tuple[float, float] = (0.0, 0.3)
    """Range of the persisted share of an accepted edit whose code fails the hidden tests."""
    followup_if_works: float = Field(default=0.05, ge=0.0, le=1.0)
    """P(dissatisfied follow-up) after a session whose code works (a developer who wanted more)."""
    followup_if_fails: float = Field(default=0.7, ge=0.0, le=1.0)
    """P(dissatisfied follow-up) after a session that edited code failing the hidden tests."""
    followup_if_no_edit: float = Field(default=0.7, ge=0.0, le=1.0)
    """P(dissatisfied follow-up) after a session that changed nothing."""

    def accept_probability(self, outcome: str) -> float:
        """P(accept) of an edit given the session's outcome (``works`` | ``looks_right`` | ``broken``)."""
        return {
            "works": self.accept_if_works,
            "looks_right": self.accept_if_looks_right,
            "broken": self.accept_if_broken,
        }[outcome]

    def followup_probability(self, outcome: str) -> float:
        """P(dissatisfied follow-up) given the outcome (``no_edit`` too)."""
        return {
            "works": self.followup_if_works,
            "looks_right": self.followup_if_fails,
            "broken": self.followup_if_fails,
            "no_edit": self.followup_if_no_edit,
        }[outcome]


class ReactionSettings(Protocol):
    """What a :class:`DeveloperReaction` reads of its run's settings (``ops.simulator.SimulatorConfig``
    has these fields)."""

    developer: DeveloperModel
    run_timeout_s: float
    """Wall-clock limit of the hidden tests (seconds)."""
    persistence_delay_s: float
    """Seconds between acceptance and ``edit.persistence_measured``."""
    followup_delay_s: float
    """Seconds between the end of a session and its follow-up."""


def visible_check(task, final_files: dict[str, str]) -> bool:
    """What the developer sees without running anything: the task's main file parses and defines
    its entry point (any function when the task names none)."""
    target = apply_target(task.files)
    if target is None or target not in final_files:
        return False
    try:
        tree = ast.parse(final_files[target])
    except (SyntaxError, ValueError):
        return False
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    entry = task.metadata.get("entry_point")
    return entry in names if entry else bool(names)


class DeveloperReaction:
    """What the simulated developer does after one session; builds the late events."""

    def __init__(
        self,
        config: ReactionSettings,
        rng: random.Random,
        task,
        workdir: Path,
        envelope: dict,
        emit: Callable[[EventBase], None],
        schedule: Callable[[float, EventBase], None],
    ) -> None:
        self.config, self.rng, self.task, self.workdir = config, rng, task, workdir
        self.envelope, self.emit, self.schedule = envelope, emit, schedule
        self.passed: bool | None = None
        self.outcome = "no_edit"
        self.grade_detail: dict | None = None
        self.accepted = self.rejected = 0

    def __call__(self, result) -> list[str]:
        """``on_end`` hook: grade, accept/reject edits now, schedule late signals, return their types."""
        dev = self.config.developer
        self.passed = False
        if result.edited:
            graded = grade_result(self.task, self.workdir, SandboxLimits(timeout_s=self.config.run_timeout_s))
            self.passed = graded.ok
            self.grade_detail = {
                "exit_code": graded.exit_code,
                "killed_reason": graded.killed_reason,
                "duration_s": round(graded.duration_s, 2),
                "tail": graded.stderr[-300:],
            }
            self.outcome = (
                "works" if graded.ok else "looks_right" if visible_check(self.task, result.final_files) else "broken"
            )
        expected: list[str] = []
        final = result.final_files
        keep = dev.keep_if_works if self.outcome == "works" else dev.keep_if_fails
        for edit in result.edits:
            if self.rng.random() >= dev.accept_probability(self.outcome):
                self.rejected += 1
                self.emit(EditRejectedEvent(**self.envelope, payload=EditRejected(edit_id=edit["edit_id"])))
                continue
            self.accepted += 1
            self.emit(EditAcceptedEvent(**self.envelope, payload=EditAccepted(edit_id=edit["edit_id"])))
            fraction = surviving_fraction(edit, final.get(edit["path"], "")) * self.rng.uniform(*keep)
            delay = self.config.persistence_delay_s
            self.schedule(
                delay,
                EditPersistenceMeasuredEvent(
                    **self.envelope,
                    payload=EditPersistenceMeasured(
                        edit_id=edit["edit_id"],
                        fraction_persisted=round(min(max(fraction, 0.0), 1.0), 4),
                        delay_s=delay,
                    ),
                ),
            )
            expected.append("edit.persistence_measured")
        if self.rng.random() < dev.followup_probability(self.outcome):
            self.schedule(
                self.config.followup_delay_s,
                FollowupSentEvent(
                    **self.envelope, payload=FollowupSent(text=self.rng.choice(FOLLOWUPS), dissatisfied=True)
                ),
            )
            expected.append("followup.sent")
        return expected


def surviving_fraction(edit: dict, final_text: str) -> float:
    """Share of the edit's added lines still present in the file at the end of the session."""
    added = [ln for ln in edit.get("added", []) if ln.strip()]
    if not added:
        return 1.0
    remaining = set(final_text.splitlines())
    return sum(1 for ln in added if ln in remaining) / len(added)
