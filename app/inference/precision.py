"""Whether bf16 is the faster compute dtype on this CPU: measured once per host, not read off its flags.

The trainer's ``precision = "auto"`` (:func:`trainer.device.resolve_precision`) and the vLLM
servers' ``dtype = "auto"`` (:func:`serving.vllm_command.resolve_dtype`) ask :func:`bf16_is_faster`.
The CPU flags ``amx_bf16``/``avx512_bf16`` (:func:`app.core.cpu.cpu_has_bf16`) say bf16 instructions
exist, not that bf16 is faster: on two 2-core hosts with them bf16 was the faster dtype (an Intel
Xeon with AMX, an AMD EPYC), on a third, an Intel Xeon with ``avx512_bf16`` but no AMX, it was the
slower one for both the trainer and vLLM (docs/benchmarks.md, "Precision by measurement").

So on a CPU with the flags a probe times the model's MLP matmuls (:data:`PROBE_SHAPES`) in fp32 and
in bf16 and picks bf16 only when it is at least :data:`MIN_SPEEDUP` times faster. The result is
kept in ``$FLYWHEEL_HOME/cache/cpu_precision.json`` under a key of the CPU model, its flags, the
torch version and the thread count, so every process of a stack (servers, trainer) decides alike
and only the first pays the probe (about a second). A CPU without the flags is fp32 without a probe
(bf16 is emulated there).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from app.core.cpu import CPUINFO, cpu_flags, cpu_has_bf16
from producers.settings import flywheel_home

log = logging.getLogger(__name__)

PROBE_SHAPES = ((2048, 576, 1536), (2048, 1536, 576))
"""``(M, K, N)`` matmuls of the probe: SmolLM2-135M's MLP up and down projections on a micro-batch
of 2048 tokens (the trainer's ``micro_batch_tokens``; a prefill of the same size)."""
MIN_SPEEDUP = 1.1
"""bf16 must be this many times faster than fp32 to be chosen (fp32 is exact and needs no casts)."""
CACHE_FILE = "cpu_precision.json"


@dataclass(frozen=True)
class Bf16Probe:
    """One measurement: throughput of :data:`PROBE_SHAPES` in each dtype.

    Attributes:
        fp32_gflops, bf16_gflops: GFLOP/s (2 M K N per matmul over the best of the repeats).
        threads: torch intra-op threads during the probe.
        key: what the result holds for (:func:`host_key`).
    """

    fp32_gflops: float
    bf16_gflops: float
    threads: int
    key: str

    @property
    def speedup(self) -> float:
        """bf16 throughput / fp32 throughput (> 1: bf16 faster)."""
        return self.bf16_gflops / self.fp32_gflops

    @property
    def prefers_bf16(self) -> bool:
        """Whether bf16 clears :data:`MIN_SPEEDUP`."""
        return self.speedup >= MIN_SPEEDUP


def host_key(threads: int) -> str:
    """A short hash of the CPU model name, its flags, the torch version and ``threads``."""
    try:
        model = next((ln for ln in CPUINFO.read_text().splitlines() if ln.startswith("model name")), "")
    except OSError:
        model = ""
    text = "|".join([model, " ".join(sorted(cpu_flags())), torch.__version__, str(threads)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure_bf16(repeats: int = 3) -> Bf16Probe:
    """Time :data:`PROBE_SHAPES` in fp32 and bf16 on this CPU with the current torch thread count.

    The dtypes alternate ``repeats`` times and each keeps its fastest round, so a busy moment of the
    host weighs on neither alone. Takes about a second on 2 cores.
    """
    gen = torch.Generator().manual_seed(0)
    pairs = {
        dtype: [
            (torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype))
            for m, k, n in PROBE_SHAPES
        ]
        for dtype in (torch.float32, torch.bfloat16)
    }
    flops = sum(2 * m * k * n for m, k, n in PROBE_SHAPES)
    best = dict.fromkeys(pairs, float("inf"))
    for mats in pairs.values():  # warm-up: first calls pick kernels and allocate
        for a, b in mats:
            torch.mm(a, b)
    for _ in range(repeats):
        for dtype, mats in pairs.items():
            start = time.perf_counter()
            for a, b in mats:
                torch.mm(a, b)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    threads = torch.get_num_threads()
    return Bf16Probe(
        fp32_gflops=round(flops / best[torch.float32] / 1e9, 1),
        bf16_gflops=round(flops / best[torch.bfloat16] / 1e9, 1),
        threads=threads,
        key=host_key(threads),
    )


def cached_probe(cache_dir: Path | None = None) -> Bf16Probe:
    """This host's :class:`Bf16Probe`: from ``cache_dir/cpu_precision.json`` (default
    ``$FLYWHEEL_HOME/cache``) when its key matches, else measured now and written there.

    An unreadable or stale cache is measured over, never an error; a cache that cannot be written
    is logged and the measurement still returned.
    """
    path = Path(cache_dir or flywheel_home() / "cache") / CACHE_FILE
    key = host_key(torch.get_num_threads())
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return Bf16Probe(**{f: stored[f] for f in ("fp32_gflops", "bf16_gflops", "threads", "key")})
    except (OSError, ValueError, TypeError, KeyError):
        pass
    probe = measure_bf16()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{CACHE_FILE}.{os.getpid()}.tmp")  # processes may probe at once
        tmp.write_text(json.dumps({**asdict(probe), "speedup": round(probe.speedup, 3)}) + "\n")
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot keep the bf16 probe in %s: %s", path, exc)
    log.info(
        "bf16 probe: fp32 %.0f, bf16 %.0f GFLOP/s (%d threads): %s",
        probe.fp32_gflops,
        probe.bf16_gflops,
        probe.threads,
        "bf16" if probe.prefers_bf16 else "fp32",
    )
    return probe


@lru_cache(maxsize=1)
def bf16_is_faster() -> bool:
    """Whether ``auto`` precision means bf16 on this CPU: it has ``amx_bf16``/``avx512_bf16`` and
    the probe measured bf16 at least :data:`MIN_SPEEDUP` times faster than fp32 (module doc). Decided
    once per process (``bf16_is_faster.cache_clear()`` to decide again)."""
    return cpu_has_bf16() and cached_probe().prefers_bf16
