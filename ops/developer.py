"""The simulated developer: how a developer reacts to what an agent session did.

:class:`DeveloperModel` holds the probabilities (docs/simulator.md states the model);
:class:`DeveloperReaction` applies them to one session: it grades the edited repository with the
task's hidden tests, classifies the outcome the developer sees (``works``, ``looks_right``,
``broken``, ``no_edit``), accepts or rejects each edit now, and schedules the late signals (edit
persistence, a dissatisfied follow-up), to the event stream or to a :class:`DeveloperSignals` kept
in memory (the A/B's). Every draw comes from the session's seeded
``random.Random``.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from evals.config import source_packages
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

    What the developer *knows* is a setting (docs/simulator.md, "Noisier developers"): with
    ``untested_rate`` it never runs a session's tests and judges by the visible check alone; with
    ``keeps_wrong_rate`` it takes a plausible wrong edit for a working one; late signals are lost
    (``signal_loss_rate``) or delayed (``late_signal_rate``). The defaults, all 0, are the developer
    who always knows (it runs the hidden tests).

    Per edit: accept with ``accept[seen outcome]``, else reject. An accepted edit's measured persistence
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
    keeps_wrong_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of plausible-but-wrong sessions (``looks_right``) the developer takes for working code:
    it reacts as to ``works`` (accepts, keeps, is satisfied). 0: the developer always finds out."""
    untested_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of sessions whose tests the developer never runs: it sees only the visible check, so a
    working edit and a plausible wrong one both look ``looks_right``. 0: every session is tested."""
    signal_loss_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of late signals (edit persistence, follow-up) that never arrive and are never announced
    (the editor closed before measuring, the developer left)."""
    late_signal_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the arriving late signals delayed by a further ``late_signal_delay_s``."""
    late_signal_delay_s: float = Field(default=60.0, ge=0.0)
    """Extra delay of a late signal (seconds)."""

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


def developer_args(developer: DeveloperModel) -> list[str]:
    """``flywheel simulate``'s flags for the developer's noise knobs that differ from the exact
    developer's (docs/simulator.md, "Noisier developers"); ``[]`` for the default developer.

    ``flywheel demo`` (and so the bench) gives them to its training traffic only: the fresh-traffic
    A/B and the curve measure the hidden tests' pass rate, which no developer noise changes, and keep
    the exact developer's signals."""
    exact = DeveloperModel()
    flags = {
        "keeps_wrong_rate": "--keeps-wrong-rate",
        "untested_rate": "--untested-rate",
        "signal_loss_rate": "--signal-loss-rate",
        "late_signal_rate": "--late-signal-rate",
        "late_signal_delay_s": "--late-signal-delay",
    }
    return [
        arg
        for name, flag in flags.items()
        if getattr(developer, name) != getattr(exact, name)
        for arg in (flag, repr(getattr(developer, name)))
    ]


class ReactionSettings(Protocol):
    """What a :class:`DeveloperReaction` reads of its run's settings (``ops.simulator.SimulatorConfig``
    has these fields)."""

    @property
    def developer(self) -> DeveloperModel: ...

    @property
    def run_timeout_s(self) -> float:
        """Wall-clock limit of the hidden tests (seconds)."""
        ...

    @property
    def persistence_delay_s(self) -> float:
        """Seconds between acceptance and ``edit.persistence_measured``."""
        ...

    @property
    def followup_delay_s(self) -> float:
        """Seconds between the end of a session and its follow-up."""
        ...


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
        self.accepted = self.rejected = self.lost = self.late = 0
        self.seen: str | None = None

    def __call__(self, result) -> list[str]:
        """``on_end`` hook: grade, accept/reject edits now, schedule late signals, return their types."""
        self.passed = False
        if result.edited:
            limits = SandboxLimits(timeout_s=self.config.run_timeout_s, packages=source_packages(self.task.source))
            graded = grade_result(self.task, self.workdir, limits)
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
        return self.react(result)

    def seen_outcome(self) -> str:
        """What the developer believes of the session (``self.outcome`` is the truth): an untested
        session that passes the visible check looks ``looks_right`` whether or not it works, and a
        plausible wrong one may be taken for ``works``. Draws only for the knobs that are set, so
        the defaults keep the stream of the exact developer."""
        dev = self.config.developer
        untested = dev.untested_rate > 0 and self.rng.random() < dev.untested_rate
        fooled = dev.keeps_wrong_rate > 0 and self.rng.random() < dev.keeps_wrong_rate
        if untested and self.outcome in ("works", "looks_right"):
            return "looks_right"
        if fooled and self.outcome == "looks_right":
            return "works"
        return self.outcome

    def react(self, result) -> list[str]:
        """Accept or reject each edit of ``result`` now and schedule the late signals, by the outcome
        the developer sees (:meth:`seen_outcome` of the graded ``self.outcome``); return the late
        signals' types (what ``session.ended.expected_signals`` announces)."""
        dev = self.config.developer
        self.seen = seen = self.seen_outcome()
        expected: list[str] = []
        final = result.final_files
        keep = dev.keep_if_works if seen == "works" else dev.keep_if_fails
        for edit in result.edits:
            if self.rng.random() >= dev.accept_probability(seen):
                self.rejected += 1
                self.emit(EditRejectedEvent(**self.envelope, payload=EditRejected(edit_id=edit["edit_id"])))
                continue
            self.accepted += 1
            self.emit(EditAcceptedEvent(**self.envelope, payload=EditAccepted(edit_id=edit["edit_id"])))
            fraction = surviving_fraction(edit, final.get(edit["path"], "")) * self.rng.uniform(*keep)
            delay = self._late_delay(self.config.persistence_delay_s)
            if delay is None:
                continue
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
        if self.rng.random() < dev.followup_probability(seen):
            text = self.rng.choice(FOLLOWUPS)
            delay = self._late_delay(self.config.followup_delay_s)
            if delay is not None:
                self.schedule(
                    delay, FollowupSentEvent(**self.envelope, payload=FollowupSent(text=text, dissatisfied=True))
                )
                expected.append("followup.sent")
        return expected

    def _late_delay(self, delay_s: float) -> float | None:
        """The delay of one late signal: None when it is lost, longer when it is late."""
        dev = self.config.developer
        if dev.signal_loss_rate > 0 and self.rng.random() < dev.signal_loss_rate:
            self.lost += 1
            return None
        if dev.late_signal_rate > 0 and self.rng.random() < dev.late_signal_rate:
            self.late += 1
            return delay_s + dev.late_signal_delay_s
        return delay_s


def surviving_fraction(edit: dict, final_text: str) -> float:
    """Share of the edit's added lines still present in the file at the end of the session."""
    added = [ln for ln in edit.get("added", []) if ln.strip()]
    if not added:
        return 1.0
    remaining = set(final_text.splitlines())
    return sum(1 for ln in added if ln in remaining) / len(added)


class DeveloperSignals:
    """The simulated developer's events of one session, kept in memory (never emitted)."""

    def __init__(self) -> None:
        self.events: list[EventBase] = []
        self.persisted: list[float] = []
        self.followups = 0

    def emit(self, event: EventBase) -> None:
        """An immediate reaction (edit accepted or rejected)."""
        self.events.append(event)

    def schedule(self, delay_s: float, event: EventBase) -> None:
        """A late signal: recorded now (the A/B does not wait for it)."""
        self.events.append(event)
        if isinstance(event, EditPersistenceMeasuredEvent):
            self.persisted.append(event.payload.fraction_persisted)
        elif isinstance(event, FollowupSentEvent) and event.payload.dissatisfied:
            self.followups += 1
