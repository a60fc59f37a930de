"""Evals: task sources, the sandboxed agent harness, suites, the runner, the gate and reports."""
