"""pass@k and best-of-K of a suite run from its per-(task, sample) outcomes.

Invariant: every figure is a mean over *tasks* (each task weighs the same whatever its number of
samples), computed from the stored outcomes only, so a run summary, a gate report and a loop
report of the same run agree.

- pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): from
  ``n >= k`` samples of a task of which ``c`` passed, the unbiased estimate of the probability that
  at least one of ``k`` samples passes is ``1 - C(n - c, k) / C(n, k)``; computed as the product
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's numerically stable form, Fig. 3), which
  needs no large binomial coefficients. pass@1 is ``c / n``, the mean pass rate.
- best-of-K: the share of tasks where at least one of the K samples drawn passed its hidden tests,
  i.e. best-of-K selection with an oracle verifier (the hidden tests; cf. the verifier-selected
  best-of-N of Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") and the "pass@k
  with n = k" of Chen et al. 2021 §2.1. It is what a user with K tries and a test suite gets; with
  exactly K samples per task it equals the unbiased pass@K, which in addition is defined for
  ``n > K`` and has lower variance there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from evals.gate.models import Outcome, SamplingReport


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task (Chen et al. 2021, eq. 1), stable product form.

    Args:
        n: samples drawn for the task.
        c: samples that passed, ``0 <= c <= n``.
        k: attempts, ``1 <= k <= n``.

    Returns:
        ``1 - C(n - c, k) / C(n, k)`` as a float in [0, 1] (1.0 when ``n - c < k``).

    Raises:
        ValueError: counts out of range or ``k > n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def task_counts(outcomes: Iterable[Outcome]) -> dict[str, tuple[int, int]]:
    """Per task: ``(n samples, c passed)`` over the given outcomes."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for o in outcomes:
        counts[o.task_id][0] += 1
        counts[o.task_id][1] += bool(o.passed)
    return {t: (n, c) for t, (n, c) in counts.items()}


def sampling_report(outcomes: Sequence[Outcome], samples_per_task: int | None = None) -> SamplingReport | None:
    """pass@1, pass@K and best-of-K of one checkpoint's outcomes on one suite.

    Args:
        outcomes: ``[tasks * samples]`` outcomes (any order).
        samples_per_task: K, the planned samples per task; default the fewest any task has. A task
            with fewer than K stored samples (an incomplete run) counts in pass@k only for the
            ``k`` it supports and is left out of best-of-K.

    Returns:
        A :class:`~evals.gate.models.SamplingReport` (``pass_at_k`` keys "1" and "K"), or None
        without outcomes.
    """
    counts = task_counts(outcomes)
    if not counts:
        return None
    k_max = samples_per_task or min(n for n, _ in counts.values())
    pass_at: dict[str, float] = {}
    for k in sorted({1, k_max}):
        vals = [pass_at_k(n, c, k) for n, c in counts.values() if n >= k]
        if vals:
            pass_at[str(k)] = float(np.mean(vals))
    full = [c > 0 for n, c in counts.values() if n >= k_max]
    solved = int(sum(full))
    return SamplingReport(
        samples_per_task=k_max,
        n_tasks=len(counts),
        pass_at_k=pass_at,
        best_of_k=solved / len(full) if full else 0.0,
        best_of_k_tasks=solved,
    )


def format_pass_at_k(pass_at_k: Mapping[str, float], samples_per_task: int, best_of_k: float | None) -> str:
    """One line for tables and reports: ``pass@1 52.0% · pass@4 81.3% · best-of-4 81.3%`` ("-" when empty)."""
    if not pass_at_k:
        return "-"
    parts = [f"pass@{k} {v:.1%}" for k, v in sorted(pass_at_k.items(), key=lambda kv: int(kv[0]))]
    if samples_per_task > 1 and best_of_k is not None:
        parts.append(f"best-of-{samples_per_task} {best_of_k:.1%}")
    return " · ".join(parts)


def format_sampling(report: SamplingReport | None) -> str:
    """:func:`format_pass_at_k` of a :class:`~evals.gate.models.SamplingReport` ("-" for None)."""
    if report is None:
        return "-"
    return format_pass_at_k(report.pass_at_k, report.samples_per_task, report.best_of_k)
