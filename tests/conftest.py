"""Shared fixtures. Area fixtures live in ``tests/fixtures/`` and are loaded here."""

pytest_plugins = [
    "tests.fixtures.environment",
    "tests.fixtures.database",
    "tests.fixtures.broker",
    "tests.fixtures.model",
]
