"""The NetworkPolicies of ops/deploy/k8s admit only the front and the API from outside the
namespace, and let each pod reach the servers it calls (and no other), evaluated with Kubernetes'
semantics (networking.k8s.io/v1): a pod selected by an Ingress policy accepts only what some
selecting policy's rule admits; a rule without ``from`` admits every source, one without ``ports``
every port; a peer with a namespaceSelector or an ipBlock may be outside the namespace. Each check
is also shown a policy that opens more or cuts a caller off."""

from __future__ import annotations

import pytest

from tests.unit.test_k8s_hardening import _docs, _mutate, _pod, _ports

FROM_OUTSIDE = {("front", 8100), ("api", 8000)}
# (caller, server, port) each caller needs, from the code (networkpolicy.yaml names where)
CALLS = [
    ("front", "vllm", 8000),
    ("front", "vllm-canary", 8000),
    ("watcher", "vllm", 8000),
    ("watcher", "vllm-canary", 8000),
    ("api", "vllm", 8000),
    ("worker", "vllm", 8000),
    ("worker", "vllm-eval", 8000),
    ("eval-worker", "vllm-eval", 8000),
    *(
        (src, "otel-collector", 4318)
        for src in ("consumer", "worker", "eval-worker", "beat", "relay", "watcher", "api")
    ),
    ("front", "otel-collector", 4318),
]
NOT_CALLS = [
    ("consumer", "vllm", 8000),
    ("front", "vllm-eval", 8000),
    ("watcher", "vllm-eval", 8000),
    ("api", "worker", 9464),
]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _pods(docs: list[dict]) -> dict[str, tuple[dict[str, str], dict[str | int, int]]]:
    """name -> (the pod's labels, its ports by number and by name) for every workload."""
    out = {}
    for d in (d for d in docs if d["kind"] in ("Deployment", "Job")):
        ports: dict[str | int, int] = {}
        for c in _pod(d)["containers"]:
            ports.update(_ports(c))
        out[d["metadata"]["name"]] = (d["spec"]["template"]["metadata"]["labels"], ports)
    return out


def _peer_admits(peer: dict, source: dict[str, str] | None) -> bool:
    """Whether ``peer`` admits ``source``: a pod's labels in this namespace, or None for outside it."""
    if "ipBlock" in peer or "namespaceSelector" in peer:
        return source is None or "podSelector" not in peer or _selects(peer["podSelector"], source)
    return source is not None and _selects(peer["podSelector"], source)


def admitted(docs: list[dict], target: str, port: int, source: dict[str, str] | None) -> bool:
    """Whether the NetworkPolicies in ``docs`` let ``source`` (labels, or None: outside the
    namespace) open a TCP connection to ``port`` of workload ``target``."""
    labels, named = _pods(docs)[target]
    selecting = [
        p
        for p in (d for d in docs if d["kind"] == "NetworkPolicy")
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and _selects(p["spec"]["podSelector"], labels)
    ]
    if not selecting:
        return True  # not isolated
    for rule in (r for p in selecting for r in p["spec"].get("ingress") or []):
        ports = rule.get("ports") or [{}]
        if not any("port" not in p or named.get(p["port"], p["port"]) == port for p in ports):
            continue
        if not rule.get("from") or any(_peer_admits(peer, source) for peer in rule["from"]):
            return True
    return False


UNDECLARED = 1  # a port no container declares: stands for whatever else a pod might listen on


def open_from_outside(docs: list[dict]) -> set[tuple[str, int]]:
    """Every (workload, port) a source outside the namespace may connect to: its declared ports,
    and :data:`UNDECLARED` where it would accept any."""
    return {
        (name, port)
        for name, (_, named) in _pods(docs).items()
        for port in {*named.values(), UNDECLARED}
        if admitted(docs, name, port, None)
    }


def test_only_the_front_and_the_api_are_reachable_from_outside():
    assert open_from_outside(_docs()) == FROM_OUTSIDE


def call_problems(docs: list[dict]) -> list[str]:
    """Each call of :data:`CALLS` the policies refuse and each of :data:`NOT_CALLS` they admit."""
    pods, problems = _pods(docs), []
    for src, dst, port in CALLS:
        assert port in pods[dst][1].values(), (dst, port)
        if not admitted(docs, dst, port, pods[src][0]):
            problems.append(f"{src} cannot reach {dst}:{port}")
    problems += [f"{s} reaches {d}:{p}" for s, d, p in NOT_CALLS if admitted(docs, d, p, pods[s][0])]
    return problems


def test_each_pod_reaches_the_servers_it_calls_and_no_other():
    assert call_problems(_docs()) == []


OPENED = {
    "no default deny": (
        "NetworkPolicy",
        "default-deny-ingress",
        lambda d: d["spec"].update(podSelector={"matchLabels": {"x": "y"}}),
    ),
    "every namespace to vllm": (
        "NetworkPolicy",
        "vllm-from-its-clients",
        lambda d: d["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}}),
    ),
    "an address range to the metrics": (
        "NetworkPolicy",
        "metrics-from-prometheus",
        lambda d: d["spec"]["ingress"][0]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
    ),
    "a rule without from": (
        "NetworkPolicy",
        "vllm-eval-from-the-graders",
        lambda d: d["spec"]["ingress"][0].pop("from"),
    ),
    "the collector from anywhere": (
        "NetworkPolicy",
        "otel-collector-from-flywheel",
        lambda d: d["spec"]["ingress"].append({}),
    ),
}


@pytest.mark.parametrize("case", sorted(OPENED))
def test_a_policy_that_opens_more_from_outside_is_caught(case):
    kind, name, change = OPENED[case]
    assert open_from_outside(_mutate(_docs(), kind, name, change)) > FROM_OUTSIDE, case


def _drop_caller(name: str):
    def change(doc: dict) -> None:
        doc["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"].remove(name)

    return change


def test_a_policy_that_cuts_a_caller_off_or_lets_another_in_is_caught():
    cut = _mutate(_docs(), "NetworkPolicy", "vllm-eval-from-the-graders", _drop_caller("eval-worker"))
    assert call_problems(cut) == ["eval-worker cannot reach vllm-eval:8000"]
    wider = _mutate(
        _docs(),
        "NetworkPolicy",
        "vllm-from-its-clients",
        lambda d: d["spec"]["ingress"][0]["from"][0]["podSelector"].update(matchExpressions=[]),
    )
    assert call_problems(wider) == ["consumer reaches vllm:8000"]
