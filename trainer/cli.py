"""CLI commands of this package (registered on the main ``flywheel`` app). Import heavy modules
inside the command functions, never at module level."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add this package's commands to the main app."""
    app.command("train")(train)


def train(
    once: bool = typer.Option(False, "--once", help="run one cycle and exit (else loop every FLYWHEEL_TRAIN_INTERVAL)"),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="trainer TOML (default: trainer/configs/default.toml)"
    ),
    max_steps: int | None = typer.Option(None, "--max-steps", help="step budget: claim only what fits (`max_steps`)"),
    epochs: int | None = typer.Option(None, "--epochs", help="override `epochs`"),
    invert_reward: bool = typer.Option(
        False, "--invert-reward", help="train on the negated reward: a planted regression for the gate"
    ),
    placebo: bool = typer.Option(
        False,
        "--placebo",
        help="shuffle each cycle's rewards (`data.placebo`, within each task group by default): the control arm",
    ),
    placebo_mode: str | None = typer.Option(
        None, "--placebo-mode", help="override `data.placebo_mode`: within_group (default) or across_cycle"
    ),
    seed: int | None = typer.Option(None, "--seed", help="override `seed`: batch order, schedule, LoRA init, placebo"),
    same_data_as: str | None = typer.Option(
        None, "--same-data-as", help="train on exactly the trajectories this checkpoint trained on"
    ),
    lr: float | None = typer.Option(None, "--lr", help="override `optim.lr`"),
    min_new: int | None = typer.Option(None, "--min-new", help="override `data.min_new_trajectories`"),
    min_range: float | None = typer.Option(
        None,
        "--min-group-reward-range",
        help="override `data.min_group_reward_range`: leave out task groups whose rewards span less",
    ),
    parent: str | None = typer.Option(None, "--parent", help="train from this checkpoint instead of production"),
    device: str | None = typer.Option(None, "--device", help="override `device`: auto | cpu | cuda"),
    precision: str | None = typer.Option(None, "--precision", help="override `precision`: auto | bf16 | fp32"),
    pi_old: str | None = typer.Option(
        None, "--pi-old", help="override `pi_old`: recompute | behaviour (behaviour needs --epochs 1)"
    ),
    max_kl: float | None = typer.Option(
        None, "--max-kl-per-token", help="override `max_kl_per_token`: stop the cycle past this KL to pi_old"
    ),
    lora_rank: int | None = typer.Option(
        None, "--lora-rank", help="override `lora.rank`: train rank-r adapters merged afterwards (0: every weight)"
    ),
    grad_accum: int | None = typer.Option(None, "--grad-accum", help="override `grad_accum`: micro-batches a step"),
    dry_run: bool = typer.Option(False, "--dry-run", help="select data and report; train and write nothing"),
    as_json: bool = typer.Option(False, "--json", help="print the cycle result as one JSON line"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="rich progress bar"),
) -> None:
    """Run the continual trainer: production checkpoint + new finalized trajectories -> candidate.

    Data parallel: ``torchrun --nproc-per-node N -m ops.cli train ...`` (gloo on CPUs, NCCL on GPUs);
    rank 0 selects the data, writes and registers, every rank trains its share of each step; with
    ``[parallel] mode = "fsdp"`` the model is sharded over the ranks (FSDP2, trainer/sharding.py)."""
    from app.core.settings import get_settings
    from app.core.telemetry import configure_telemetry, shutdown_telemetry
    from app.inference.device import resolve_device
    from trainer.config import load_config
    from trainer.cycle import run_cycle, run_parallel_cycle
    from trainer.distributed import init_data_parallel, shutdown_data_parallel
    from trainer.sharding import init_sharded

    overrides = {
        k: v
        for k, v in (
            ("max_steps", max_steps),
            ("epochs", epochs),
            ("optim.lr", lr),
            ("data.min_new_trajectories", min_new),
            ("data.min_group_reward_range", min_range),
            ("data.same_data_as", same_data_as),
            ("invert_reward", invert_reward or None),
            ("data.placebo", placebo or None),
            ("data.placebo_mode", placebo_mode),
            ("seed", seed),
            ("device", device),
            ("precision", precision),
            ("pi_old", pi_old),
            ("max_kl_per_token", max_kl),
            ("lora.rank", lora_rank),
            ("grad_accum", grad_accum),
        )
        if v is not None
    }
    cfg = load_config(config, overrides)
    interval = get_settings().celery.train_interval
    # ranks other than 0 wait in a collective between cycles: allow a whole interval and a cycle
    dp = init_data_parallel(resolve_device(cfg.device), timeout_s=interval + 6 * 3600.0)
    if dp is not None and cfg.parallel.mode == "fsdp":  # the same process group, the model sharded over it
        dp = init_sharded(resolve_device(cfg.device), cfg.parallel)
    configure_telemetry("flywheel-trainer" if dp is None else f"flywheel-trainer-rank{dp.rank}")
    show = dp is None or dp.is_main  # one report per cycle: rank 0's
    try:
        while True:
            if dp is None:
                result = run_cycle(cfg, progress=progress and not as_json, dry_run=dry_run, parent_id=parent)
            else:
                result = run_parallel_cycle(
                    cfg, dp, progress=progress and not as_json, dry_run=dry_run, parent_id=parent
                )
            if show and as_json:
                typer.echo(json.dumps(result.to_dict(), default=str))
            elif show:
                _print_result(result)
            if once or dry_run:
                break
            time.sleep(interval)
    finally:
        shutdown_data_parallel()
        shutdown_telemetry()


def _print_result(result) -> None:
    colour = {"succeeded": "green", "skipped": "yellow", "locked": "yellow"}.get(result.status, "red")
    typer.secho(f"{result.status}: {result.detail}", fg=colour)
    if result.checkpoint_id:
        m = result.metrics
        final = m.get("final", {})
        typer.echo(f"  checkpoint {result.checkpoint_id} at {result.path}")
        data = m.get("data", {})
        typer.echo(
            f"  trajectories {result.num_trajectories} in {data.get('groups')} groups, mean reward "
            f"{data.get('reward_mean', 0):.3f}, mismatch KL(mu||pi_old) "
            f"{m.get('mismatch_before_training', {}).get('mismatch_kl', 0):.2e}"
        )
        typer.echo(
            f"  steps {m.get('steps')} ({m.get('epochs')} epoch(s) of {m.get('micro_batches')} micro-batches), "
            f"tokens/s {m.get('tokens_per_s', 0):.0f}, loss {final.get('loss', 0):+.4f}, "
            f"kl {final.get('kl', 0):.2e}"
        )
    if result.excluded:
        typer.echo("  excluded: " + ", ".join(f"{k}={v}" for k, v in result.excluded.items()))
