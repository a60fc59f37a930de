"""`flywheel train` under torchrun on 2 gloo ranks against real Postgres: rank 0 alone selects,
writes, registers and reports one candidate, which holds the weights a single-process cycle
trains on the same data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_trainer_cycle import CONFIG, _insert_sessions, policy_dir, production, store  # noqa: F401
from trainer.config import TrainerConfig

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _toml(config: dict) -> str:
    lines, tables = [], []
    for key, value in config.items():
        if isinstance(value, dict):
            tables.append(f"[{key}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in value.items()))
        else:
            lines.append(f"{key} = {json.dumps(value)}\n")
    return "".join(lines) + "\n".join(tables)


def test_torchrun_two_ranks_registers_one_candidate(session, store, production, policy_dir, database_url, tmp_path):
    from safetensors.torch import load_file

    from app.models import Checkpoint, TrainingCycle
    from app.repositories.checkpoints import get_production
    from trainer.selection import select_cycle_data
    from trainer.training import train_policy

    used, _ = _insert_sessions(session, policy_dir)
    # Adam's step is lr * m / (sqrt(v) + eps): for a weight whose gradient is near zero it scales
    # the rounding of that gradient by lr / eps, and rounding differs between one process's sum and
    # the ranks' all-reduce. A larger eps bounds that amplification so the 1e-5 comparison below
    # sees data parallelism, not the noise floor of near-zero gradients.
    optim = {**CONFIG["optim"], "eps": 1e-6}
    config = {**CONFIG, "device": "cpu", "precision": "fp32", "threads": 1, "plot_curves": False, "optim": optim}
    selected = select_cycle_data(session, TrainerConfig.model_validate(config).data, get_production(session))
    session.rollback()
    assert {t.id for t in selected.used} == set(used)
    (tmp_path / "trainer.toml").write_text(_toml(config))
    env = {
        **os.environ,
        "FLYWHEEL_DATABASE_URL": database_url,
        "FLYWHEEL_CHECKPOINT_DIR": str(store.root),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ops.cli",
            "train",
            "--once",
            "--json",
            "--no-progress",
            "--config",
            str(tmp_path / "trainer.toml"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1, proc.stdout  # one report: rank 0's
    result = lines[0]
    assert result["status"] == "succeeded", result
    assert result["metrics"]["placement"] == {
        "device": "cpu",
        "param_dtype": "float32",
        "compute_dtype": "float32",
        "precision": "fp32",
        "ranks": 2,
    }
    session.expire_all()
    assert session.query(Checkpoint).filter(Checkpoint.id != "base").count() == 1
    assert session.query(TrainingCycle).filter_by(status="succeeded").count() == 1
    assert sorted(store.list_stable()) == sorted(["base", result["checkpoint_id"]])
    assert store.verify(result["checkpoint_id"]) == []

    # the same cycle in one process trains the same weights
    single = train_policy(TrainerConfig.model_validate(config), production, selected.used)
    written = load_file(store.stable_path(result["checkpoint_id"]) / "model.safetensors")
    assert written
    for name, p in single.model.state_dict().items():
        if name in written:
            torch.testing.assert_close(written[name], p, rtol=0, atol=1e-5, msg=name)
