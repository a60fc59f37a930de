"""Trainer configs that ``extends`` another: a variant states only what it changes."""

from __future__ import annotations

import pytest

from app.core.errors import ConfigurationError
from trainer.config import DEFAULT_CONFIG, load_config


def test_extends_merges_tables_key_by_key_through_a_chain(tmp_path):
    """A chain of two ``extends``: the nearest file wins per key, sibling keys of a table survive,
    paths are relative to the file that names them, and overrides still apply last."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.toml").write_text(
        f'extends = "{DEFAULT_CONFIG}"\nmax_steps = 7\n[optim]\nlr = 2e-5\nweight_decay = 0.01\n'
    )
    (tmp_path / "sub" / "leaf.toml").write_text('extends = "../base.toml"\n[optim]\nlr = 3e-5\n')
    config = load_config(tmp_path / "sub" / "leaf.toml", overrides={"grad_accum": 3})
    default = load_config()
    assert config.optim.lr == 3e-5 and config.optim.weight_decay == 0.01 and config.max_steps == 7
    assert config.grad_accum == 3 and config.optim.betas == default.optim.betas
    assert config.data == default.data


def test_extends_refuses_a_loop_a_missing_file_and_a_non_string(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(ConfigurationError, match="extends itself"):
        load_config(tmp_path / "a.toml")
    (tmp_path / "c.toml").write_text('extends = "missing.toml"\n')
    with pytest.raises(ConfigurationError, match="missing.toml"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "d.toml").write_text("extends = 3\n")
    with pytest.raises(ConfigurationError, match="extends must be a file name"):
        load_config(tmp_path / "d.toml")
    (tmp_path / "e.toml").write_text(f'extends = "{DEFAULT_CONFIG}"\nno_such_key = 1\n')
    with pytest.raises(ConfigurationError):
        load_config(tmp_path / "e.toml")
