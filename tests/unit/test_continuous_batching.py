"""Continuous batching in the torch engine: a sequence's result does not depend on its companions
or on when it joined; prefix reuse equals a full re-encode; bounds, close and weight swaps."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from app.inference.engine import SamplingParams
from serving.torch_engine import TorchEngine, teacher_forced_logprobs

PROMPTS = [
    [1, 5, 6, 7, 8, 9, 10, 11],
    [1, 100, 200],
    [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [1, 42],
    [1, 7, 7, 7, 300, 301, 302, 303, 304, 305, 306],
    [1, 900, 901, 902, 903],
]
LIMITS = [12, 5, 9, 16, 3, 7]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(2)
    eng = TorchEngine(tiny_model_dir, checkpoint_id="tiny")
    yield eng
    eng.close()


def _alone(engine, prompt, params):
    """The sequence decoded with nothing else in flight."""
    assert engine.in_flight == 0
    return engine.submit(prompt, params).result(timeout=60)


def _same(a, b, tol=1e-5):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tol


def _wait_running(engine, min_tokens: int) -> None:
    """Until some sequence has decoded ``min_tokens`` tokens (it is mid-flight)."""
    deadline = time.monotonic() + 30
    while not any(len(s.tokens) >= min_tokens for s in list(engine._scheduler._running)):
        assert time.monotonic() < deadline, "no sequence got going"
        time.sleep(0.001)


def test_batched_greedy_equals_one_at_a_time(engine):
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in LIMITS]
    alone = [_alone(engine, p, sp) for p, sp in zip(PROMPTS, params)]
    futures = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    for a, f in zip(alone, futures):
        _same(a, f.result(timeout=60))
    for p, a in zip(PROMPTS, alone):
        ref = teacher_forced_logprobs(engine.model, p, a.token_ids, 0.0)
        assert torch.allclose(torch.tensor(a.logprobs), ref, atol=1e-4)


def test_many_threads_calling_generate_decode_together(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0)
    alone = [_alone(engine, p, params) for p in PROMPTS]
    out: dict[int, object] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, engine.generate([PROMPTS[i]], params)[0]))
        for i in range(len(PROMPTS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, a in enumerate(alone):
        _same(a, out[i])


def test_sequences_joining_mid_flight_get_the_alone_result(engine):
    long = SamplingParams(max_tokens=60, temperature=0.0)
    short = SamplingParams(max_tokens=8, temperature=0.0)
    alone_long = _alone(engine, PROMPTS[0], long)
    alone_short = [_alone(engine, p, short) for p in PROMPTS[1:4]]
    first = engine.submit(PROMPTS[0], long)
    _wait_running(engine, 5)
    joined = []
    for p in PROMPTS[1:4]:  # each joins while the first (and earlier joiners) decode
        joined.append(engine.submit(p, short))
        _wait_running(engine, 2)
    assert not first.done()
    _same(alone_long, first.result(timeout=60))
    for a, f in zip(alone_short, joined):
        _same(a, f.result(timeout=60))


def test_per_sequence_seed_makes_a_sample_independent_of_companions(engine):
    mine = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=11)
    alone = _alone(engine, PROMPTS[2], mine)
    others = [
        engine.submit(p, SamplingParams(max_tokens=20, temperature=0.8, seed=100 + i)) for i, p in enumerate(PROMPTS)
    ]
    _wait_running(engine, 3)
    together = engine.submit(PROMPTS[2], mine)
    _same(alone, together.result(timeout=60))
    [f.result(timeout=60) for f in others]
    ref = teacher_forced_logprobs(engine.model, PROMPTS[2], alone.token_ids, 1.0)
    assert alone.logprobs[0] >= ref[0] - 1e-4  # nucleus renormalisation only raises log-probs


def test_prefix_reuse_equals_a_full_re_encode(engine, tiny_model_dir):
    params = SamplingParams(max_tokens=9, temperature=0.0)
    engine._scheduler.prefix_cache.clear()
    turn1 = _alone(engine, PROMPTS[2], params)
    assert turn1.prefill_tokens == len(PROMPTS[2])
    second_prompt = PROMPTS[2] + turn1.token_ids + [400, 401, 402]
    turn2 = _alone(engine, second_prompt, params)
    # everything but the last completion token (never fed) and the new tokens came from the cache
    assert turn2.prefill_tokens == 1 + 3
    fresh = TorchEngine(tiny_model_dir, checkpoint_id="fresh")
    try:
        full = _alone(fresh, second_prompt, params)
    finally:
        fresh.close()
    assert full.prefill_tokens == len(second_prompt)
    _same(full, turn2, tol=1e-5)
    ref = teacher_forced_logprobs(engine.model, second_prompt, turn2.token_ids, 0.0)
    assert torch.allclose(torch.tensor(turn2.logprobs), ref, atol=1e-4)


def test_shared_prefix_of_two_prompts_is_reused(engine):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    base = [1] + list(range(500, 530))
    _alone(engine, base + [7, 8], params)
    other = base + [9, 10, 11]
    reused = _alone(engine, other, params)
    assert reused.prefill_tokens == 3
    engine._scheduler.prefix_cache.clear()
    _same(_alone(engine, other, params), reused)


def test_more_requests_than_max_seqs_all_complete_within_bounds(tiny_model_dir):
    eng = TorchEngine(tiny_model_dir, checkpoint_id="small", max_seqs=2, max_kv_tokens=64)
    try:
        sched = eng._scheduler
        peak = []
        step = sched._step
        sched._step = lambda admitted, shape: (peak.append(len(sched._running) + len(admitted)), step(admitted, shape))
        params = SamplingParams(max_tokens=10, temperature=0.0)
        alone = [_alone(eng, p, params) for p in PROMPTS]
        futures = [eng.submit(p, params) for p in PROMPTS * 2]
        for a, f in zip(alone * 2, futures):
            _same(a, f.result(timeout=60))
        assert max(peak) == 2 and sched._cache.allocated_tokens + sched.prefix_cache.tokens <= 64
        with pytest.raises(ValueError, match="KV bound"):
            eng.submit([1] * 60, params)
    finally:
        eng.close()


def test_close_ends_the_loop_and_fails_what_is_left(tiny_model_dir):
    eng = TorchEngine(tiny_model_dir, checkpoint_id="c")
    futures = [eng.submit(p, SamplingParams(max_tokens=200, temperature=0.0, stop_token_ids=())) for p in PROMPTS]
    eng.close()
    assert not eng._scheduler._thread.is_alive()
    for f in futures:
        assert f.done()
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(PROMPTS[0], SamplingParams(max_tokens=2))


def test_weight_swap_waits_for_running_sequences(tiny_model_dir, tmp_path):
    from app.checkpoints.testing import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)
    eng = TorchEngine(tiny_model_dir, checkpoint_id="a")
    try:
        params = SamplingParams(max_tokens=80, temperature=0.0)
        before = _alone(eng, PROMPTS[0], params)
        running = eng.submit(PROMPTS[0], params)
        _wait_running(eng, 3)
        swap = threading.Thread(target=eng.load_checkpoint, args=("b", other))
        swap.start()
        _same(before, running.result(timeout=60))  # finished on the old weights only
        swap.join(timeout=60)
        assert eng.checkpoint_id == "b"
        after = _alone(eng, PROMPTS[0], params)
        assert after.token_ids != before.token_ids and after.prefill_tokens == len(PROMPTS[0])
    finally:
        eng.close()


def test_moe_routed_experts_are_per_sequence(tiny_moe_model_dir):
    eng = TorchEngine(tiny_moe_model_dir)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0)
        alone = [_alone(eng, p, params) for p in PROMPTS[:3]]
        together = eng.generate(PROMPTS[:3], params)
        for a, t in zip(alone, together):
            _same(a, t)
            assert a.routed_experts == t.routed_experts and len(t.routed_experts) == 6
    finally:
        eng.close()


def test_speed_is_measured_at_load(engine):
    assert 0 < engine.decode_s_per_token < 10 and 0 < engine.prefill_s_per_token < 10


def test_exit_with_a_sequence_decoding_is_clean(tiny_model_dir):
    """A process that exits without closing its engine, mid-decode, exits 0: the atexit hook closes
    the scheduler, so torch is not torn down under a running step ("terminate called ...", -6)."""
    import subprocess
    import sys

    script = (
        "import sys, time, torch\n"
        "from app.inference.engine import SamplingParams\n"
        "from serving.torch_engine import TorchEngine\n"
        "torch.set_num_threads(2)\n"
        "engine = TorchEngine(sys.argv[1], checkpoint_id='tiny')\n"
        "futures = [engine.submit([1, 5, 6, 7], SamplingParams(max_tokens=4000, temperature=1.0, seed=i))"
        " for i in range(8)]\n"
        "while not any(len(s.tokens) > 8 for s in list(engine._scheduler._running)):\n"
        "    time.sleep(0.001)\n"
        "print('exiting mid-decode', flush=True)\n"
    )
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", script, str(tiny_model_dir)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "exiting mid-decode" in proc.stdout and "terminate called" not in proc.stderr
