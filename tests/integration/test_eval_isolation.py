"""A candidate's evals over the OpenAI-compatible (vLLM) path never touch production's server.

Two ``flywheel serve`` apps on real HTTP stand in for the production and the eval vLLM servers.
The runner's engine (``evals.runner.eval_engine``) loads the candidate on the eval server; the
production server keeps its checkpoint id, its weights' checksum and its greedy completion
(token ids and log-probs: a logit fingerprint over the wire)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from app.checkpoints.store import CheckpointStore
from app.core.errors import ConfigurationError
from app.core.settings import get_settings
from app.inference.engine import SamplingParams
from serving.engine import setup_engine
from serving.openai_engine import OpenAICompatEngine
from serving.reference_engine import ReferenceEngine
from serving.server import create_app

PROMPT = [1, 17, 300, 4242, 9, 77, 5]


def _serve(engine: ReferenceEngine) -> tuple[str, object, object]:
    from serving.testing import serve_in_thread

    return serve_in_thread(create_app(engine))


@pytest.fixture(scope="module")
def servers(tiny_model_dir) -> Iterator[dict]:
    """Production and eval servers, both starting on the production checkpoint (as in compose)."""
    prod = ReferenceEngine(tiny_model_dir, checkpoint_id="prod-1", num_threads=1, device="cpu")
    evals = ReferenceEngine(tiny_model_dir, checkpoint_id="prod-1", num_threads=1, device="cpu")
    started = [_serve(prod), _serve(evals)]
    try:
        yield {"prod_url": started[0][0], "eval_url": started[1][0], "prod": prod, "eval": evals}
    finally:
        for _, server, thread in started:
            server.should_exit = True
            thread.join(timeout=10)


@pytest.fixture
def vllm_settings(monkeypatch, servers, tmp_path):
    monkeypatch.setenv("FLYWHEEL_SERVING_ENGINE", "vllm")
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", servers["prod_url"])
    monkeypatch.setenv("FLYWHEEL_SERVING_EVAL_URL", servers["eval_url"])
    monkeypatch.setenv("FLYWHEEL_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    get_settings.cache_clear()
    yield get_settings()
    get_settings.cache_clear()


def _weights_checksum(engine: ReferenceEngine) -> str:
    h = hashlib.sha256()
    for name, t in sorted(engine.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def _fingerprint(url: str) -> tuple[str, list[int], list[float]]:
    client = OpenAICompatEngine(url)
    try:
        g = client.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
        return client.checkpoint_id, g.token_ids, [round(x, 5) for x in g.logprobs]
    finally:
        client.close()


def _publish_candidate(tmp_path) -> None:
    import shutil

    from app.checkpoints.testing import build_tiny_model

    src = build_tiny_model(tmp_path / "cand-src", seed=7)
    store = CheckpointStore.from_settings()
    with store.writer("cand-1") as staging:
        for f in src.iterdir():
            shutil.copy2(f, staging / f.name)
        (staging / "manifest.json").write_text('{"checkpoint_id": "cand-1", "kind": "trained"}')


def test_evaluating_a_candidate_leaves_production_weights_unchanged(servers, vllm_settings, tmp_path):
    from evals.runner import eval_engine

    _publish_candidate(tmp_path)
    prod_before, checksum_before = _fingerprint(servers["prod_url"]), _weights_checksum(servers["prod"])
    assert prod_before[0] == "prod-1"

    engine = eval_engine("cand-1")
    try:
        assert engine.checkpoint_id == "cand-1"
        evaluated = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    finally:
        engine.close()

    assert servers["eval"].checkpoint_id == "cand-1"  # the candidate went to the eval server
    assert (evaluated.token_ids, [round(x, 5) for x in evaluated.logprobs]) != prod_before[1:]  # it differs
    assert servers["prod"].checkpoint_id == "prod-1"
    after = _fingerprint(servers["prod_url"])
    # same checkpoint, same greedy tokens, same log-probs up to float rounding (a repeated prompt is
    # served from the engine's prefix cache, whose partial re-encode rounds differently, ~1e-6)
    assert after[:2] == prod_before[:2]
    assert after[2] == pytest.approx(prod_before[2], abs=1e-4)
    assert _weights_checksum(servers["prod"]) == checksum_before


def test_vllm_evals_need_a_server_of_their_own(monkeypatch, servers, vllm_settings):
    monkeypatch.delenv("FLYWHEEL_SERVING_EVAL_URL")
    get_settings.cache_clear()
    with pytest.raises(ConfigurationError, match="FLYWHEEL_SERVING_EVAL_URL"):
        setup_engine(checkpoint_id="cand-1", role="eval")
    monkeypatch.setenv("FLYWHEEL_SERVING_EVAL_URL", servers["prod_url"] + "/v1/")
    get_settings.cache_clear()
    with pytest.raises(ConfigurationError, match="is the production server"):
        setup_engine(checkpoint_id="cand-1", role="eval")
    with pytest.raises(ConfigurationError, match="unknown engine role"):
        setup_engine(checkpoint_id="cand-1", role="staging")
    assert servers["prod"].checkpoint_id == "prod-1"
