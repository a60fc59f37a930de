"""Task environments: the dependencies and extra files a task's hidden tests need, checked in the sandbox.

A task mined from a session arrives with its code and its tests but not with what they run in.
An environment says that: distributions from an allowed list (``evals/environments.toml``) and
data or config files. :mod:`evals.environment_setup` asks the production model for one and falls
back to :func:`evals.environment_imports.resolve_environment` (the task's imports) when the
proposal is refused.

Invariants:
- An environment is materialized as a virtualenv without system site-packages (stdlib
  :mod:`venv`) in the repository's ``.flywheel-env``, whose site-packages holds links to exactly
  the named distributions and their requirement closure as installed on this host; its files are
  written into the repository. A test that imports anything else fails with ``ImportError``.
- A model's reply is parsed strictly (:func:`parse_proposal`): the whole reply is one JSON object,
  bare or as the only content of one fenced block, with exactly the keys ``dependencies`` (names
  on the allowed list, installed here) and ``files`` (relative new paths; no code, ``.pth`` or
  native files, which could change what the tests do; at most ``max_files`` of ``max_file_bytes``).
  Anything else is refused with a reason code (:data:`REASONS`).
- An environment is verified only when the task's hidden tests pass on its reference solution
  inside it (:func:`verify_environment`); whether the untouched repository passes too is recorded.
- :func:`task_key` hashes what an environment depends on (code, tests, reference, allowed list);
  :func:`environment_hash` adds the canonical proposal. Equal hashes mean the same verification.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

from packaging.utils import canonicalize_name
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from evals.harness.environment import ENV_DIR, command_in_environment, materialize_environment
from evals.harness.sandbox import SandboxLimits, SandboxResult, run_in_sandbox
from evals.harness.workspace import write_files
from evals.tasks.model import Task

POLICY_TOML = Path(__file__).with_name("environments.toml")
"""The virtualenv's folder inside the repository (no proposed file may use it)."""
FORMAT_VERSION = 1
"""Part of every task key: bump when materialization or verification changes meaning."""
FORBIDDEN_SUFFIXES = frozenset({".py", ".pyc", ".pyw", ".pyd", ".so", ".pth"})
REASONS = (
    "unparseable",  # not one JSON object (or not valid JSON)
    "invalid_schema",  # JSON, but not exactly {"dependencies": [str], "files": {str: str}}
    "dependency_not_allowed",  # a name outside the allowed list
    "dependency_not_installed",  # allowed, but not installed on this host
    "forbidden_file",  # a code/hook file, a path outside the repository, or one the task already has
    "too_many_files",
    "reference_failed",  # the hidden tests fail on the reference solution in this environment
    "model_error",  # the engine raised (server down)
)
"""Why a proposal was not used; recorded with the fallback that replaced it."""


class EnvironmentPolicy(BaseModel):
    """What an environment may hold (``evals/environments.toml``).

    Attributes:
        allowed: distribution names a proposal may name (canonical PEP 503 form, sorted).
        max_files: most extra files in one proposal.
        max_file_bytes: largest extra file (bytes, UTF-8).
        timeout_s: wall-clock limit of one hidden-test run during verification (seconds).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed: tuple[str, ...]
    max_files: int = Field(default=8, ge=0)
    max_file_bytes: int = Field(default=65_536, ge=1)
    timeout_s: float = Field(default=120.0, gt=0)

    @field_validator("allowed")
    @classmethod
    def _canonical(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted({canonicalize_name(n) for n in v}))


def load_policy(path: Path | None = None) -> EnvironmentPolicy:
    """The policy in ``path`` (default ``evals/environments.toml``).

    Raises:
        pydantic.ValidationError: a key is unknown or a value out of range.
    """
    return EnvironmentPolicy.model_validate(tomllib.loads((path or POLICY_TOML).read_text()))


DistName = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class EnvironmentProposal(BaseModel):
    """An environment: distributions to install and files to add to the repository.

    Attributes:
        dependencies: distribution names (canonical form once accepted, sorted, unique).
        files: relative POSIX path -> text, written into the repository before the tests run.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dependencies: list[DistName] = Field(max_length=64)
    files: dict[str, str]

    def canonical(self) -> EnvironmentProposal:
        """The same environment with names canonicalized, sorted and deduplicated."""
        return EnvironmentProposal(
            dependencies=sorted({canonicalize_name(d) for d in self.dependencies}),
            files=dict(sorted(self.files.items())),
        )

    def canonical_json(self) -> str:
        """Key-sorted JSON of :meth:`canonical` (what :func:`environment_hash` hashes)."""
        return json.dumps(self.canonical().model_dump(), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ParsedProposal:
    """The outcome of :func:`parse_proposal`: a canonical proposal, or the reason (and a detail) why not."""

    proposal: EnvironmentProposal | None
    reason: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class Verification:
    """The outcome of :func:`verify_environment`.

    Attributes:
        verified: the reference solution passed the hidden tests in the environment.
        reason: ``None`` when verified, else ``reference_failed``.
        detail: ``exit_code``, ``killed_reason``, ``duration_s``, ``stderr_tail`` of the reference run,
            ``stub_passes`` (the untouched repository passes too: the tests do not discriminate;
            only when verified) and ``resolved`` (``name==version`` of every linked distribution).
    """

    verified: bool
    reason: str | None
    detail: dict[str, Any] = field(default_factory=dict)


def task_key(task: Task, policy: EnvironmentPolicy) -> str:
    """sha256 hex of what a task's environment depends on: its files, tests, reference solution and
    the allowed list (not its request: two requests on the same code need the same environment)."""
    blob = {
        "format": FORMAT_VERSION,
        "files": task.files,
        "test_command": task.test_command,
        "test_files": task.test_files,
        "reference_files": task.reference_files,
        "allowed": list(policy.allowed),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def environment_hash(key: str, proposal: EnvironmentProposal) -> str:
    """sha256 hex of a task key and a proposal's canonical JSON: the identity of one verification."""
    return hashlib.sha256(f"{key}\n{proposal.canonical_json()}".encode()).hexdigest()


def _fenced_body(text: str) -> str:
    """The content of ``text`` when it is exactly one fenced block (```json or ```), else ``text``."""
    lines = text.splitlines()
    if len(lines) >= 2 and lines[0].strip() in ("```", "```json") and lines[-1].strip() == "```":
        body = lines[1:-1]
        if not any(line.lstrip().startswith("```") for line in body):
            return "\n".join(body).strip()
    return text


def parse_proposal(reply: str, task: Task, policy: EnvironmentPolicy) -> ParsedProposal:
    """Read a model's reply as an environment for ``task``, strictly (see the module invariant).

    Returns:
        A :class:`ParsedProposal`: the canonical proposal, or ``proposal=None`` with a reason code
        (``unparseable``, ``invalid_schema``, ``dependency_not_allowed``, ``dependency_not_installed``,
        ``forbidden_file``, ``too_many_files``) and a one-line detail.
    """
    text = _fenced_body(reply.strip())
    if not text.startswith("{"):
        return ParsedProposal(None, "unparseable", f"the reply is not one JSON object: {text[:80]!r}")
    try:
        proposal = EnvironmentProposal.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        kind = "unparseable" if first["type"] == "json_invalid" else "invalid_schema"
        return ParsedProposal(None, kind, f"{'.'.join(map(str, first['loc'])) or 'reply'}: {first['msg']}")
    proposal = proposal.canonical()
    reason, detail = check_proposal(proposal, task, policy)
    if reason is not None:
        return ParsedProposal(None, reason, detail)
    return ParsedProposal(proposal)


def check_proposal(proposal: EnvironmentProposal, task: Task, policy: EnvironmentPolicy) -> tuple[str | None, str]:
    """``(None, "")`` when ``proposal`` respects ``policy`` for ``task``, else ``(reason code, detail)``."""
    for name in proposal.dependencies:
        canonical = canonicalize_name(name)
        if canonical not in policy.allowed:
            return "dependency_not_allowed", f"{name} is not on the allowed list"
        if not distribution_installed(canonical):
            return "dependency_not_installed", f"{name} is allowed but not installed on this host"
    if len(proposal.files) > policy.max_files:
        return "too_many_files", f"{len(proposal.files)} files, at most {policy.max_files}"
    taken = {**task.files, **task.test_files, **task.reference_files}
    for path, text in proposal.files.items():
        problem = _file_problem(path, text, taken, policy)
        if problem is not None:
            return "forbidden_file", f"{path!r}: {problem}"
    return None, ""


def _file_problem(path: str, text: str, taken: dict[str, str], policy: EnvironmentPolicy) -> str | None:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or p.as_posix() != path or "\\" in path or "\x00" in path:
        return "not a normalized relative path"
    if p.parts[0] == ENV_DIR:
        return f"{ENV_DIR} holds the virtualenv"
    if p.suffix.lower() in FORBIDDEN_SUFFIXES or p.stem in ("sitecustomize", "usercustomize"):
        return "code and import hooks belong to the task, not its environment"
    for other in taken:
        if other == path or other.startswith(path + "/") or path.startswith(other + "/"):
            return f"collides with the task's {other}"
    if len(text.encode()) > policy.max_file_bytes:
        return f"larger than {policy.max_file_bytes} bytes"
    return None


def distribution_installed(name: str) -> bool:
    """Whether the distribution ``name`` is installed in this environment."""
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def build_environment(repo: Path, proposal: EnvironmentProposal) -> dict[str, str]:
    """Create the virtualenv ``repo/.flywheel-env`` holding links to ``proposal``'s distributions and
    their requirement closure (:func:`evals.harness.environment.materialize_environment`), and write
    ``proposal.files`` into ``repo``.

    Returns:
        ``{distribution: version}`` of every linked distribution.

    Raises:
        importlib.metadata.PackageNotFoundError: a proposed distribution is not installed.
    """
    resolved = materialize_environment(repo, proposal.dependencies)
    write_files(repo, proposal.files)
    return resolved


def run_in_environment(
    task: Task, proposal: EnvironmentProposal, overlay: dict[str, str], limits: SandboxLimits
) -> tuple[SandboxResult, dict[str, str]]:
    """Run ``task``'s hidden tests on its repository with ``overlay`` (e.g. the reference files) in
    ``proposal``'s environment, in the sandbox, in a fresh temporary directory.

    Returns:
        ``(sandbox result, {distribution: version} linked)``.
    """
    work = Path(tempfile.mkdtemp(prefix="flywheel-env-"))
    try:
        resolved = build_environment(work, proposal)
        write_files(work, {**task.files, **overlay, **task.test_files})
        command = command_in_environment(task.test_command)
        return run_in_sandbox(command, work, limits.with_packages(list(resolved))), resolved
    finally:
        shutil.rmtree(work, ignore_errors=True)


def verify_environment(task: Task, proposal: EnvironmentProposal, policy: EnvironmentPolicy) -> Verification:
    """Verify ``proposal`` for ``task``: its hidden tests must pass on the reference solution inside it.

    Returns:
        A :class:`Verification`; a failing or timed-out run is reported there, never raised.
    """
    limits = SandboxLimits(timeout_s=policy.timeout_s)
    ref, resolved = run_in_environment(task, proposal, task.reference_files, limits)
    detail: dict[str, Any] = {
        "exit_code": ref.exit_code,
        "killed_reason": ref.killed_reason,
        "duration_s": round(ref.duration_s, 3),
        "stderr_tail": ref.stderr[-600:],
        "resolved": [f"{n}=={v}" for n, v in resolved.items()],
    }
    if not ref.ok:
        return Verification(False, "reference_failed", detail)
    stub, _ = run_in_environment(task, proposal, {}, limits)
    detail["stub_passes"] = stub.ok
    return Verification(True, None, detail)
