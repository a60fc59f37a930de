"""Whether this process can grade: the sandbox (``evals.harness.sandbox``) can be built here, checked
once when a worker starts (``flywheel worker``) and on demand (``flywheel sandbox check``, a
container's readiness probe), never first at a gate.

Invariant: a process that cannot build the sandbox says so before it takes a task, naming what is
missing and what to grant, and never grades: under Docker's default seccomp profile bubblewrap
answers "No permissions to create new namespace", and every sandboxed eval would fail closed, so
every gate of the deployed loop would fail on infrastructure, not on the candidate. Where the
operator set ``FLYWHEEL_SANDBOX_ALLOW_UNISOLATED`` the check passes with a warning: runs are then
unisolated by choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from evals.harness.sandbox_bwrap import bwrap_missing
from evals.harness.sandbox_cgroup import cgroup_host
from evals.harness.sandbox_host import fresh_uid, interpreter_reachable, is_root, load_settings

log = logging.getLogger("flywheel.sandbox")

REMEDY = (
    "in a container grant what bubblewrap needs: compose's x-grader (seccomp=ops/deploy/seccomp-sandbox.json and "
    "systempaths=unconfined), in Kubernetes hostUsers: false, procMount: Unmasked and the seccomp profile "
    "(ops/deploy/RUNBOOK.md, 'Graders need a sandbox'); on a host, install bubblewrap and allow unprivileged user namespaces"
)


@dataclass(frozen=True)
class Preflight:
    """The check's answer: ``ready`` when graded runs will be isolated (or unisolated by the
    operator's choice, ``unisolated``); ``reason`` says what is missing otherwise; ``containment``
    what will bound each run's resources (``cgroup-v1``/``cgroup-v2``: its own cgroup; ``rlimits``:
    per process only, :mod:`evals.harness.sandbox_cgroup`)."""

    ready: bool
    reason: str | None = None
    unisolated: bool = False
    containment: str = "rlimits"

    def message(self) -> str:
        """One line for a log or a terminal."""
        bounds = (
            f"each run in its own memory and pids cgroup ({self.containment})"
            if self.containment != "rlimits"
            else "no delegated cgroup: each run bounded per process (rlimits)"
        )
        if self.ready:
            return (
                "the sandbox cannot be built here; grading UNISOLATED (FLYWHEEL_SANDBOX_ALLOW_UNISOLATED)"
                if self.unisolated
                else f"bubblewrap builds the sandbox here; {bounds}"
            )
        return f"this process cannot grade: {self.reason}. Fix: {REMEDY}"


def sandbox_preflight() -> Preflight:
    """Probe the sandbox as a graded run would build it (bubblewrap, this interpreter, the probe
    uid when root; :func:`evals.harness.sandbox_bwrap.bwrap_missing`), once per process."""
    settings = load_settings()
    if not interpreter_reachable():
        missing: str | None = (
            "a sandbox uid cannot start this interpreter (python -m evals.harness.sandbox_host --grant)"
        )
    else:
        missing = bwrap_missing(settings.bwrap, fresh_uid() if is_root() else None)
    host = cgroup_host() if settings.cgroup else None
    containment = host.mode if host is not None else "rlimits"
    if missing is None:
        return Preflight(True, containment=containment)
    if settings.allow_unisolated:
        log.warning("sandbox preflight: %s; FLYWHEEL_SANDBOX_ALLOW_UNISOLATED is set, grading unisolated", missing)
        return Preflight(True, missing, unisolated=True, containment=containment)
    return Preflight(False, missing, containment=containment)
