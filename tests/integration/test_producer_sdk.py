"""The producer SDK as a product backend installs it: ``pip install ./producers`` into a fresh
virtualenv brings no torch, triton or SQLAlchemy, and that environment emits an event that arrives
on the broker and decodes to what was emitted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "sqlalchemy", "psycopg", "fastapi", "celery", "transformers")

EMIT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from producers.events.types import EditAccepted, EditAcceptedEvent
    from producers.producer import EventProducer

    bootstrap, topic, spool = sys.argv[1:4]
    event = EditAcceptedEvent(session_id="sdk-s1", user_id="sdk-u1", payload=EditAccepted(edit_id="sdk-e1"))
    with EventProducer(bootstrap, topic, spool_dir=Path(spool)) as producer:
        producer.emit(event)
        producer.flush(timeout_s=30)
        sent = producer.metrics["sent"]
    print(json.dumps({"event_id": str(event.event_id), "sent": sent,
                      "loaded": sorted(m.split(".")[0] for m in sys.modules)}))
""")


@pytest.fixture(scope="module")
def sdk_python(tmp_path_factory) -> Path:
    """The interpreter of a fresh virtualenv (no system site-packages) with only ``./producers``."""
    root = tmp_path_factory.mktemp("sdk")
    shutil.copytree(
        REPO / "producers", root / "producers", ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    )
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(root / "producers")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(f"pip install ./producers failed:\n{proc.stderr[-3000:]}")
    return python


def test_sdk_installs_without_heavy_dependencies(sdk_python):
    listed = subprocess.run(
        [str(sdk_python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed)}
    assert "flywheel-producer" in names and "kafka-python" in names and "pydantic" in names
    assert not names & set(HEAVY), f"the SDK pulled in {sorted(names & set(HEAVY))}"
    probe = subprocess.run(
        [str(sdk_python), "-c", "import app"], capture_output=True, text=True, cwd=sdk_python.parents[2]
    )
    assert probe.returncode != 0, "the service's packages must not be installed with the SDK"


def test_sdk_emits_an_event_the_broker_delivers(sdk_python, tmp_path, kafka_bootstrap):
    from kafka import KafkaConsumer

    from ops.broker import create_topics
    from producers.events import decode_event

    topic = "editor.interactions.sdk"
    create_topics(kafka_bootstrap, {topic: 1})
    proc = subprocess.run(
        [str(sdk_python), "-c", EMIT, kafka_bootstrap, topic, str(tmp_path / "spool")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sent"] == 1
    assert not set(out["loaded"]) & set(HEAVY), "emitting loaded a heavy module"

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=15_000,
    )
    try:
        events = [decode_event(m.value) for m in consumer]
    finally:
        consumer.close()
    assert [str(e.event_id) for e in events] == [out["event_id"]]
    assert events[0].session_id == "sdk-s1" and events[0].payload.edit_id == "sdk-e1"
