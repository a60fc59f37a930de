"""The promotion gate: the decision over paired eval outcomes and everything it is made of.

Invariant: pure (no DB, no IO beyond reading the policy TOML): outcomes and the policy in, a
decision with every reason out. Rooms, bottom up (contract "Gate rooms point down"): ``models``
(outcomes in, reports out) and ``policy`` (``evals/gate.toml`` as typed models) < ``monitors``,
``passk``, ``power``, ``sequential``, ``floors`` (the statistics) < ``checks`` (one suite's pairing,
bounds and monitors) < ``decision`` (:func:`~evals.gate.decision.decide_gate`), ``early_stop``
(the runner's stop rule on the same sequence) and ``plans`` (a suite's plan and its power; the
smaller, underpowered plan a demo may run). What runs suites, stores and reports a decision
sits above, in ``evals.gating``; its terminal view is ``evals.gate_terminal`` and the floors command
``evals.floors_cli``.
"""
