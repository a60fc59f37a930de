"""``flywheel ab`` over the OpenAI-compatible (vLLM) path: both arms run on the eval server, production's
server keeps its checkpoint and weights, the report pairs every (task, sample), and each run is stored.

Two ``flywheel serve`` apps on real HTTP stand in for the production and the eval vLLM servers; the
arms are two tiny random models published in the checkpoint store."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.checkpoints.store import CheckpointStore
from app.checkpoints.testing import build_tiny_model
from app.core.settings import get_settings
from app.models import ABComparison
from serving.reference_engine import ReferenceEngine
from serving.server import create_app
from serving.testing import serve_in_thread

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def servers(tiny_model_dir) -> Iterator[dict]:
    prod = ReferenceEngine(tiny_model_dir, checkpoint_id="prod-1", num_threads=1, device="cpu")
    evals = ReferenceEngine(tiny_model_dir, checkpoint_id="prod-1", num_threads=1, device="cpu")
    started = [serve_in_thread(create_app(prod)), serve_in_thread(create_app(evals))]
    try:
        yield {"prod_url": started[0][0], "eval_url": started[1][0], "prod": prod, "eval": evals}
    finally:
        for _, server, thread in started:
            server.should_exit = True
            thread.join(timeout=10)


def _checksum(engine: ReferenceEngine) -> str:
    h = hashlib.sha256()
    for name, t in sorted(engine.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def _publish(checkpoint_id: str, seed: int, tmp_path) -> None:
    src = build_tiny_model(tmp_path / f"{checkpoint_id}-src", seed=seed)
    with CheckpointStore.from_settings().writer(checkpoint_id) as staging:
        for f in src.iterdir():
            shutil.copy2(f, staging / f.name)
        (staging / "manifest.json").write_text(json.dumps({"checkpoint_id": checkpoint_id, "kind": "trained"}))


def _report(output: str) -> dict:
    """The JSON line (the in-thread servers' load progress shares this process's stdout)."""
    return json.loads(output[output.index('{"base"') :].splitlines()[0])


def test_flywheel_ab_serves_both_arms_on_the_eval_server(monkeypatch, servers, tmp_path, session):
    from ops.cli import app

    monkeypatch.setenv("FLYWHEEL_SERVING_ENGINE", "vllm")
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", servers["prod_url"])
    monkeypatch.setenv("FLYWHEEL_SERVING_EVAL_URL", servers["eval_url"])
    monkeypatch.setenv("FLYWHEEL_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("FLYWHEEL_REPORT_DIR", str(tmp_path / "reports"))
    get_settings.cache_clear()
    _publish("ab-base", 3, tmp_path)
    _publish("ab-final", 4, tmp_path)
    before = _checksum(servers["prod"])

    args = ["ab", "ab-base", "ab-final", "--tasks", "2", "--samples", "2", "--max-turns", "1"]
    args += ["--max-tokens", "16", "--max-tokens-per-turn", "16", "--workers", "2", "--json"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = _report(result.output)

    assert (report["base"], report["final"], report["pairs"], report["tasks"]) == ("ab-base", "ab-final", 4, 2)
    assert report["split"] == "fresh" and report["errors"] == []
    assert report["sessions"] == {"base": {"ran": 4, "reused": 0}, "final": {"ran": 4, "reused": 0}}
    assert set(report["metrics"]) >= {"pass_rate", "edit_persistence", "dissatisfied_followup_rate"}
    assert (
        json.loads((tmp_path / "reports" / "ab" / report["report_path"].rsplit("/", 1)[-1]).read_text())["pairs"] == 4
    )
    # both arms went to the eval server, one after the other; production never moved
    assert servers["eval"].checkpoint_id == "ab-final"
    assert servers["prod"].checkpoint_id == "prod-1" and _checksum(servers["prod"]) == before

    again = CliRunner().invoke(app, args, catch_exceptions=False)
    rerun = _report(again.output)
    assert rerun["sessions"] == {"base": {"ran": 0, "reused": 4}, "final": {"ran": 0, "reused": 4}}
    assert rerun["metrics"] == report["metrics"]
    # each run is one stored result (the dashboard's curve)
    stored = session.scalars(select(ABComparison).order_by(ABComparison.id)).all()
    assert [(r.id, r.checkpoint_id, r.pairs) for r in stored] == [
        (report["comparison_id"], "ab-final", 4),
        (rerun["comparison_id"], "ab-final", 4),
    ]
