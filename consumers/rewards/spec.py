"""Reward specs: typed, versioned TOML files (``name@version``).

Invariant: a spec id names exactly one set of numbers. Two files declaring the same ``name@version``
is a configuration error, and a label row stores the spec id it was computed with, so changing any
number means a new version and a relabel (``flywheel relabel --spec name@N``).

Specs are found in ``consumers/rewards/specs/*.toml`` (shipped) and in
``FLYWHEEL_CONSUMER_REWARD_SPEC_DIR`` (the ML team's own). ``default.toml`` is ``implicit@1``.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.core.errors import ConfigurationError
from consumers.settings import get_consumer_settings

SPEC_DIR = Path(__file__).parent / "specs"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EditAccepted(_Strict):
    """``+weight * accepted / decided`` over edits the developer accepted or rejected."""

    weight: float = Field(ge=0, description="reward for an all-accepted session")


class EditRejected(_Strict):
    """``-weight * rejected / decided``."""

    weight: float = Field(ge=0, description="penalty for an all-rejected session")


class EditPersistence(_Strict):
    """``+weight * (mean fraction_persisted - baseline)`` over accepted edits with a measurement.

    With ``zero_if_not_kept``, the mean also counts each rejected edit as 0 persisted, and a session
    that proposed no edit scores as one whose edit kept nothing: the component then measures how much
    of what the model proposed is still in the developer's code, for every session.
    """

    weight: float = Field(ge=0)
    baseline: float = Field(default=0.5, ge=0, le=1, description="persistence that scores zero")
    zero_if_not_kept: bool | None = Field(
        default=None, description="count rejected edits, and a session without an edit, as 0 persisted"
    )


class DissatisfiedFollowups(_Strict):
    """``-weight * min(dissatisfied follow-ups, cap)``."""

    weight: float = Field(ge=0)
    cap: int = Field(default=3, ge=1, description="follow-ups beyond this add no penalty")


class Latency(_Strict):
    """``-weight * min(max(0, latency_s - free_s) / scale_s, max_units)`` on total serving seconds."""

    weight: float = Field(ge=0)
    free_s: float = Field(default=20.0, ge=0, description="seconds of serving latency that cost nothing")
    scale_s: float = Field(default=60.0, gt=0, description="seconds per unit of penalty")
    max_units: float = Field(default=3.0, gt=0, description="cap on the penalty in units")


class Difficulty(_Strict):
    """Weights the length penalty by the task's solve rate: ``max(p, floor)`` with ``p`` the posterior
    mean ``(solved + prior_solved) / (attempts + prior_solved + prior_failed)`` over the task's earlier
    trajectories (``consumers.rewards.difficulty``), so easy tasks pay more per token than hard ones."""

    prior_solved: float = Field(default=1.0, gt=0, description="Beta prior's pseudo-successes (alpha)")
    prior_failed: float = Field(default=1.0, gt=0, description="Beta prior's pseudo-failures (beta)")
    floor: float = Field(default=0.1, ge=0, le=1, description="least weight, for a task never solved")


class Length(_Strict):
    """A concave penalty in completion tokens ``t``: ``-coef * f(t / scale_tokens)`` with
    ``f = log1p`` or ``f = sqrt``; both have a falling marginal cost (see ``default.toml``). With
    ``difficulty`` set, it is multiplied by the task's solve-rate weight (see :class:`Difficulty`)."""

    kind: Literal["log1p", "sqrt"] = "log1p"
    coef: float = Field(ge=0, description="penalty scale")
    scale_tokens: float = Field(default=512.0, gt=0, description="tokens per unit of the argument")
    difficulty: Difficulty | None = Field(default=None, description="weigh by the task's solve rate")


class TestOutcome(_Strict):
    """``+weight`` if the agent's last test run passed, ``-weight`` if it failed, 0 without one."""

    weight: float = Field(ge=0)


class Components(_Strict):
    """The components a spec turns on; an omitted component contributes nothing."""

    edit_accepted: EditAccepted | None = None
    edit_rejected: EditRejected | None = None
    edit_persistence: EditPersistence | None = None
    dissatisfied_followups: DissatisfiedFollowups | None = None
    latency: Latency | None = None
    length: Length | None = None
    test_outcome: TestOutcome | None = None


class RewardSpec(_Strict):
    """One versioned reward: ``name@version``, the components and a clip range."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_\-]{0,63}$", description="spec family, e.g. implicit")
    version: int = Field(ge=1, description="bump on any change of a number")
    description: str = ""
    clip: tuple[float, float] = Field(default=(-3.0, 3.0), description="final reward range [lo, hi]")
    components: Components

    @model_validator(mode="after")
    def _clip_ordered(self) -> "RewardSpec":
        if self.clip[0] >= self.clip[1]:
            raise ValueError(f"clip {self.clip} must be [lo, hi] with lo < hi")
        return self

    @property
    def id(self) -> str:
        """``name@version`` (what ``reward_label.spec`` stores)."""
        return f"{self.name}@{self.version}"

    @property
    def needs_task_history(self) -> bool:
        """Whether a label depends on other trajectories of the task (``components.length.difficulty``):
        only ``flywheel relabel`` computes it (see :func:`active_specs`)."""
        return self.components.length is not None and self.components.length.difficulty is not None

    def digest(self) -> str:
        """sha256 of the resolved spec (first 16 hex chars), for manifests. A component's optional
        setting left unset (None) is left out, so it does not change the digest of specs without it."""
        data = self.model_dump(mode="json")
        for name, conf in data["components"].items():
            if conf is not None:
                data["components"][name] = {k: v for k, v in conf.items() if v is not None}
        text = json.dumps(data, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _spec_dirs(extra: Path | None) -> list[Path]:
    dirs = [SPEC_DIR]
    if extra is None:
        extra = get_consumer_settings().reward_spec_dir
    if extra is not None:
        dirs.append(Path(extra))
    return dirs


def read_spec_file(path: Path) -> RewardSpec:
    """Parse and validate one TOML spec file.

    Raises:
        ConfigurationError: not TOML or not a valid spec (every field error is listed).
    """
    try:
        data = tomllib.loads(path.read_text())
        return RewardSpec.model_validate(data)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"reward spec {path}: not TOML: {exc}") from None
    except ValidationError as exc:
        reasons = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigurationError(f"reward spec {path} is invalid", reasons=reasons) from None


def available_specs(extra_dir: Path | None = None) -> dict[str, RewardSpec]:
    """Every spec found, by id.

    Raises:
        ConfigurationError: an invalid file, or two files with the same ``name@version``.
    """
    found: dict[str, tuple[Path, RewardSpec]] = {}
    for d in _spec_dirs(extra_dir):
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.toml")):
            spec = read_spec_file(path)
            if spec.id in found and found[spec.id][1] != spec:
                raise ConfigurationError(
                    f"reward spec {spec.id} is defined twice with different numbers: {found[spec.id][0]} and {path}"
                )
            found[spec.id] = (path, spec)
    return {k: v for k, (_, v) in found.items()}


def load_spec(spec_id: str, extra_dir: Path | None = None) -> RewardSpec:
    """The spec named ``name@version``.

    Raises:
        ConfigurationError: malformed id or no such spec.
    """
    if "@" not in spec_id:
        raise ConfigurationError(f"reward spec id {spec_id!r} must look like name@version")
    specs = available_specs(extra_dir)
    if spec_id not in specs:
        raise ConfigurationError(f"unknown reward spec {spec_id!r}; available: {', '.join(sorted(specs))}")
    return specs[spec_id]


def active_specs() -> list[RewardSpec]:
    """The specs labeled at finalization (``FLYWHEEL_CONSUMER_REWARD_SPECS``), in order.

    A spec that needs the task's history (:attr:`RewardSpec.needs_task_history`) cannot be one: the
    trajectories finalized before a label's instant may not all be committed yet when a consumer
    labels (another member's batch, a window the sweep has not reached), so the live label and a
    replay's could differ. ``flywheel relabel`` labels it, from the stored trajectories.

    Raises:
        ConfigurationError: an active spec does not exist, or needs the task's history.
    """
    specs = available_specs()
    out = []
    for spec_id in get_consumer_settings().reward_specs:
        if spec_id not in specs:
            raise ConfigurationError(f"active reward spec {spec_id!r} not found; available: {', '.join(sorted(specs))}")
        if specs[spec_id].needs_task_history:
            raise ConfigurationError(
                f"reward spec {spec_id!r} weighs length by the task's earlier trajectories and cannot label at "
                f"finalization; leave it out of FLYWHEEL_CONSUMER_REWARD_SPECS and run `flywheel relabel --spec {spec_id}`"
            )
        out.append(specs[spec_id])
    return out
