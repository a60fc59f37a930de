"""Router replay: a mixture-of-experts forward pass routed by the experts the serving engine used.

MoE routing is discontinuous: a router logit that moves by a rounding error (bf16 serving weights
vs fp32 training weights, other kernels, other batch shapes) can swap a token's experts, and the
trainer's log-prob then belongs to another policy than the behaviour policy that sampled the token.
Replaying the recorded routes removes that source of mismatch. We follow R3 ("rollout routing
replay", arXiv:2510.11370, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers"; verl R3, slime ``RoutingReplay``, prime-rl's ``TokenChoiceTopKRouter`` with
``routed_experts``): the top-k expert *indices* are forced, and the gate *weights* are recomputed
from the trainer's own router logits under the model's own rule, so gradients still reach the router.

Invariant: inside :func:`replay_routes`, every MoE router of the model returns, for each token whose
row of ``routes`` is >= 0 at that layer, exactly the recorded expert ids, with weights
``softmax(logits)[ids]`` (renormalised over the k ids when the model renormalises its top-k: always
for Mixtral, ``norm_topk_prob`` for Qwen2-MoE); every other token (-1: prompt, tool output, a
token served without routes) is routed by the router's own top-k, unchanged. Outside it the
model is untouched.

Routers are the modules :func:`moe_routers` finds (transformers v5's ``MixtralTopKRouter``,
``Qwen2MoeTopKRouter``: ``forward(hidden [N, H]) -> (logits [N, E], weights [N, k], ids [N, k])``),
in ``model.modules()`` order, the order ``serving.reference_engine`` records them in; layer ``l``
of a route is the ``l``-th router. Alignment: the engine records, for each sampled token, the
experts at the position whose output distribution sampled it, so ``routes[b, t]`` holds the
recorded experts of token ``t + 1`` (``trainer.batching`` shifts them). Activation checkpointing
recomputes layers after the block has exited; :func:`checkpoint_contexts` re-enters it there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

_ACTIVE = threading.local()
"""``_ACTIVE.replay``: the ``(model, routes)`` of the innermost :func:`replay_routes` block of this
thread, for :func:`checkpoint_contexts` to re-enter when activation checkpointing recomputes."""


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k MoE routers in layer order (empty for a dense model).

    A router is a module whose class name ends in ``Router`` and that has ``top_k`` (the rule
    ``serving.reference_engine`` records by).
    """
    return [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]


@contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Force the recorded experts in every forward call of ``model`` made inside the block.

    Args:
        model: a transformers MoE causal LM (Mixtral, Qwen2-MoE, ...) or a dense one.
        routes: ``[B, T, layers, top_k]`` integer expert ids for the ``[B, T]`` input of the
            forward call, ``-1`` where a token keeps its own routing (a row is forced per layer
            only when all its k entries are >= 0). None, or a dense model: nothing is patched.

    Raises:
        ValueError: ``routes`` is not 4-D, its layer count or top-k differs from the model's, an
            id is not below the router's expert count, or (in the forward call) the call's token
            count is not ``B * T``.
    """
    routers = moe_routers(model)
    if routes is None or not routers:
        yield
        return
    if routes.dim() != 4 or routes.shape[2] != len(routers) or routes.shape[3] != routers[0].top_k:
        raise ValueError(
            f"routes of shape {tuple(routes.shape)} for a model with {len(routers)} MoE layers "
            f"and top-k {routers[0].top_k} (need [B, T, {len(routers)}, {routers[0].top_k}])"
        )
    experts = min(int(getattr(r, "num_experts", 2**31 - 1)) for r in routers)
    if routes.numel() and int(routes.max()) >= experts:
        raise ValueError(f"routes name expert {int(routes.max())}, the model has {experts}")
    flat = routes.reshape(-1, routes.shape[2], routes.shape[3])
    handles = [r.register_forward_hook(_forcing_hook(flat[:, layer, :])) for layer, r in enumerate(routers)]
    outer, _ACTIVE.replay = getattr(_ACTIVE, "replay", None), (model, routes)
    try:
        yield
    finally:
        _ACTIVE.replay = outer
        for h in handles:
            h.remove()


def checkpoint_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant): the backward pass recomputes a
    checkpointed layer under the routes its forward ran with, after :func:`replay_routes` has exited.

    Enable with ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    False, "context_fn": checkpoint_contexts})``; without it a recompute routes by the trainer's own
    router and the gradients belong to another forward pass than the loss (slime's
    ``replay_backward`` stage solves the same problem).

    Returns:
        ``(forward context, recompute context)``: nothing extra for the forward, :func:`replay_routes`
        with the routes in force when the forward ran (nothing if none was).
    """
    active = getattr(_ACTIVE, "replay", None)
    return nullcontext(), (nullcontext() if active is None else replay_routes(*active))


def _forcing_hook(layer_routes: torch.Tensor):
    """A forward hook that rewrites a router's ``(logits, weights, ids)`` with ``layer_routes [N, k]``."""

    def hook(module: torch.nn.Module, args, output):
        logits, weights, ids = output
        if logits.shape[0] != layer_routes.shape[0]:
            raise ValueError(f"router saw {logits.shape[0]} tokens, routes cover {layer_routes.shape[0]}")
        wanted = layer_routes.to(device=ids.device, dtype=ids.dtype)
        forced = (wanted >= 0).all(dim=-1, keepdim=True)  # [N, 1]
        new_ids = torch.where(forced, wanted, ids)
        probs = torch.softmax(logits.float(), dim=-1)
        new_weights = probs.gather(-1, new_ids)
        if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises its top-k
            new_weights = new_weights / new_weights.sum(dim=-1, keepdim=True)
        return logits, torch.where(forced, new_weights.to(weights.dtype), weights), new_ids

    return hook
