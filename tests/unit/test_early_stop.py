"""Early stopping (``GateConfig.early_stop``): the runner's stop rule and the gate's reading of a
stopped run agree, a clear candidate stops before the end of its suite, a close one runs to the end,
and a stop keeps the sequence's level."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from evals.gate.decision import decide_gate
from evals.gate.early_stop import SequentialStop
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.policy import GateConfig, SuiteGate

POLICY = GateConfig(
    suites={"s": SuiteGate(margin=0.045)}, bootstrap_resamples=1000, decide_by="sequential", early_stop=True
)


def templated(gain: dict[int, int], templates: int = 30, variants: int = 4, base: int = 1):
    """Functions-style outcomes (``FN/<template>/<variant>``): production passes the first ``base``
    variants of each template, the candidate as many plus ``gain[t]`` in template ``t``."""
    cand, prod = [], []
    for t in range(templates):
        for v in range(variants):
            task = f"FN/tpl{t:03d}/{v}"
            prod.append(Outcome(task, 0, v < base))
            cand.append(Outcome(task, 0, v < base + gain.get(t, 0)))
    return cand, prod


def run_stopping(cand: list[Outcome], prod: list[Outcome], config: GateConfig = POLICY):
    """What the runner does: the plan's samples in the rule's order, one look per result, stop
    when it decides. Returns the rule and the candidate outcomes that ran."""
    stop = SequentialStop("s", [o.key for o in prod], {o.key: o.passed for o in prod}, config)
    by = {o.key: o for o in cand}
    todo = stop.sort([(SimpleNamespace(id=o.task_id), o.sample_index) for o in reversed(prod)])
    ran = []
    for task, sample in todo:
        ran.append(by[(task.id, sample)])
        if stop.observe(task.id, sample, by[(task.id, sample)].passed):
            break
    return stop, ran


def gate_stopped(ran, prod, config: GateConfig = POLICY, *, stopped: bool = True):
    planned = [o.key for o in prod]
    return decide_gate(
        {"s": SuiteOutcomes("s", "v", ran, planned=planned, stopped=stopped)},
        {"s": SuiteOutcomes("s", "v", prod, planned=planned)},
        config,
    )


@pytest.mark.parametrize(
    "gain, decision",
    [(dict.fromkeys(range(30), 2), "pass"), (dict.fromkeys(range(30), -1), "fail")],
)
def test_a_clear_candidate_stops_early_and_the_gate_decides_the_stopped_run_by_the_sequence(gain, decision):
    """+50 points (every template gains 2 of 4) and -25 points (every template loses its one pass):
    the rule stops well before the 120 pairs, in whole clusters, and the gate, given only what ran,
    finds the same stop and decision from the stored outcomes."""
    cand, prod = templated(gain)
    stop, ran = run_stopping(cand, prod)
    assert stop.decided and stop.report.decision == decision
    assert len(ran) == stop.report.stopped_at_pairs == 4 * stop.report.stopped_at_clusters < 120
    r = gate_stopped(ran, prod)
    s = r.suites["s"]
    assert r.decision == decision and s.decision == decision, [x.message for x in r.failures()]
    assert s.decided_by == "sequential" and s.run_stopped and s.planned_pairs == 120
    assert s.stopped_at_pairs == stop.report.stopped_at_pairs == s.n_pairs
    assert s.sequential == stop.report
    assert any(x.check == "stopped_early" and x.passed for x in r.reasons)
    # The sequence, not the fixed-n interval over the prefix, is what the deciding reason reads.
    (deciding,) = [x for x in r.reasons if x.check == "non_inferiority"]
    assert deciding.value == s.sequential.low and deciding.details["decide_by"] == "sequential"
    brief = r.decisions()["suites"]["s"]
    assert brief["run_stopped"] and brief["stopped_at_pairs"] == len(ran)


def test_a_close_candidate_runs_to_the_end_and_is_insufficient_evidence():
    """An equal candidate that gains a task in one template and loses one in another: no look
    decides against a 4.5-point margin at 30 clusters, so every pair runs."""
    cand, prod = templated({0: 1, 1: -1, 2: 1, 3: -1})
    stop, ran = run_stopping(cand, prod)
    assert not stop.decided and len(ran) == 120 and stop.summary() == {}
    r = gate_stopped(ran, prod, stopped=False)
    s = r.suites["s"]
    assert s.decision == "insufficient_evidence" and s.stopped_at_pairs is None and not s.run_stopped


def test_results_stored_after_the_stop_do_not_move_the_decision():
    """Samples in flight when the rule decided are stored too: the gate reads only the clusters up
    to the first incomplete one, so more results (the next cluster's, half of the one after) leave the
    decision and the stop where they were."""
    cand, prod = templated(dict.fromkeys(range(30), 2))
    stop, ran = run_stopping(cand, prod)
    t = stop.report.stopped_at_clusters
    nxt, after = (f"{stop.order[t]}/", f"{stop.order[t + 1]}/")
    later = [o for o in cand if o.task_id.startswith(nxt)] + [o for o in cand if o.task_id.startswith(after)][:2]
    s = gate_stopped(ran + later, prod).suites["s"]
    assert s.decision == "pass" and s.stopped_at_pairs == stop.report.stopped_at_pairs
    assert s.n_pairs == stop.report.stopped_at_pairs + 4


def test_a_stopped_run_that_does_not_decide_or_is_not_allowed_to_stop_fails_closed():
    cand, prod = templated({0: 1, 1: -1, 2: 1, 3: -1})
    stop, ran = run_stopping(cand, prod)
    assert not stop.decided
    r = gate_stopped(ran[:20], prod)  # claims to have stopped after 5 clusters
    (why,) = [x for x in r.failures() if x.check == "stopped_early"]
    assert r.decision == "fail" and not why.inconclusive and "does not decide" in why.message
    # A clear stop read under a policy without early_stop: the unrun pairs are missing.
    win, wprod = templated(dict.fromkeys(range(30), 2))
    _, wran = run_stopping(win, wprod)
    off = POLICY.model_copy(update={"early_stop": False})
    r = gate_stopped(wran, wprod, off)
    assert r.decision == "fail" and "missing_results" in {x.check for x in r.failures()}


def test_early_stop_needs_the_sequence_to_decide():
    with pytest.raises(ValueError, match="early_stop needs decide_by"):
        GateConfig(early_stop=True)
    assert GateConfig(early_stop=True, decide_by="sequential").early_stop


def test_stopping_early_keeps_the_level():
    """A candidate exactly a margin worse (production passes half its tasks, the candidate 4.5
    points fewer, each task independently): over 300 runs that stop at the first deciding look,
    at most alpha (+ Monte Carlo slack) pass; some stop early, all of those on a fail."""
    rng = np.random.default_rng(11)
    passed = early = 0
    sims = 300
    for _ in range(sims):
        cand, prod = [], []
        for t in range(60):
            for v in range(4):
                task = f"FN/tpl{t:03d}/{v}"
                prod.append(Outcome(task, 0, bool(rng.random() < 0.5)))
                cand.append(Outcome(task, 0, bool(rng.random() < 0.5 - 0.045)))
        stop, ran = run_stopping(cand, prod)
        passed += stop.decided and stop.report.decision == "pass"
        early += len(ran) < 240 and stop.report.decision == "fail"
    assert passed / sims <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / sims)
    assert early > 0
