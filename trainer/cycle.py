"""One training cycle: production checkpoint + new trajectories -> a registered candidate.

Invariants:
- Single-flight: a cycle runs only while holding the trainer's advisory lock; a second caller
  returns ``locked`` at once.
- Crash-safe: a cycle killed at any point leaves no visible partial checkpoint (the store publishes
  directories atomically) and no half-registered one (registration is one transaction). The next
  cycle marks the dead cycle ``failed``, sweeps staging debris and unregistered trained
  directories, and starts clean from the last succeeded cycle's watermark.
- A candidate is always ``generation = parent.generation + 1`` and names its parent, data window,
  trajectories (with event ids and offsets), exclusions, reward spec and resolved config.
- A cycle the update watch stopped (``max_kl_per_token``, ``min_entropy``) still registers its
  candidate, with ``stopped_early`` (step and reason) in the manifest and metrics: the gate decides.
  It keeps its whole claim: the trajectories of the steps it did not take set their task groups'
  baselines (so the advantages it trained on), and for the next parent they are off-policy data
  whose KL to it the watch would count at once. The manifest lists them as ``not_trained``
  (``untrained_trajectories`` in the metrics).
- A cycle claims only what it schedules: every trajectory in the manifest has tokens in micro-batches
  that every epoch trains (unless the update watch stops the cycle: above). A step budget
  (``max_steps``) shrinks the claim (whole task groups, newest first, are deferred to the next
  cycle), never the schedule
  (:func:`trainer.training.fit_claim_to_budget`).
- Data parallel (``dp``, under torchrun): rank 0 runs this function and alone selects, writes and
  registers; the other ranks run :func:`trainer.training.train_policy` on what it broadcasts
  (:func:`run_parallel_cycle`, :mod:`trainer.distributed`).
"""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from app.checkpoints.store import STABLE, CheckpointStore
from app.core.db import get_engine, session_scope
from app.core.errors import CheckpointError, ConfigurationError
from app.core.telemetry import span_reference, tracer
from app.models import Checkpoint
from app.repositories.checkpoints import get_production
from trainer.checkpointing import new_checkpoint_id, write_checkpoint
from trainer.config import TrainerConfig, load_config
from trainer.distributed import CycleWork, DataParallel
from trainer.metrics import data_summary, summarize
from trainer.records import (
    cycle_lock,
    fail_interrupted_cycles,
    finish_cycle,
    register_candidate,
    start_cycle,
    succeeded_cycle_ids,
)
from trainer.selection import select_cycle_data
from trainer.step import planned_steps
from trainer.trace_links import link_producer_spans
from trainer.training import fit_claim_to_budget, train_policy

_tracer = tracer("flywheel.trainer")


@dataclass
class CycleResult:
    """What a cycle did. ``status``: ``succeeded`` | ``skipped`` | ``locked``."""

    status: str
    detail: str
    cycle_id: str | None = None
    parent_id: str | None = None
    checkpoint_id: str | None = None
    path: str | None = None
    num_trajectories: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the CLI's ``--json`` output and the Celery task's result)."""
        return asdict(self)


def sweep_unregistered(store: CheckpointStore, session) -> list[str]:
    """Remove staging debris and STABLE *trained* directories whose cycle never registered them
    (a cycle killed between publishing and its transaction). Call only while holding the lock.

    Returns:
        Ids of removed checkpoint directories.
    """
    store.sweep_staging()
    removed = []
    for checkpoint_id in store.list_stable():
        manifest = store.manifest(checkpoint_id)
        if manifest.get("kind") != "trained" or session.get(Checkpoint, checkpoint_id) is not None:
            continue
        cycle_of = manifest.get("cycle_id")
        if cycle_of in succeeded_cycle_ids(session, [cycle_of] if cycle_of else []):
            continue
        path = store.path(checkpoint_id)
        (path / STABLE).unlink(missing_ok=True)  # invisible first, then gone
        shutil.rmtree(path, ignore_errors=True)
        removed.append(checkpoint_id)
    return removed


def run_cycle(
    config: TrainerConfig | None = None,
    *,
    store: CheckpointStore | None = None,
    progress: bool = False,
    now: datetime | None = None,
    dry_run: bool = False,
    parent_id: str | None = None,
    dp: DataParallel | None = None,
) -> CycleResult:
    """Run one cycle (see the module docstring).

    Args:
        config: trainer config (default: ``trainer/configs/default.toml``).
        store: checkpoint store (default: from settings).
        progress: show a rich progress bar.
        now: the cycle's clock for data selection (default: the database's).
        dry_run: select data and report, without training or writing anything.
        parent_id: train from this registered checkpoint instead of production (ablations and
            planted regressions; the continual loop always trains production).
        dp: the data-parallel group when this is rank 0 under torchrun (others: ``run_parallel_cycle``).

    Returns:
        :class:`CycleResult`.

    Raises:
        ConfigurationError: no production checkpoint (or no checkpoint ``parent_id``) or no database.
        CheckpointError: the production checkpoint's directory is missing or not STABLE.
    """
    config = config or load_config()
    store = store or CheckpointStore.from_settings()
    torch.set_num_threads(config.threads)
    with _tracer.start_as_current_span("trainer.cycle") as span, cycle_lock(get_engine()) as held:
        if not held:
            span.set_attribute("flywheel.cycle.status", "locked")
            return CycleResult(status="locked", detail="another training cycle holds the lock")
        with session_scope() as session:
            interrupted = 0 if dry_run else fail_interrupted_cycles(session)
            swept = [] if dry_run else sweep_unregistered(store, session)
            parent = get_production(session) if parent_id is None else session.get(Checkpoint, parent_id)
            if parent is None:
                raise ConfigurationError(
                    "no production checkpoint: run `flywheel model init` first"
                    if parent_id is None
                    else f"no checkpoint {parent_id!r}"
                )
            session.expunge(parent)
            data = select_cycle_data(session, config.data, parent, now=now)
        data.exclude_low_contrast(config.data.min_group_reward_range)
        span.set_attributes(
            {
                "flywheel.parent_id": parent.id,
                "flywheel.trajectories.used": len(data.used),
                "flywheel.trajectories.excluded": len(data.excluded),
            }
        )
        cycle_id = uuid.uuid4()
        base: dict[str, Any] = dict(
            cycle_id=str(cycle_id),
            parent_id=parent.id,
            num_trajectories=len(data.used),
            excluded=data.excluded_counts(),
        )
        housekeeping = {"interrupted_cycles": interrupted, "swept": swept}
        if dry_run:
            return CycleResult(
                status="skipped",
                detail="dry run",
                **{**base, "cycle_id": None},
                metrics={**housekeeping, "watermark": data.manifest_section()["watermark"]},
            )
        if len(data.used) < config.data.min_new_trajectories:
            detail = f"{len(data.used)} usable trajectories < min_new_trajectories={config.data.min_new_trajectories}"
            with session_scope() as session:
                finish_cycle(
                    session,
                    cycle_id,
                    status="skipped",
                    detail=detail,
                    parent_id=parent.id,
                    metrics={"excluded": data.excluded_counts(), **housekeeping},
                )
            span.set_attribute("flywheel.cycle.status", "skipped")
            return CycleResult(status="skipped", detail=detail, **base, metrics=housekeeping)
        with session_scope() as session:
            start_cycle(session, cycle_id, parent.id)
        span.set_attribute("flywheel.cycle_id", str(cycle_id))
        try:
            result = _train_and_register(config, store, parent, data, cycle_id, progress, dp)
        except Exception as exc:
            with session_scope() as session:
                finish_cycle(session, cycle_id, status="failed", detail=f"{type(exc).__name__}: {exc}"[:4000])
            raise
        result.metrics.update(housekeeping)
        span.set_attributes({"flywheel.checkpoint_id": result.checkpoint_id, "flywheel.cycle.status": result.status})
        return result


def _parent_dir(store: CheckpointStore, parent) -> Path:
    path = Path(parent.path)
    if (path / STABLE).exists():
        return path
    if store.is_stable(parent.id):
        return store.stable_path(parent.id)
    raise CheckpointError(f"production checkpoint {parent.id} has no STABLE directory at {parent.path}")


def _train_and_register(
    config: TrainerConfig,
    store: CheckpointStore,
    parent,
    data,
    cycle_id: uuid.UUID,
    progress: bool,
    dp: DataParallel | None = None,
) -> CycleResult:
    started = time.perf_counter()
    parent_dir = _parent_dir(store, parent)
    fit_claim_to_budget(data, config)  # before the other ranks see the data: they train what rank 0 claims
    with session_scope() as session:  # the trainer.cycle span links to the producer spans of what it trains on
        link_producer_spans(session, data.used)
    if dp is not None:
        dp.send_work(CycleWork(parent_dir=parent_dir, trajectories=data.used))
    trained = train_policy(config, parent_dir, data.used, progress=progress, dp=dp)
    model, optimizer, history, mismatch = trained.model, trained.optimizer, trained.history, trained.mismatch
    assert model is not None  # run_cycle runs on rank 0, which gets the trained model
    rewards, advantages, groups = trained.rewards, trained.advantages, trained.groups
    metrics = summarize(
        history,
        data=data_summary(rewards.tolist(), advantages.tolist(), int(groups.max()) + 1),
        mismatch=mismatch,
        seconds=time.perf_counter() - started,
    )
    metrics["micro_batches"], metrics["epochs"] = trained.micro_batches, config.epochs
    metrics["planned_steps"], metrics["pi_old"] = planned_steps(trained.micro_batches, config), config.pi_old
    if config.invert_reward:
        metrics["invert_reward"] = True
    if config.data.placebo:
        metrics["placebo"], metrics["placebo_mode"] = True, config.data.placebo_mode
    metrics["placement"] = {**trained.placement.describe(), "ranks": dp.world_size if dp is not None else 1}
    assert trained.trained is not None  # train_policy always says which trajectories it trained on
    not_trained = [str(t.id) for i, t in enumerate(data.used) if i not in trained.trained]
    metrics["untrained_trajectories"] = len(not_trained)
    checkpoint_id = new_checkpoint_id()
    section = data.manifest_section()
    for entry, adv in zip(section["trajectories"], advantages.tolist()):
        entry["advantage"] = adv
    section["not_trained"] = not_trained
    manifest = {
        "parent_id": parent.id,
        "generation": parent.generation + 1,
        "cycle_id": str(cycle_id),
        "created_at": datetime.now(UTC).isoformat(),
        "trace": span_reference(),  # the trainer.cycle span: eval runs and the gate link to it
        "placement": metrics["placement"],  # device and resolved precision
        "pi_old": config.pi_old,
        "seed": config.seed,  # every draw of the cycle (trainer.config.TrainerConfig.seed)
        "placebo": config.data.placebo,  # rewards shuffled (trainer.training.placebo_permutation)
        "placebo_mode": config.data.placebo_mode if config.data.placebo else None,
        "stopped_early": metrics["stopped_early"],  # the update watch's reason, or None
        **section,
    }
    with _tracer.start_as_current_span("trainer.write_checkpoint") as span:
        span.set_attribute("flywheel.checkpoint_id", checkpoint_id)
        path = write_checkpoint(
            store,
            checkpoint_id,
            model=model,
            parent_dir=parent_dir,
            manifest=manifest,
            config=config,
            metrics=metrics,
            curves=config.plot_curves,
            optimizer=optimizer if config.save_optimizer else None,
        )
    with _tracer.start_as_current_span("trainer.register"), session_scope() as session:
        register_candidate(
            session,
            cycle_id=cycle_id,
            checkpoint_id=checkpoint_id,
            path=str(path),
            parent=session.get_one(Checkpoint, parent.id),
            data=data,
            manifest=store.manifest(checkpoint_id),
            metrics=metrics,
        )
    summary = {k: v for k, v in metrics.items() if k != "history"}
    return CycleResult(
        status="succeeded",
        detail=f"candidate {checkpoint_id} from {parent.id}",
        cycle_id=str(cycle_id),
        parent_id=parent.id,
        checkpoint_id=checkpoint_id,
        path=str(path),
        num_trajectories=len(data.used),
        excluded=data.excluded_counts(),
        metrics=summary,
    )


def run_parallel_cycle(
    config: TrainerConfig,
    dp: DataParallel,
    *,
    progress: bool = False,
    dry_run: bool = False,
    parent_id: str | None = None,
) -> CycleResult:
    """One cycle on every rank of ``dp`` (see :mod:`trainer.distributed`'s invariants): rank 0 runs
    :func:`run_cycle` and returns its result, the others train what it broadcasts and return a
    ``CycleResult`` naming their rank.

    Raises:
        As :func:`run_cycle` on rank 0; the other ranks raise what their training raises.
    """
    if dp.is_main:
        try:
            return run_cycle(config, progress=progress, dry_run=dry_run, dp=dp, parent_id=parent_id)
        finally:
            dp.release_followers()
    work = dp.receive_work()
    if work is None:
        return CycleResult(status="skipped", detail=f"rank {dp.rank}/{dp.world_size}: rank 0 trained nothing")
    torch.set_num_threads(config.threads)
    trained = train_policy(config, work.parent_dir, work.trajectories, dp=dp)
    last = trained.history[-1] if trained.history else None
    return CycleResult(
        status="succeeded",
        detail=f"rank {dp.rank}/{dp.world_size}: trained with rank 0, which writes and registers the candidate",
        num_trajectories=len(work.trajectories),
        metrics={"steps": len(trained.history), "final_loss": last.loss if last else None},
    )
