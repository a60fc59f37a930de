"""``flywheel simulate``: the editor simulator as live traffic (heavy imports stay inside the command)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def simulate(
    sessions: int = typer.Option(8, "--sessions", help="agent sessions to run"),
    tasks: int = typer.Option(None, "--tasks", help="distinct tasks (default: sessions / group size)"),
    group_size: int = typer.Option(4, "--group-size", help="sessions per task, run side by side"),
    max_turns: int = typer.Option(6, "--max-turns", help="model turns per session"),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="completion tokens per session"),
    max_tokens_per_turn: int = typer.Option(256, "--max-tokens-per-turn"),
    context_tokens: int = typer.Option(3072, "--context-tokens", help="context before self-summarization"),
    temperature: float = typer.Option(0.7, "--temperature", help="must match the trainer's loss.temperature"),
    privacy_rate: float = typer.Option(0.1, "--privacy-rate", help="share of sessions in privacy mode"),
    concurrency: int = typer.Option(64, "--concurrency", help="sessions in flight at once (batched in the engine)"),
    persistence_delay: float = typer.Option(
        5.0, "--persistence-delay", help="seconds before edit persistence is measured"
    ),
    source: str = typer.Option("dataframebench", "--source", help="task source (train split)"),
    difficulty_mix: str = typer.Option(
        None,
        "--difficulty-mix",
        help="request mix by task difficulty, LEVEL:WEIGHT pairs, e.g. '1:0.6,2:0.3,3:0.1' (default: uniform)",
    ),
    long_sessions: float = typer.Option(
        0.0,
        "--long-sessions",
        min=0.0,
        max=1.0,
        help="share of the task groups played as long functions_long sessions, which self-summarize "
        "(their turns raised to at least 4); 0: none",
    ),
    seed: int = typer.Option(0, "--seed"),
    keeps_wrong_rate: float = typer.Option(
        0.0,
        "--keeps-wrong-rate",
        min=0.0,
        max=1.0,
        help="share of plausible-but-wrong edits the developer keeps as if they worked",
    ),
    untested_rate: float = typer.Option(
        0.0, "--untested-rate", min=0.0, max=1.0, help="share of sessions whose tests it never runs"
    ),
    signal_loss_rate: float = typer.Option(
        0.0, "--signal-loss-rate", min=0.0, max=1.0, help="share of late signals that never arrive"
    ),
    late_signal_rate: float = typer.Option(
        0.0, "--late-signal-rate", min=0.0, max=1.0, help="share of late signals that arrive late"
    ),
    late_signal_delay: float = typer.Option(
        60.0, "--late-signal-delay", min=0.0, help="extra seconds of a late signal"
    ),
    model_dir: Path = typer.Option(
        None, "--model-dir", help="serve this HF folder instead of the production checkpoint"
    ),
    checkpoint: str = typer.Option(None, "--checkpoint", help="checkpoint id (default: production)"),
    threads: int = typer.Option(2, "--threads", help="torch CPU threads (reference engine)"),
    front: bool = typer.Option(
        None,
        "--front/--no-front",
        help="send sessions through the serving front (FLYWHEEL_FRONT_URL) as the product backend does: it "
        "routes each user to production or the canary and stamps the checkpoint that served. Default: on "
        "with FLYWHEEL_SERVING_ENGINE=vllm and neither --checkpoint nor --model-dir; --no-front: the "
        "configured engine directly, on one checkpoint, no canary",
    ),
    front_url: str = typer.Option(None, "--front-url", help="the front's base URL (default: FLYWHEEL_FRONT_URL)"),
    as_json: bool = typer.Option(
        False, "--json", help="print only JSON lines on stdout (one per session, then the summary)"
    ),
) -> None:
    """Play the product backend: real agent sessions on training tasks, every event to the broker.
    Through the serving front, an active canary's share of users is served by the candidate."""
    import torch

    from app.core.settings import get_settings
    from app.core.telemetry import configure_telemetry, shutdown_telemetry
    from app.inference.engine import InferenceEngine
    from ops.developer import DeveloperModel
    from ops.simulator import SimulatorConfig, run_simulation
    from producers.producer import EventProducer
    from serving.engine import setup_engine
    from serving.front import FrontSettings
    from serving.openai_engine import OpenAICompatEngine

    configure_telemetry("flywheel-simulator")
    torch.set_num_threads(threads)
    config = SimulatorConfig(
        sessions=sessions,
        tasks=tasks,
        group_size=group_size,
        max_turns=max_turns,
        max_tokens=max_tokens,
        max_tokens_per_turn=max_tokens_per_turn,
        context_tokens=context_tokens,
        temperature=temperature,
        privacy_rate=privacy_rate,
        concurrency=concurrency,
        persistence_delay_s=persistence_delay,
        source=source,
        difficulty_mix=parse_mix(difficulty_mix) if difficulty_mix else None,
        long_session_share=long_sessions,
        seed=seed,
        developer=DeveloperModel(
            keeps_wrong_rate=keeps_wrong_rate,
            untested_rate=untested_rate,
            signal_loss_rate=signal_loss_rate,
            late_signal_rate=late_signal_rate,
            late_signal_delay_s=late_signal_delay,
        ),
    )
    from evals.harness.sandbox_preflight import sandbox_preflight

    # The simulated developer grades every session's edit in the sandbox: without one each session
    # would fail at its end, so refuse before sending anything.
    preflight = sandbox_preflight()
    if not preflight.ready:
        typer.echo(f"flywheel simulate grades each session in the sandbox; {preflight.message()}", err=True)
        raise typer.Exit(3)
    if front is None:
        front = get_settings().serving.engine == "vllm" and checkpoint is None and model_dir is None
    engine: InferenceEngine
    if front:
        front_settings = FrontSettings.load()
        url = front_url or front_settings.client_url
        key = front_settings.api_key.get_secret_value() if front_settings.api_key else None
        engine = OpenAICompatEngine(url, api_key=key)  # raises, naming the URL, when no front answers there
        typer.echo(f"simulating {sessions} sessions through the serving front at {url}", err=as_json)
    else:
        engine = setup_engine(checkpoint_id=checkpoint, model_dir=model_dir)
        typer.echo(f"simulating {sessions} sessions with checkpoint {engine.checkpoint_id}", err=as_json)
    try:
        with EventProducer() as producer:
            summaries = run_simulation(config, engine, producer.emit, progress=lambda s: typer.echo(json.dumps(s)))
            producer.flush(timeout_s=60)
            metrics = producer.metrics
    finally:
        engine.close()
    shutdown_telemetry()
    by_checkpoint: dict[str, int] = {}
    for s in summaries:
        by_checkpoint[s.get("checkpoint_id", "?")] = by_checkpoint.get(s.get("checkpoint_id", "?"), 0) + 1
    typer.echo(
        json.dumps(
            {
                "sessions": len(summaries),
                "errors": sum(1 for s in summaries if "error" in s),
                "passed": sum(1 for s in summaries if s.get("passed")),
                "multi_segment": sum(1 for s in summaries if s.get("segments", 1) > 1),
                "accepted": sum(s.get("accepted", 0) for s in summaries),
                "rejected": sum(s.get("rejected", 0) for s in summaries),
                "by_checkpoint": by_checkpoint,
                "producer": metrics,
            }
        )
    )


def parse_mix(text: str) -> dict[int, float]:
    """``'1:0.6,2:0.3'`` -> ``{1: 0.6, 2: 0.3}``.

    Raises:
        typer.BadParameter: not comma-separated ``LEVEL:WEIGHT`` pairs of an int and a float.
    """
    try:
        return {int(k): float(v) for k, v in (pair.split(":") for pair in text.split(",") if pair.strip())}
    except ValueError as e:
        raise typer.BadParameter(f"expected LEVEL:WEIGHT pairs like '1:0.6,2:0.3', got {text!r}") from e


def register(app: typer.Typer) -> None:
    """Add this package's commands to the main app."""
    app.command("simulate")(simulate)
