"""Versioned reward specs (TOML, ``name@version``) and the reward math over implicit signals."""

from consumers.rewards.math import RewardInputs, RewardResult, compute_reward, inputs_from_signals
from consumers.rewards.spec import RewardSpec, available_specs, load_spec

__all__ = [
    "RewardInputs",
    "RewardResult",
    "compute_reward",
    "inputs_from_signals",
    "RewardSpec",
    "available_specs",
    "load_spec",
]
