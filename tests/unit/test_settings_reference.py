"""docs/settings.md is what the settings classes generate (``flywheel settings --markdown``), every
setting has a meaning, no settings class escapes the reference, and ``FLYWHEEL_HOME`` defaults to
the user data directory."""

from __future__ import annotations

import ast
from pathlib import Path

import platformdirs

from ops.settings_reference import SETTINGS_MODULES, render_markdown, setting_docs
from producers.settings import flywheel_home

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "producers", "consumers", "trainer", "kernels", "evals", "serving", "ops")


def test_docs_settings_md_is_what_the_code_generates():
    current = (REPO / "docs" / "settings.md").read_text()
    assert current == render_markdown(), "docs/settings.md is stale: flywheel settings --markdown > docs/settings.md"


def test_every_setting_says_what_it_means_and_names_are_unique():
    docs = setting_docs()
    assert len(docs) >= 79
    assert not [d.variable for d in docs if not d.meaning], "give these fields a description"
    names = [d.variable for d in docs]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(n.startswith("FLYWHEEL_") for n in names)


def test_every_settings_class_is_in_the_reference():
    modules = set()
    for package in PACKAGES:
        for file in (REPO / package).rglob("*.py"):
            tree = ast.parse(file.read_text())
            for node in ast.walk(tree):
                bases = {getattr(b, "id", getattr(b, "attr", None)) for b in getattr(node, "bases", ())}
                if isinstance(node, ast.ClassDef) and bases & {"BaseSettings", "EnvSettings"}:
                    modules.add(".".join(file.relative_to(REPO).with_suffix("").parts))
    assert modules - {"producers.settings"} <= set(SETTINGS_MODULES), sorted(modules - set(SETTINGS_MODULES))


def test_flywheel_home_is_the_user_data_directory_unless_the_variable_says_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv("FLYWHEEL_HOME")
    assert flywheel_home() == platformdirs.user_data_path("flywheel")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLYWHEEL_HOME", ".flywheel")
    assert flywheel_home() == tmp_path.resolve() / ".flywheel"
