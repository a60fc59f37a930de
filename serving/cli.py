"""``flywheel model init|register``, ``flywheel serve``, ``flywheel watch`` and ``flywheel front``. Heavy
imports stay inside commands."""

from __future__ import annotations

import json
from pathlib import Path

import typer

model_app = typer.Typer(no_args_is_help=True, help="Model checkpoints: materialize the base model, register folders.")


@model_app.command("init")
def model_init(as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object")) -> None:
    """Materialize SmolLM2-135M-Instruct (GGUF -> fp32 safetensors) as checkpoint `base`, production if none."""
    from app.checkpoints.publish import init_base

    path = init_base()
    typer.echo(json.dumps({"checkpoint_id": "base", "path": str(path)}) if as_json else f"base -> {path}")


@model_app.command("register")
def model_register(
    path: Path = typer.Argument(..., exists=True, file_okay=False, help="a Hugging Face causal-LM folder"),
    checkpoint_id: str = typer.Option(None, "--id", help="checkpoint id (default: the folder name)"),
    status: str = typer.Option("candidate", "--status", help="candidate | production (only if none) | ..."),
    as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object"),
) -> None:
    """Copy a HF model folder into the checkpoint store and add its registry row."""
    from app.checkpoints.publish import register_model
    from app.models.checkpoints import CheckpointStatus

    try:
        wanted = CheckpointStatus(status)
    except ValueError:
        raise typer.BadParameter(f"unknown status {status!r}", param_hint="--status") from None
    cid = checkpoint_id or path.resolve().name
    final = register_model(path, cid, wanted, source=str(path.resolve().name))
    typer.echo(json.dumps({"checkpoint_id": cid, "path": str(final)}) if as_json else f"{cid} -> {final}")


def serve(
    checkpoint: str = typer.Option(None, "--checkpoint", help="checkpoint id (default: production)"),
    model_dir: Path = typer.Option(None, "--model-dir", help="serve this HF folder instead of a checkpoint"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8001, "--port"),
    threads: int = typer.Option(2, "--threads", help="torch CPU threads"),
    device: str = typer.Option(None, "--device", help="auto | cpu | cuda (default: FLYWHEEL_SERVING_DEVICE)"),
) -> None:
    """Serve the reference engine (transformers, one prompt at a time) over vLLM's OpenAI-compatible
    HTTP subset (completions + weight reload): for tests and hosts without vLLM."""
    import uvicorn

    from app.core.settings import get_settings, secret_value
    from serving.engine import resolve_checkpoint
    from serving.reference_engine import ReferenceEngine
    from serving.server import create_app

    cid, path = resolve_checkpoint(checkpoint, model_dir)
    engine = ReferenceEngine(
        path, checkpoint_id=cid, num_threads=threads, device=device or get_settings().serving.device
    )
    serving = get_settings().serving
    app = create_app(engine, api_key=secret_value(serving.api_key), admin_key=secret_value(serving.admin_key))
    typer.echo(f"serving {cid} from {path} on http://{host}:{port}")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def watch(once: bool = typer.Option(False, "--once", help="handle what is on the topic now, then exit")) -> None:
    """Follow production: move the inference engine on checkpoint.promoted / rolled_back, start and
    stop the canary engine on canary.started / stopped (on vLLM: the managed canary server unless
    FLYWHEEL_SERVING_CANARY_URL names one), and report both in $FLYWHEEL_HOME/serving.json."""
    from app.core.telemetry import configure_service_logging, configure_telemetry
    from serving.watcher import run_watch

    configure_service_logging(service="flywheel-watcher")
    configure_telemetry("flywheel-watcher", metrics_port=not once)
    run_watch(once=once)


def front(
    host: str = typer.Option(None, "--host", help="listen address (default: FLYWHEEL_FRONT_HOST)"),
    port: int = typer.Option(None, "--port", help="listen port (default: FLYWHEEL_FRONT_PORT)"),
) -> None:
    """The serving front: one OpenAI-compatible endpoint for the product backend. Routes each request
    by its `user` to production or the active canary, stamps `x-flywheel-checkpoint`, follows the
    lifecycle topic. Upstreams: FLYWHEEL_SERVING_URL and the canary server."""
    from app.core.telemetry import configure_service_logging, configure_telemetry
    from serving.front import FrontSettings, run_front

    configure_service_logging()
    configure_telemetry("flywheel-front", metrics_port=True)
    settings = FrontSettings.load()
    overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    run_front(settings.model_copy(update=overrides))


def register(app: typer.Typer) -> None:
    """Add ``model``, ``serve``, ``watch`` and ``front`` to the main app."""
    app.add_typer(model_app, name="model")
    app.command("serve")(serve)
    app.command("watch")(watch)
    app.command("front")(front)
