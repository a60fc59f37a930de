"""The managed vLLM servers' choices that need no server: dtype by CPU, the command line, the CPUs
the model threads run on, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import app.core.cpu
import app.inference.precision
from app.core.errors import ConfigurationError
from app.core.settings import ServingSettings
from serving.vllm_command import WORKER_EXTENSION, cpu_bind, resolve_dtype, server_command, server_env
from serving.vllm_server import ensure_server, start_server
from tests.unit.test_precision import decide_afresh, fake_probe  # noqa: F401 (fixture)


@pytest.mark.parametrize(
    ("flags", "speedup", "cuda", "expected"),
    [
        ({"avx512f", "avx512_bf16"}, 1.6, False, "bfloat16"),
        ({"amx_bf16"}, 2.5, False, "bfloat16"),
        ({"avx512f", "avx512_bf16"}, 0.7, False, "float32"),  # the instructions, but measured slower
        ({"avx2", "avx512f"}, 3.0, False, "float32"),  # bf16 emulated there: slower than fp32
        (set(), 0.5, True, "bfloat16"),
    ],
)
def test_auto_dtype_is_bf16_only_where_it_is_measured_faster(
    monkeypatch, decide_afresh, flags, speedup, cuda, expected
):
    monkeypatch.setattr(app.core.cpu, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(app.inference.precision, "cached_probe", lambda: fake_probe(speedup))
    assert resolve_dtype("auto", cuda=cuda) == expected
    assert resolve_dtype("float32", cuda=cuda) == "float32"  # an explicit choice is kept
    with pytest.raises(ConfigurationError, match="unknown serving dtype"):
        resolve_dtype("fp8", cuda=cuda)


def test_servers_log_behaviour_logprobs_and_reload_through_the_extension():
    cmd = server_command(Path("/ckpt/base"), 8123, "bfloat16", ServingSettings(vllm_enforce_eager=True))
    flag = {k: v for k, v in zip(cmd, cmd[1:]) if k.startswith("--")}
    assert flag["--logprobs-mode"] == "processed_logprobs"
    assert flag["--worker-extension-cls"] == WORKER_EXTENSION
    assert flag["--model"] == "/ckpt/base" and flag["--port"] == "8123" and flag["--dtype"] == "bfloat16"
    assert "--enforce-eager" in cmd and flag["--host"] == "127.0.0.1"


def test_nothing_is_started_for_a_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(ConfigurationError, match="no config.json"):
        start_server("production", tmp_path, "x", tmp_path)
    with pytest.raises(ConfigurationError, match="unknown server role"):
        start_server("staging", tmp_path, "x", tmp_path)
    with pytest.raises(ConfigurationError, match="no vLLM eval server is recorded"):
        ensure_server("eval", tmp_path)
    assert not (tmp_path / "vllm").exists()


@pytest.mark.parametrize(
    ("setting", "cpus", "expected"),
    [
        ("auto", [0, 1], "0,1"),  # a small host: every CPU, none reserved for vLLM's scheduler
        ("auto", [2, 5, 7], "2,5,7"),  # the CPUs this process may use, not 0..n-1
        ("auto", list(range(16)), None),  # a large host: vLLM's own binding
        ("vllm", [0, 1], None),
        ("nobind", [0, 1], "nobind"),
        ("0-1", list(range(16)), "0-1"),
    ],
)
def test_cpu_bind_uses_every_cpu_of_a_small_host(setting, cpus, expected):
    assert cpu_bind(setting, cpus) == expected


def test_server_env_binds_cpu_threads_unless_the_environment_or_a_gpu_says_otherwise(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    env = server_env(ServingSettings(vllm_cpu_bind="auto"))
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == ("0,1", "0")
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(ServingSettings(vllm_cpu_bind="vllm"))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(ServingSettings(), cuda=True)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")  # the operator's own choice wins
    assert server_env(ServingSettings())["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_a_malformed_cpu_bind_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="vllm_cpu_bind"):
        ServingSettings(vllm_cpu_bind="all cores")


@pytest.mark.parametrize(
    "config, moe",
    [
        ({"model_type": "mixtral", "num_local_experts": 4}, True),
        ({"model_type": "qwen2_moe", "num_experts": 8}, True),
        ({"model_type": "deepseek_v3", "n_routed_experts": 64}, True),
        ({"model_type": "llama"}, False),
        ({"model_type": "llava", "text_config": {"num_local_experts": 8}}, True),
    ],
)
def test_gpu_servers_of_an_moe_are_asked_for_the_routes_the_trainer_replays(tmp_path, config, moe):
    """Only where vLLM can capture routes (a GPU: its V2 model runner); the CPU build refuses the flag."""
    from serving.vllm_command import ROUTES_ENV, is_moe

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert is_moe(tmp_path) is moe
    gpu = server_command(tmp_path, 8000, "bfloat16", ServingSettings(), cuda=True)
    cpu = server_command(tmp_path, 8000, "float32", ServingSettings(), cuda=False)
    assert ("--enable-return-routed-experts" in gpu) is moe
    assert "--enable-return-routed-experts" not in cpu
    assert ROUTES_ENV == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert is_moe(tmp_path / "missing") is False
