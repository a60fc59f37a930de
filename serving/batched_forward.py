"""One forward pass of a decoder-only transformers model over sequences of different lengths that
share a :class:`~serving.kv_cache.SlotKVCache`.

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
from serving.kv_cache import SlotKVCache

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_supported(model: torch.nn.Module) -> None:
    """Raise ``CheckpointError`` unless ``model`` has the decoder layout this module runs.

    Supported: ``*ForCausalLM`` with ``model.{embed_tokens, rotary_emb, layers, norm}`` and
    ``lm_head``; layers with ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
    ``post_attention_layernorm``, ``mlp``; full (not sliding-window) attention, no q/k norms.
    """
    inner = getattr(model, "model", None)
    ok = (
        inner is not None
        and hasattr(model, "lm_head")
        and all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm"))
    )
    if ok:
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            ok = ok and all(hasattr(layer, a) for a in _LAYER_PARTS) and all(hasattr(attn, a) for a in _ATTN_PARTS)
            ok = ok and not hasattr(attn, "q_norm") and not getattr(attn, "sliding_window", None)
    if ok and getattr(model.config, "sliding_window", None):
        ok = False
    if not ok:
        raise CheckpointError(
            f"the torch engine cannot batch {type(model).__name__}: it needs a Llama/Mistral/"
            "Mixtral-style decoder with full attention"
        )


def new_cache(model: torch.nn.Module) -> SlotKVCache:
    """An empty slot cache shaped for ``model``."""
    cfg = model.config
    attn = model.model.layers[0].self_attn
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    weight = next(model.parameters())
    return SlotKVCache(len(model.model.layers), kv_heads, attn.head_dim, weight.dtype, weight.device)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``visible``, -inf elsewhere (SDPA would convert a boolean mask in every layer)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


@torch.inference_mode()
def forward_step(
    model: torch.nn.Module,
    cache: SlotKVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    decode_rows: int,
    prefill_rows: list[tuple[int, int]],
) -> torch.Tensor:
    """Encode one step's new tokens of every row, flattened without padding, and return next-token logits.

    Rows: first ``decode_rows`` decoding sequences in slots ``[0, decode_rows)``, one token each;
    then one row per ``(slot, n)`` in ``prefill_rows`` with ``n`` new prompt tokens. The linear
    layers see all ``T`` tokens as one matrix; attention runs per part (one batched call for the
    decode rows, one call per prefill row).

    Args:
        model: a model accepted by :func:`check_supported`.
        cache: holds each row's earlier tokens at indices below its first new position; capacity
            must exceed ``positions.max()``.
        input_ids: ``[T]`` int64 new tokens, rows in the order above.
        positions: ``[T]`` int64 position ids (= cache indices) of ``input_ids``.
        decode_rows: rows with one new token (slots ``0..decode_rows-1``).
        prefill_rows: ``(slot, n)`` per prefill row; its positions run consecutively.

    Returns:
        ``[decode_rows + len(prefill_rows), V]`` float32 logits at each row's last new token.
    """
    inner = model.model
    total = input_ids.shape[0]
    cfg = inner.layers[0].self_attn.config
    group = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    hidden = inner.embed_tokens(input_ids[None])
    cos, sin = inner.rotary_emb(hidden, position_ids=positions[None])
    dev = input_ids.device
    slots = torch.cat(
        [torch.arange(decode_rows, dtype=torch.long, device=dev)]
        + [torch.full((n,), slot, dtype=torch.long, device=dev) for slot, n in prefill_rows]
    )
    # query rows of one KV head are (query head within its group, position): one mask per part
    dec_pos = positions[:decode_rows]
    dec_width = int(dec_pos.max()) + 1 if decode_rows else 0
    dec_mask = _additive(
        torch.arange(dec_width, device=dev)[None, None, None, :] <= dec_pos[:, None, None, None], hidden.dtype
    ).expand(decode_rows, 1, group, dec_width)
    pre_parts, offset = [], decode_rows
    for slot, n in prefill_rows:
        pos = positions[offset : offset + n]
        width = int(pos[-1]) + 1
        mask = _additive(torch.arange(width, device=dev)[None, :] <= pos[:, None], hidden.dtype)
        pre_parts.append((slot, offset, n, width, mask.repeat(group, 1)[None, None]))
        offset += n
    last = torch.tensor(
        list(range(decode_rows)) + [o + n - 1 for _, o, n, _, _ in pre_parts], dtype=torch.long, device=dev
    )
    for idx, layer in enumerate(inner.layers):
        attn = layer.self_attn
        rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        d = attn.head_dim
        h = layer.input_layernorm(hidden)
        q = attn.q_proj(h).view(1, total, -1, d).transpose(1, 2)
        k = attn.k_proj(h).view(1, total, -1, d).transpose(1, 2)
        v = attn.v_proj(h).view(1, total, -1, d).transpose(1, 2)
        q, k = rotary(q, k, cos, sin)
        kv_heads = k.shape[1]
        cache.write_tokens(idx, slots, positions, k[0].transpose(0, 1), v[0].transpose(0, 1))
        q = q[0]  # [Hq, T, d]; query head h uses KV head h // group (transformers' repeat_kv order)
        outs = []
        if decode_rows:
            keys, values = cache.view(idx, 0, decode_rows, dec_width)
            qd = q[:, :decode_rows].transpose(0, 1).reshape(decode_rows, kv_heads, group, d)
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=dec_mask, scale=attn.scaling)
            outs.append(o.reshape(decode_rows, -1))
        for slot, off, n, width, mask in pre_parts:
            keys, values = cache.view(idx, slot, 1, width)
            qp = q[:, off : off + n].reshape(1, kv_heads, group * n, d)
            o = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=attn.scaling)
            outs.append(o.view(kv_heads * group, n, d).transpose(0, 1).reshape(n, -1))
        hidden = hidden + attn.o_proj(torch.cat(outs)[None])
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden[0, last])).float()
