"""``auto`` precision is chosen by measurement: bf16 only on a CPU with bf16 instructions where a
probe of the model's matmuls finds it faster than fp32; the probe is kept per host and re-measured
when the host, torch or the thread count changes, or the cache is unreadable."""

from __future__ import annotations

import json

import pytest
import torch

import app.core.cpu
import app.inference.precision as precision
from app.inference.precision import Bf16Probe, bf16_is_faster, cached_probe, host_key, measure_bf16


@pytest.fixture(autouse=True)
def decide_afresh():
    """``bf16_is_faster`` decides once per process: clear it around a test that changes the host."""
    bf16_is_faster.cache_clear()
    yield
    bf16_is_faster.cache_clear()


def fake_probe(speedup: float) -> Bf16Probe:
    threads = torch.get_num_threads()
    return Bf16Probe(fp32_gflops=100.0, bf16_gflops=100.0 * speedup, threads=threads, key=host_key(threads))


def test_the_probe_times_both_dtypes_on_this_cpu():
    probe = measure_bf16(repeats=1)
    assert probe.fp32_gflops > 0 and probe.bf16_gflops > 0
    assert probe.threads == torch.get_num_threads() and probe.key == host_key(probe.threads)
    assert probe.speedup == pytest.approx(probe.bf16_gflops / probe.fp32_gflops)


def test_the_probe_is_measured_once_per_host_key_and_survives_a_bad_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(precision, "measure_bf16", lambda: calls.append(1) or fake_probe(2.0))
    first = cached_probe(tmp_path)
    assert cached_probe(tmp_path) == first and len(calls) == 1  # the second read the file
    stored = json.loads((tmp_path / precision.CACHE_FILE).read_text())
    assert stored["key"] == first.key and stored["speedup"] == 2.0

    stored["key"] = "another-host"
    (tmp_path / precision.CACHE_FILE).write_text(json.dumps(stored))
    cached_probe(tmp_path)
    assert len(calls) == 2  # stale: measured again
    (tmp_path / precision.CACHE_FILE).write_text("{not json")
    assert cached_probe(tmp_path) == first and len(calls) == 3

    blocked = tmp_path / "file"
    blocked.write_text("")
    assert cached_probe(blocked / "cache") == first  # cannot write: measured, logged, returned


@pytest.mark.parametrize(
    ("flags", "speedup", "expected"),
    [
        ({"avx512f", "amx_bf16"}, 2.8, True),  # the AMD and AMX hosts
        ({"avx512f", "avx512_bf16"}, 0.75, False),  # an Intel host with avx512_bf16, no AMX
        ({"avx512_bf16"}, 1.05, False),  # not faster by the 1.1 margin
        ({"avx2", "avx512f"}, 3.0, False),  # no bf16 instructions: no probe at all
    ],
)
def test_bf16_needs_the_instructions_and_the_measured_speedup(monkeypatch, flags, speedup, expected):
    monkeypatch.setattr(app.core.cpu, "cpu_flags", lambda: set(flags))
    probed = []
    monkeypatch.setattr(precision, "cached_probe", lambda: probed.append(1) or fake_probe(speedup))
    assert bf16_is_faster() is expected
    assert len(probed) == (1 if flags & {"amx_bf16", "avx512_bf16"} else 0)
