"""One forward pass of a decoder-only transformers model over sequences of different lengths that
share a :class:`~ops.serving.kv_cache.SlotKVCache`.

It runs the model's own modules (embedding, rotary embedding, layer norms, q/k/v/o projections,
MLP or sparse-MoE block, LM head) in the order of transformers' Llama/Mistral/Mixtral decoder
layer, and replaces only the cache and the attention call: each row attends to cache indices
``<= its own position`` (see the cache invariant), with grouped-query attention computed without
repeating K/V (queries of one KV head are stacked instead). So the logits of a row are those of
the same tokens encoded alone (up to float rounding).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from app.core.errors import CheckpointError
from ops.serving.kv_cache import SlotKVCache

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_supported(model: torch.nn.Module) -> None:
    """Raise ``CheckpointError`` unless ``model`` has the decoder layout this module runs.

    Supported: ``*ForCausalLM`` with ``model.{embed_tokens, rotary_emb, layers, norm}`` and
    ``lm_head``; layers with ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
    ``post_attention_layernorm``, ``mlp``; full (not sliding-window) attention, no q/k norms.
    """
    inner = getattr(model, "model", None)
    ok = inner is not None and hasattr(model, "lm_head") and all(
        hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm"))
    if ok:
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            ok = ok and all(hasattr(layer, a) for a in _LAYER_PARTS) and all(hasattr(attn, a) for a in _ATTN_PARTS)
            ok = ok and not hasattr(attn, "q_norm") and not getattr(attn, "sliding_window", None)
    if ok and getattr(model.config, "sliding_window", None):
        ok = False
    if not ok:
        raise CheckpointError(f"the torch engine cannot batch {type(model).__name__}: it needs a Llama/Mistral/"
                              "Mixtral-style decoder with full attention")


def new_cache(model: torch.nn.Module) -> SlotKVCache:
    """An empty slot cache shaped for ``model``."""
    cfg = model.config
    attn = model.model.layers[0].self_attn
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return SlotKVCache(len(model.model.layers), kv_heads, attn.head_dim, next(model.parameters()).dtype)


@torch.inference_mode()
def forward_logits(model: torch.nn.Module, cache: SlotKVCache, slot0: int, input_ids: torch.Tensor,
                   positions: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """Encode new tokens of ``B`` sequences in slots ``[slot0, slot0 + B)`` and return next-token logits.

    Args:
        model: a model accepted by :func:`check_supported`.
        cache: holds each row's earlier tokens at indices ``< positions[b, 0]``; capacity must
            exceed ``positions.max()``.
        input_ids: ``[B, n]`` int64 new tokens (rows right-padded to ``n``; padding is encoded into
            cache indices past the row's real tokens, which later writes overwrite).
        positions: ``[B, n]`` int64 position ids (= cache indices) of ``input_ids``.
        last_index: ``[B]`` int64 index in ``[0, n)`` of each row's last real token.

    Returns:
        ``[B, V]`` float32 logits at each row's last real token.
    """
    inner = model.model
    bsz, n = input_ids.shape
    width = int(positions.max()) + 1
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids=positions)
    visible = torch.arange(width)[None, None, :] <= positions[:, :, None]  # [B, n, width]
    attn0 = inner.layers[0].self_attn
    group = attn0.config.num_attention_heads // (getattr(attn0.config, "num_key_value_heads", None)
                                                 or attn0.config.num_attention_heads)
    # query rows are (query head within its KV group, position): the same mask for every group,
    # built once as an additive float mask (SDPA would convert a boolean one in every layer)
    mask = torch.zeros((bsz, 1, group, n, width), dtype=hidden.dtype)
    mask.masked_fill_(~visible[:, None, None], float("-inf"))
    mask = mask.view(bsz, 1, group * n, width)
    rows = torch.arange(bsz)
    for idx, layer in enumerate(inner.layers):
        attn = layer.self_attn
        rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        h = layer.input_layernorm(hidden)
        q = attn.q_proj(h).view(bsz, n, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(bsz, n, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(bsz, n, -1, attn.head_dim).transpose(1, 2)
        q, k = rotary(q, k, cos, sin)
        keys, values = cache.write(idx, slot0, positions, k, v, width)
        kv_heads = k.shape[1]
        # query head h uses KV head h // group (transformers' repeat_kv order): stack each KV
        # head's `group` query heads along the sequence axis instead of repeating K/V.
        qg = q.reshape(bsz, kv_heads, group * n, attn.head_dim)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=attn.scaling)
        out = out.reshape(bsz, kv_heads * group, n, attn.head_dim).transpose(1, 2).reshape(bsz, n, -1)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    last = inner.norm(hidden[rows, last_index])
    return model.lm_head(last).float()
