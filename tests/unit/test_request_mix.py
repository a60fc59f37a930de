"""The simulator's request mix: which training tasks a run's sessions ask for."""

from __future__ import annotations

from collections import Counter

import pytest
import typer

from app.core.errors import ConfigurationError
from evals.tasks import load_tasks
from ops.simulator import choose_tasks
from ops.simulator_cli import parse_mix


@pytest.fixture(scope="module")
def train_tasks():
    return load_tasks("functions", "train")


def test_mix_follows_the_weights(train_tasks):
    chosen = choose_tasks(train_tasks, 100, {1: 0.8, 2: 0.2}, seed=3)
    levels = Counter(t.metadata["difficulty"] for t in chosen)
    assert len({t.id for t in chosen}) == 100  # distinct tasks
    assert levels[3] == 0  # a level absent from the mix is never asked for
    assert 65 <= levels[1] <= 95, levels  # ~80 of 100 (binomial sd 4)


def test_mix_is_seeded(train_tasks):
    a = [t.id for t in choose_tasks(train_tasks, 20, {1: 1, 2: 1, 3: 1}, seed=7)]
    assert a == [t.id for t in choose_tasks(train_tasks, 20, {1: 1, 2: 1, 3: 1}, seed=7)]
    assert a != [t.id for t in choose_tasks(train_tasks, 20, {1: 1, 2: 1, 3: 1}, seed=8)]


def test_an_exhausted_level_gives_way_to_the_others(train_tasks):
    level3 = sum(1 for t in train_tasks if t.metadata["difficulty"] == 3)
    chosen = choose_tasks(train_tasks, level3 + 10, {3: 1.0, 1: 1e-9}, seed=0)
    assert sum(1 for t in chosen if t.metadata["difficulty"] == 3) == level3
    assert len(chosen) == level3 + 10


def test_tasks_without_levels_are_a_uniform_subset():
    tasks = load_tasks("humaneval", "test")
    chosen = choose_tasks(tasks, 5, {1: 1.0}, seed=0)
    assert len({t.id for t in chosen}) == 5


def test_bad_mixes_are_refused(train_tasks):
    with pytest.raises(ConfigurationError, match=">= 0"):
        choose_tasks(train_tasks, 4, {1: -1.0}, seed=0)
    with pytest.raises(ConfigurationError, match="no task"):
        choose_tasks(train_tasks, 4, {7: 1.0}, seed=0)
    assert parse_mix("1:0.6, 2:0.4") == {1: 0.6, 2: 0.4}
    with pytest.raises(typer.BadParameter, match="LEVEL:WEIGHT"):
        parse_mix("easy")
