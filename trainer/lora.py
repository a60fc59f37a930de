"""Low-rank adapters for a cycle (``[lora]`` in the trainer config), through ``peft``.

A cycle with ``lora.rank > 0`` freezes the parent's weights, trains rank-``r`` adapters
``W + (alpha / r) * B @ A`` (Hu et al. 2021, "LoRA") on the decoder's linear layers, and merges them
into ``W`` before the checkpoint is written: every checkpoint is a whole model, its delta and
serving are the same as after full fine-tuning, and the next cycle starts fresh adapters on the
merged weights. ``B`` starts at zero, so the first step's forward pass is the parent's.

Invariant: :func:`attach_adapters` changes the model in place (its linear layers gain adapters, its
other parameters stop requiring gradients), so the trainer's code runs on the same module object;
:func:`merge_adapters` gives back a plain model with the same parameter names and shapes as the
parent's.
"""

from __future__ import annotations

from typing import cast

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from trainer.config import LoraSettings


def attach_adapters(model: torch.nn.Module, settings: LoraSettings) -> PeftModel:
    """Wrap ``model`` with fresh adapters of ``settings.rank``; ``model`` itself is modified in place
    (adapters injected, every other parameter frozen) and stays the module the trainer runs.

    The adapters are fp32 like the master weights (no dropout: the policy-gradient loss is computed
    once per token, and the behaviour log-probs are of the undropped model).

    Raises:
        ValueError: ``settings.rank`` is 0, or ``target_modules`` matches no layer of ``model`` (peft's).
    """
    if settings.rank <= 0:
        raise ValueError("attach_adapters needs lora.rank > 0")
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # peft types it int; it only divides by it
        lora_dropout=0.0,
        target_modules=settings.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def merge_adapters(peft_model: PeftModel) -> PreTrainedModel:
    """Fold the trained adapters into the frozen weights (``W += (alpha / r) * B @ A``, fp32) and return
    the plain model, with every parameter trainable again, as :func:`trainer.checkpointing.load_policy`
    gives it."""
    model = cast(PreTrainedModel, peft_model.merge_and_unload())  # the causal LM the adapters wrapped
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def trainable_parameters(model: torch.nn.Module) -> int:
    """How many scalars the optimizer updates (all of them without adapters)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
