"""What this host's CPU can do, read from ``/proc/cpuinfo``: the trainer's and serving's precision choice.

Invariant: pure standard library (``app.core`` imports no torch), and a host without
``/proc/cpuinfo`` (macOS, some containers) reads as a CPU without any flag, so callers fall back
to their safe choice (fp32).
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""Flags of x86 CPUs that compute bf16 matmuls natively (Intel AMX tiles since Sapphire Rapids;
AVX512-BF16 since Cooper Lake and AMD Zen 4). Elsewhere PyTorch emulates bf16 through fp32, which
is slower than fp32 itself."""


def cpu_flags() -> set[str]:
    """The CPU feature flags of this host (the first ``flags`` line of ``/proc/cpuinfo``; empty
    where the file does not exist or has no such line)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_bf16() -> bool:
    """Whether this host's CPU computes bf16 matmuls natively (any of :data:`BF16_CPU_FLAGS`)."""
    return any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)
