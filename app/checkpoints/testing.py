"""Tiny random models for fast tests and benches, shaped like the production model (Llama, or a
Mixtral MoE, with the SmolLM2 tokenizer).

``build_tiny_model`` writes a Hugging Face folder (``config.json``, ``model.safetensors``,
``generation_config.json``, the real SmolLM2 tokenizer files). The weights are random but
deterministic for a given seed, so two folders built with the same seed are identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, MixtralConfig, PreTrainedConfig

from app.checkpoints.tokenizer import copy_tokenizer

VOCAB_SIZE = 49_152
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2


def tiny_config(
    *,
    moe: bool = False,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.2,
) -> PreTrainedConfig:
    """A tiny ``LlamaConfig`` (or ``MixtralConfig`` with 4 experts, top-2, when ``moe``)."""
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        initializer_range=initializer_range,
    )
    if moe:
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=2, output_router_logits=False, **common)

    return LlamaConfig(**common)


def build_tiny_model(directory: Path, seed: int = 0, moe: bool = False, **config_overrides: Any) -> Path:
    """Write a tiny random causal LM as a Hugging Face folder into ``directory`` (created).

    Args:
        directory: output folder.
        seed: torch seed for the random init (same seed -> identical weights).
        moe: a Mixtral-style sparse MoE (4 experts, top-2) instead of a dense Llama.
        config_overrides: passed to :func:`tiny_config` (hidden_size, num_layers, num_heads, ...).

    Returns:
        ``directory``. Weights are fp32; embeddings tied to the LM head.
    """
    return write_model_folder(directory, tiny_config(moe=moe, **config_overrides), seed)


def write_model_folder(directory: Path, config: PreTrainedConfig, seed: int = 0) -> Path:
    """Write a random model of ``config`` (fp32, embeddings tied, seeded init) with the SmolLM2
    tokenizer and a generation config into ``directory`` (created); returns ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(directory)
    copy_tokenizer(directory)
    return directory
