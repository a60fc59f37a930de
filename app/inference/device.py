"""The torch device a ``device`` setting names, shared by the trainer and the serving engine."""

from __future__ import annotations

import os
from typing import Literal

import torch

from app.core.errors import ConfigurationError

DeviceSetting = Literal["auto", "cpu", "cuda"]


def resolve_device(setting: str = "auto", local_rank: int | None = None) -> torch.device:
    """The ``torch.device`` a setting names.

    Args:
        setting: ``auto`` (CUDA when ``torch.cuda.is_available()``, else CPU), ``cpu`` or ``cuda``
            (``cuda:N`` is accepted as well).
        local_rank: the process's GPU index on its node (default: ``$LOCAL_RANK`` set by torchrun,
            else 0); ignored on the CPU and when ``setting`` names an index.

    Raises:
        ConfigurationError: an unknown setting, or CUDA asked for on a machine without a usable GPU.
    """
    kind = setting.split(":", 1)[0]
    if kind not in ("auto", "cpu", "cuda"):
        raise ConfigurationError(f"unknown device {setting!r}; expected auto, cpu or cuda")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigurationError(
            f"device {setting!r} requested, but torch {torch.__version__} sees no CUDA GPU "
            f'(build: cuda {torch.version.cuda}); use device = "cpu" or "auto"'
        )
    if ":" in setting:
        index = int(setting.split(":", 1)[1])
    else:
        index = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if index >= torch.cuda.device_count():
        raise ConfigurationError(f"cuda:{index} requested, but only {torch.cuda.device_count()} GPU(s) are visible")
    return torch.device("cuda", index)
