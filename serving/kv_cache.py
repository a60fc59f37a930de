"""KV storage for the continuous-batching torch engine: slot buffers for running sequences and an
LRU of finished sequences' caches for prefix reuse.

Invariant: a sequence's key/value of the token at position ``p`` (its position id, counted from
the prompt's first token) is stored at cache index ``p``, so "position ``j`` is visible to a query
at position ``i``" is exactly ``j <= i``; entries past a sequence's length are never read
unmasked and the buffers are zero-initialised, so stale or padding entries stay finite.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


class SlotKVCache:
    """Per-layer key and value buffers ``[slots, kv_heads, capacity, head_dim]`` (fp32).

    Running sequence ``i`` lives in slot ``i`` (slots stay contiguous: :meth:`remove` moves the last
    sequence into the freed slot), so a batch of slots ``[s0, s0 + B)`` is a view, not a copy.

    Args:
        num_layers: decoder layers.
        kv_heads: key/value heads per layer.
        head_dim: channels per head.
        dtype: buffer dtype (the model's compute dtype).
        device: where the buffers live (the model's device).
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def allocated_tokens(self) -> int:
        """Token entries held by the buffers (``slots * capacity``)."""
        return self.slots * self.capacity

    def ensure(self, slots: int, capacity: int, lengths: list[int]) -> None:
        """Grow the buffers to at least ``slots`` x ``capacity`` tokens, keeping the first
        ``len(lengths)`` slots' first ``lengths[i]`` entries."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = max(slots, self.slots)
        new_cap = max(self.capacity, capacity)
        shape = (new_slots, self.kv_heads, new_cap, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for i, n in enumerate(lengths):
            for old, new in zip(self.k + self.v, new_k + new_v):
                new[i, :, :n] = old[i, :, :n]
        self.k, self.v, self.slots, self.capacity = new_k, new_v, new_slots, new_cap

    def release(self) -> None:
        """Free the buffers (no sequence is running)."""
        self.k, self.v, self.slots, self.capacity = [], [], 0, 0

    def write_tokens(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``T`` new tokens' key/value: token ``t`` at ``[slots[t], :, positions[t]]``.

        Args:
            layer: decoder layer index.
            slots, positions: ``[T]`` int64 slot and position id (= cache index) of each token.
            key, value: ``[T, kv_heads, head_dim]`` after rotary embedding.
        """
        self.k[layer][slots, :, positions] = key
        self.v[layer][slots, :, positions] = value

    def view(self, layer: int, slot0: int, count: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[slot0, slot0 + count)``, first ``width`` entries:
        ``[count, kv_heads, width, head_dim]`` views (no copy)."""
        return (self.k[layer][slot0 : slot0 + count, :, :width], self.v[layer][slot0 : slot0 + count, :, :width])

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` entries into slot ``dst`` (compaction)."""
        for buf in self.k + self.v:
            buf[dst, :, :length] = buf[src, :, :length]

    def export(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of slot ``slot``'s first ``length`` entries: ``[layers, kv_heads, length, head_dim]`` x 2."""
        return (torch.stack([b[slot, :, :length] for b in self.k]), torch.stack([b[slot, :, :length] for b in self.v]))

    def load(self, slot: int, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Fill slot ``slot``'s first ``length`` entries from :meth:`export`-shaped tensors."""
        for layer in range(self.num_layers):
            self.k[layer][slot, :, :length] = keys[layer, :, :length]
            self.v[layer][slot, :, :length] = values[layer, :, :length]


@dataclass
class CachedPrefix:
    """A finished sequence's KV: ``tokens`` ``[L]`` int64 and keys/values ``[layers, kv_heads, L, head_dim]``."""

    tokens: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


class PrefixCache:
    """LRU of finished sequences' KV, keyed by their token ids (prompt + all completion tokens but
    the last, whose KV was never computed). A new prompt reuses the longest common prefix with any
    entry (always leaving at least its last token to encode, whose logits sample the first token).

    Bounded by ``max_tokens`` cached tokens in all; an entry whose tokens are a prefix of a newer
    one (a session's earlier turn) is dropped when the newer one arrives.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._next_id = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (the weights changed, so every cached K/V is stale)."""
        self._entries.clear()
        self.tokens = 0

    def lookup(self, prompt: list[int]) -> tuple[CachedPrefix | None, int]:
        """``(entry, n)``: the entry sharing the longest prefix with ``prompt`` and that length
        (at most ``len(prompt) - 1``); ``(None, 0)`` when nothing is shared."""
        if not self._entries or len(prompt) < 2:
            return None, 0
        query = torch.tensor(prompt[:-1], dtype=torch.long)
        best, best_n = None, 0
        for key, entry in self._entries.items():
            n = min(len(query), len(entry.tokens))
            if n <= best_n:
                continue
            diff = (query[:n] != entry.tokens[:n]).nonzero()
            shared = int(diff[0]) if len(diff) else n
            if shared > best_n:
                best, best_n = key, shared
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return self._entries[best], best_n

    def insert(self, entry: CachedPrefix) -> None:
        """Add ``entry`` (evicting least recently used ones past the bound); an entry longer than the
        bound is not kept."""
        n = len(entry.tokens)
        if n > self.max_tokens:
            return
        for key in [
            k
            for k, e in self._entries.items()
            if len(e.tokens) <= n and torch.equal(e.tokens, entry.tokens[: len(e.tokens)])
        ]:
            self.tokens -= len(self._entries.pop(key).tokens)
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.tokens += n
        self.evict_to(self.max_tokens)

    def evict_to(self, max_tokens: int) -> None:
        """Evict least recently used entries until at most ``max_tokens`` tokens stay cached."""
        while self.tokens > max(0, max_tokens) and self._entries:
            _, old = self._entries.popitem(last=False)
            self.tokens -= len(old.tokens)
