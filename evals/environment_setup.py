"""Environments set up by the production model: proposed, verified in the sandbox, cached by content hash.

Invariants:
- A task whose key (:func:`evals.environments.task_key`) already has a verified environment is not
  proposed for again: the stored one is reused and the model is not called.
- Every other task gets one greedy proposal from the engine (all of them in one batched
  ``generate`` call). A proposal is used only when it parses strictly and verifies
  (:mod:`evals.environments`); otherwise the deterministic resolver's environment is verified in
  its place, and its row records why the model's was not used (``reason code: detail``).
- Every verdict is stored in ``task_environment`` under its ``env_hash``, so the same proposal for
  the same task content is verified once. The functions here flush, never commit.
- A mined task's rows reference its ``eval_task`` row (deleted with it). Its row is locked
  ``FOR KEY SHARE`` for the caller's transaction first, so an erasure waits for the pass; one
  already gone (or being deleted) is skipped as ``erased``.
- Success rate = model proposals verified / proposals asked of the model (:class:`SetupReport`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from app.core.errors import InfrastructureError
from app.inference.engine import InferenceEngine, SamplingParams
from app.models import EvalTask, TaskEnvironment
from evals.environment_imports import resolve_environment
from evals.environments import (
    EnvironmentPolicy,
    EnvironmentProposal,
    ParsedProposal,
    Verification,
    environment_hash,
    parse_proposal,
    task_key,
    verify_environment,
)
from evals.mined import MINED_SUITE
from evals.tasks.mined import preferred_verified_environment
from evals.tasks.model import Task

PROMPT = """The tests of this task run with: {command}
{files}

Set up the environment these tests run in.
"dependencies": the Python distributions the code and the tests import, chosen from: {allowed}.
"files": extra data or config files the tests read (path -> text), never code; {{}} when none.
Reply with one JSON object and nothing else, with the keys "dependencies" (a list of names) and "files"."""
"""The user turn of a proposal request (the model's chat template adds its own system prompt). The
instruction comes last; the keys are described, not shown: SmolLM2-135M answered an instruction
placed before the files with prose about the code, and copied a shown template (``[...]``) verbatim
(docs/tasks.md)."""

REPLY_PREFIX = '{"dependencies": ['
"""The start of the assistant's turn, written for the model: the reply parsed is this prefix and
the completion (without it SmolLM2-135M answered with prose or code)."""


@dataclass
class SetupReport:
    """What one pass did.

    Attributes:
        tasks: tasks examined.
        cached: tasks whose verified environment was reused (no model call).
        proposed: proposals asked of the model (one per task not cached).
        parsed: proposals that parsed strictly and respected the policy.
        verified: model proposals verified (the reference passed in them).
        fallbacks: tasks that got the resolver's environment instead.
        fallback_verified: fallbacks that verified.
        reasons: why model proposals were not used (reason code -> count).
        erased: mined tasks skipped because their ``eval_task`` row is gone or being deleted.
        outcomes: per task ``{task_id, origin, verified, reason, env_hash}``; origin is ``cache``,
            ``model`` or ``fallback``.
    """

    tasks: int = 0
    cached: int = 0
    proposed: int = 0
    parsed: int = 0
    verified: int = 0
    fallbacks: int = 0
    fallback_verified: int = 0
    reasons: Counter = field(default_factory=Counter)
    erased: int = 0
    outcomes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def success_rate(self) -> float | None:
        """Model proposals verified / proposed; None when nothing was proposed."""
        return self.verified / self.proposed if self.proposed else None

    @property
    def unverified(self) -> int:
        """Tasks left without a verified environment (model and fallback both failed)."""
        return self.fallbacks - self.fallback_verified

    def as_dict(self) -> dict[str, Any]:
        """The counts, the success rate and the reasons (JSON-ready; outcomes left out)."""
        return {
            "tasks": self.tasks,
            "cached": self.cached,
            "proposed": self.proposed,
            "parsed": self.parsed,
            "verified": self.verified,
            "success_rate": self.success_rate,
            "fallbacks": self.fallbacks,
            "fallback_verified": self.fallback_verified,
            "unverified": self.unverified,
            "reasons": dict(sorted(self.reasons.items())),
            "erased": self.erased,
        }


def proposal_prompt(task: Task, policy: EnvironmentPolicy, *, max_file_chars: int = 2500, budget: int = 6000) -> str:
    """The request for ``task``: the test command, the solved repository and the hidden tests as
    ``path:`` + fenced block (a file past ``max_file_chars`` or the remaining ``budget`` of characters
    is cut, marked ``...``), then the format and the allowed list."""
    shown = {**task.files, **task.reference_files, **task.test_files}
    parts = []
    for path, text in shown.items():
        cut = text[: min(max_file_chars, max(budget, 0))]
        budget -= len(cut)
        lang = "python" if path.endswith(".py") else ""
        parts.append(f"{path}:\n```{lang}\n{cut.rstrip()}{' ...' if len(cut) < len(text) else ''}\n```")
    return PROMPT.format(allowed=", ".join(policy.allowed), command=task.test_command, files="\n".join(parts))


def propose_environments(
    engine: InferenceEngine, tasks: Sequence[Task], policy: EnvironmentPolicy, *, max_tokens: int = 256
) -> list[str]:
    """The model's reply to :func:`proposal_prompt` for each task (:data:`REPLY_PREFIX` and its
    completion), greedy, in one batch.

    Raises:
        InfrastructureError: the engine's server is unreachable or errs.
    """
    if not tasks:
        return []
    tok = engine.tokenizer
    prompts = []
    for task in tasks:
        messages = [{"role": "user", "content": proposal_prompt(task, policy)}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + REPLY_PREFIX
        prompts.append(list(tok(text, add_special_tokens=False).input_ids))
    generations = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [REPLY_PREFIX + tok.decode(g.token_ids, skip_special_tokens=True) for g in generations]


def cached_environment(session: Session, key: str) -> TaskEnvironment | None:
    """The verified environment stored for task key ``key`` (a model's before a fallback's), or None."""
    return preferred_verified_environment(session, TaskEnvironment.task_key == key)


def environment_for(session: Session, task: Task, policy: EnvironmentPolicy) -> EnvironmentProposal | None:
    """The verified environment of ``task`` under ``policy``, or None when none is stored."""
    row = cached_environment(session, task_key(task, policy))
    return None if row is None else EnvironmentProposal.model_validate(row.proposal)


def _mined_task_held(session: Session, task_id: str) -> bool:
    """Whether the mined task's ``eval_task`` row exists, locking it ``FOR KEY SHARE`` (an erasure to
    come waits for this transaction); one a deletion holds is skipped, not waited for."""
    return (
        session.execute(
            select(EvalTask.task_id)
            .where(EvalTask.task_id == task_id)
            .with_for_update(read=True, key_share=True, skip_locked=True)
        ).first()
        is not None
    )


def _verdict(
    session: Session,
    task: Task,
    key: str,
    proposal: EnvironmentProposal,
    policy: EnvironmentPolicy,
    *,
    origin: str,
    reason: str | None,
    checkpoint_id: str | None,
    extra: dict[str, Any] | None = None,
) -> tuple[str, Verification]:
    """Verify ``proposal`` (or reuse the stored verdict of the same ``env_hash``) and store it, with
    ``extra`` beside the verdict's detail; flush.

    A stored fallback row takes this pass's ``reason`` and ``checkpoint_id``; a stored model row stays.
    """
    env_hash = environment_hash(key, proposal)
    stored = session.get(TaskEnvironment, env_hash)
    if stored is not None:
        verdict = Verification(stored.verified, None if stored.verified else "reference_failed", stored.detail)
    else:
        verdict = verify_environment(task, proposal, policy)
    note = reason if origin == "fallback" else verdict.reason
    session.execute(
        insert(TaskEnvironment)
        .values(
            env_hash=env_hash,
            task_key=key,
            task_id=task.id,
            source=task.source,
            eval_task_id=task.id if task.source == MINED_SUITE else None,
            origin=origin,
            proposal=proposal.model_dump(),
            verified=verdict.verified,
            reason=note,
            checkpoint_id=checkpoint_id,
            detail={**verdict.detail, **(extra or {})},
        )
        .on_conflict_do_update(
            index_elements=[TaskEnvironment.env_hash],
            set_={"reason": note, "checkpoint_id": checkpoint_id},
            where=TaskEnvironment.origin == "fallback",
        )
    )
    session.flush()
    return env_hash, verdict


def setup_environments(
    session: Session,
    tasks: Sequence[Task],
    engine: InferenceEngine,
    policy: EnvironmentPolicy,
    *,
    max_tokens: int = 256,
) -> SetupReport:
    """Give every task in ``tasks`` a verified environment where one can be found (see the module
    invariants); flush.

    Returns:
        A :class:`SetupReport` (model-proposal reasons: ``unparseable``, ``invalid_schema``,
        ``dependency_not_allowed``, ``dependency_not_installed``, ``forbidden_file``,
        ``too_many_files``, ``reference_failed``, ``model_error``).
    Raises:
        sqlalchemy.exc.DBAPIError: database faults (the caller's transaction rolls back).
    """
    report = SetupReport(tasks=len(tasks))
    todo: list[tuple[Task, str]] = []
    for task in tasks:
        if task.source == MINED_SUITE and not _mined_task_held(session, task.id):
            report.erased += 1
            continue
        key = task_key(task, policy)
        row = cached_environment(session, key)
        if row is not None:
            report.cached += 1
            report.outcomes.append(
                {"task_id": task.id, "origin": "cache", "verified": True, "reason": None, "env_hash": row.env_hash}
            )
        else:
            todo.append((task, key))
    report.proposed = len(todo)
    try:
        replies = propose_environments(engine, [t for t, _ in todo], policy, max_tokens=max_tokens)
        parsed = [parse_proposal(reply, t, policy) for reply, (t, _) in zip(replies, todo, strict=True)]
    except InfrastructureError as exc:  # the server is down: every task falls back, saying so
        replies = [""] * len(todo)
        parsed = [ParsedProposal(None, "model_error", str(exc)[:200]) for _ in todo]
    checkpoint_id = getattr(engine, "checkpoint_id", None)
    for (task, key), reply, outcome in zip(todo, replies, parsed, strict=True):
        reason, detail = outcome.reason, outcome.detail
        if outcome.proposal is not None:
            report.parsed += 1
            env_hash, verdict = _verdict(
                session, task, key, outcome.proposal, policy, origin="model", reason=None, checkpoint_id=checkpoint_id
            )
            if verdict.verified:
                report.verified += 1
                report.outcomes.append(
                    {"task_id": task.id, "origin": "model", "verified": True, "reason": None, "env_hash": env_hash}
                )
                continue
            tail = verdict.detail.get("stderr_tail", "").strip().splitlines()
            reason, detail = verdict.reason, tail[-1] if tail else f"exit code {verdict.detail.get('exit_code')}"
        report.reasons[reason] += 1
        report.fallbacks += 1
        proposal, resolved = resolve_environment(task, policy)
        note = f"{reason}: {detail}".rstrip(": ")
        env_hash, verdict = _verdict(
            session,
            task,
            key,
            proposal,
            policy,
            origin="fallback",
            reason=note,
            checkpoint_id=checkpoint_id,
            extra={"resolver": resolved, "model_reply": reply[:500]},
        )
        report.fallback_verified += verdict.verified
        report.outcomes.append(
            {
                "task_id": task.id,
                "origin": "fallback",
                "verified": verdict.verified,
                "reason": note,
                "env_hash": env_hash,
                "unresolved": resolved["unresolved"],
            }
        )
    return report
