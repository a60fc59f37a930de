"""Service logs: JSON lines carry the trace and span id of the span that wrote them; plain text on a
terminal; ``FLYWHEEL_LOG_FORMAT`` picks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from app.core.logs import use_json
from app.core.settings import LogSettings

SERVICE = """
import logging
from app.core.telemetry import configure_service_logging, configure_telemetry, tracer
configure_service_logging(service="flywheel-test")
configure_telemetry("flywheel-test")
log = logging.getLogger("flywheel.test")
log.info("before any span")
with tracer("flywheel.test").start_as_current_span("work") as span:
    ctx = span.get_span_context()
    print(f"{ctx.trace_id:032x} {ctx.span_id:016x}", flush=True)
    log.warning("inside %s", "work", extra={"batch": 7})
"""


def _run(fmt: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLYWHEEL_LOG_FORMAT": fmt, "FLYWHEEL_TELEMETRY_EXPORTER": "none"}
    return subprocess.run([sys.executable, "-c", SERVICE], env=env, capture_output=True, text=True, timeout=120)


def test_a_json_line_written_inside_a_span_carries_its_trace_and_span_id():
    out = _run("json")
    assert out.returncode == 0, out.stderr[-2000:]
    trace_id, span_id = out.stdout.split()
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    before, inside = lines
    assert before["message"] == "before any span" and before["trace_id"] is None and before["span_id"] is None
    assert inside["message"] == "inside work" and inside["level"] == "WARNING" and inside["batch"] == 7
    assert (inside["trace_id"], inside["span_id"]) == (trace_id, span_id)
    assert inside["logger"] == "flywheel.test" and inside["service"] == "flywheel-test" and inside["timestamp"]


def test_text_lines_stay_plain():
    out = _run("text")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.splitlines()[1].endswith("WARNING flywheel.test: inside work")
    assert not out.stderr.lstrip().startswith("{")


def test_auto_is_text_on_a_terminal_and_json_elsewhere(tmp_path):
    leader, follower = os.openpty()
    with open(follower, "w") as tty, open(tmp_path / "log", "w") as file:
        assert not use_json(LogSettings(format="auto"), tty)
        assert use_json(LogSettings(format="auto"), file)
        assert use_json(LogSettings(format="json"), tty) and not use_json(LogSettings(format="text"), file)
    os.close(leader)
