"""The packaged trainer configs: each loads, and ``one_cycle.toml`` stays the defaults but for its
learning rate."""

from __future__ import annotations

from trainer.config import DEFAULT_CONFIG, load_config


def test_one_cycle_config_is_the_defaults_at_its_own_learning_rate():
    """``one_cycle.toml`` (``bench/flywheel.py --quick``) repeats the defaults but for ``optim.lr``:
    a default changed in one file and not the other fails here."""
    default = load_config().model_dump()
    one_cycle = load_config(DEFAULT_CONFIG.parent / "one_cycle.toml").model_dump()
    assert one_cycle["optim"].pop("lr") == 4e-5 and default["optim"].pop("lr") == 1e-5
    assert one_cycle == default
