"""vLLM worker extension: a weight reload that leaves no derived tensor stale.

Loaded inside vLLM's worker processes (``--worker-extension-cls serving.vllm_worker.WeightReload``,
what :mod:`serving.vllm_server` and the deploy files pass), so it imports nothing of flywheel's and
nothing vLLM does not already load. Called over HTTP as
``POST /collective_rpc {"method": "reload_checkpoint", "kwargs": {"weights_path": DIR}}``.

Why not vLLM's own ``reload_weights`` alone: on CPU (vLLM 0.32), loading packs each linear layer's
weight for the CPU GEMM kernels (``dispatch_cpu_unquantized_gemm``). A tied LM head (SmolLM2, Llama
with ``tie_word_embeddings``) loads no weight of its own, so the in-place reload puts back its *old*
packed weight: the embedding changes and the logits keep the previous checkpoint's head. Measured
on tiny Llamas: a reload that changes only the embedding served other tokens than a fresh start on
the same checkpoint, while every parameter checksum matched (``tests/integration/test_vllm.py``).
:func:`refresh_shared_weights` re-runs the weight processing of every layer whose weight is shared
with another layer, from the weight now loaded.
"""

from __future__ import annotations

import torch


def refresh_shared_weights(model: torch.nn.Module) -> list[str]:
    """Re-run ``quant_method.process_weights_after_loading`` on each layer whose ``weight`` is the
    same tensor as another layer's (a tied LM head and its embedding). Returns their names."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and getattr(module, "quant_method", None) is not None:
            owners.setdefault(id(weight), []).append((name, module))
    refreshed = []
    for group in owners.values():
        if len(group) < 2:
            continue
        for name, module in group:
            module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr,operator]  # vLLM's layer attribute
            refreshed.append(name)
    return refreshed


class WeightReload:
    """Mixed into vLLM's worker class (it has ``model_runner``)."""

    def reload_checkpoint(self, weights_path: str) -> list[str]:
        """Reload every weight from the checkpoint folder ``weights_path`` in place, then refresh the
        layers that share a weight. Returns the refreshed layers' names.

        Raises:
            Exception: whatever vLLM's ``reload_weights`` raises for an unreadable folder.
        """
        self.model_runner.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return refresh_shared_weights(self.model_runner.get_model())  # type: ignore[attr-defined]
