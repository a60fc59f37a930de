"""Continuous batching: one background thread owns the model and decodes every running sequence
together, one token per step; requests join at any step and leave when they stop.

Invariants:

* A sequence's tokens and behaviour log-probs do not depend on its batch companions: each row
  attends only to its own cache (``batched_forward``), and a sampled row draws from its own
  ``torch.Generator`` (seeded from its ``SamplingParams.seed``); log-probs follow ``sample_next``.
* No sequence mixes two sets of weights: :meth:`Scheduler.paused` waits until no sequence runs and
  admits none until the weights are swapped; it also empties the prefix cache (stale K/V).
* The decode thread never outlives the interpreter's shutdown: every open scheduler is closed (its
  current step finished, the thread joined) by an ``atexit`` hook, so a caller that exits without
  :meth:`Scheduler.close` does not tear torch down under a running step.
* Bounds: at most ``max_seqs`` running; slot buffers plus cached prefixes stay within
  ``max_kv_tokens`` token entries (a running sequence reserves ``prompt + max_tokens`` up front, so
  it never needs preemption). Requests beyond the bounds wait in FIFO order.

Scheduling follows nano-vllm's ``Scheduler`` (GeeeekExplorer/nano-vllm, ``nanovllm/engine/
scheduler.py``), except that one forward pass carries both kinds of rows: a step encodes the
prompts of the admitted waiting sequences and the next token of every running one, flattened
without padding (``batched_forward.forward_step``).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from app.inference.engine import Generation, SamplingParams
from serving.batched_forward import forward_step, new_cache
from serving.kv_cache import CachedPrefix, PrefixCache


@dataclass(eq=False)
class Sequence:
    """One request in flight (the loop thread owns everything but ``future``)."""

    prompt: list[int]
    params: SamplingParams
    future: Future
    stop: frozenset[int]
    generator: torch.Generator | None
    submitted: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    experts: list = field(default_factory=list)
    length: int = 0  # tokens whose K/V is in the cache (= position of the next token fed)
    prefill_tokens: int = 0
    finish_reason: str = ""
    latency: float = 0.0

    @property
    def reserve(self) -> int:
        """Cache entries this sequence may need (tokens)."""
        return len(self.prompt) + self.params.max_tokens


_open: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # schedulers whose thread runs


@atexit.register
def _close_open() -> None:
    """Close every scheduler still running (interpreter exit; daemon threads are not joined)."""
    for scheduler in list(_open):
        scheduler.close()


class Scheduler:
    """Owns the decode loop (see the module invariants); the thread starts at construction.

    Args:
        get_model: returns the served model (one accepted by ``batched_forward.check_supported``),
            read at every step so a weight swap is seen at the next one.
        sample: ``sample_next``-compatible ``(logits [B, V], params, generator) -> (tokens, logprobs)``.
        routers_fn: returns the engine's ``_RouterRecorder`` (MoE expert ids per row), or None
            for a dense model.
        max_seqs: most sequences decoded together.
        max_kv_tokens: token entries of slot buffers plus prefix cache.
        max_prefill_tokens: prompt tokens admitted into one step (a longer prompt goes alone).
    """

    def __init__(
        self,
        get_model: Callable[[], torch.nn.Module],
        sample,
        routers_fn: Callable,
        *,
        max_seqs: int,
        max_kv_tokens: int,
        max_prefill_tokens: int = 2048,
    ) -> None:
        self._get_model, self._sample, self._routers_fn = get_model, sample, routers_fn
        self.max_seqs, self.max_kv_tokens, self.max_prefill_tokens = max_seqs, max_kv_tokens, max_prefill_tokens
        self.prefix_cache = PrefixCache(max_kv_tokens)
        self._cache = None
        self._cv = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._pauses = 0
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="torch-engine-decode", daemon=True)
        self._thread.start()
        _open.add(self)

    # ---- callers' side ---------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``; raises RuntimeError after :meth:`close`, ValueError if it can never fit."""
        if seq.reserve > self.max_kv_tokens:
            raise ValueError(
                f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.params.max_tokens}) exceeds "
                f"the engine's KV bound of {self.max_kv_tokens} tokens"
            )
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(seq)
            self._cv.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Drain: wait until no sequence runs, hold admissions, clear the prefix cache; resume on exit."""
        with self._cv:
            self._pauses += 1
            self._cv.wait_for(lambda: not self._running and not self._busy)
        try:
            self.prefix_cache.clear()
            self._cache = None  # the next model may have another shape
            yield
        finally:
            with self._cv:
                self._pauses -= 1
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the loop; sequences still queued or running fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        _open.discard(self)
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def in_flight(self) -> int:
        """Sequences queued or running."""
        with self._cv:
            return len(self._waiting) + len(self._running)

    # ---- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._running or (self._waiting and not self._pauses))
                if self._closed:
                    break
                try:
                    admitted, shape = self._admit() if not self._pauses else ([], (0, 0))
                except BaseException as exc:  # the thread must outlive it: fail what waits, go on
                    for seq in self._waiting:
                        seq.future.set_exception(exc)
                    self._waiting.clear()
                    continue
                self._busy = True
            try:
                self._step(admitted, shape)
            except BaseException as exc:  # the boundary: a failed step fails its requests, the loop goes on
                for seq in self._running + admitted:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
                self._running, self._cache = [], None
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        error = RuntimeError("the engine was closed before this request finished")
        for seq in list(self._waiting) + self._running:
            if not seq.future.done():
                seq.future.set_exception(error)
        self._waiting.clear()
        self._running = []

    def _admit(self) -> tuple[list[Sequence], tuple[int, int]]:
        """Move waiting sequences that fit the bounds into a prefill batch (FIFO, under the lock).

        Returns the batch and the slot-buffer shape ``(slots, capacity)`` it needs."""
        admitted: list[Sequence] = []
        reserve = max((s.reserve for s in self._running), default=0)
        tokens, shape = 0, (0, 0)
        while self._waiting and len(self._running) + len(admitted) < self.max_seqs:
            seq = self._waiting[0]
            if admitted and tokens + len(seq.prompt) > self.max_prefill_tokens:
                break
            plan = self._plan(len(self._running) + len(admitted) + 1, max(reserve, seq.reserve))
            if plan is None:
                break
            admitted.append(self._waiting.popleft())
            reserve, tokens, shape = max(reserve, seq.reserve), tokens + len(seq.prompt), plan
        if admitted:
            self.prefix_cache.evict_to(self.max_kv_tokens - shape[0] * shape[1])
        return admitted, shape

    def _plan(self, slots: int, reserve: int) -> tuple[int, int] | None:
        """Slot-buffer shape for ``slots`` sequences of up to ``reserve`` tokens within the KV bound
        (None if it does not fit). Slots grow geometrically and capacity in steps of 128 tokens,
        when the bound allows, so joining sequences rarely reallocate the buffers."""
        cache = self._cache
        cur_slots, cur_cap = (cache.slots, cache.capacity) if cache is not None and self._running else (0, 0)
        budget = self.max_kv_tokens
        cap = max(cur_cap, reserve)
        rounded = max(cur_cap, -(-reserve // 128) * 128)
        n = max(cur_slots, slots)
        if n * cap > budget:
            return None
        if n * rounded <= budget:
            cap = rounded
        grown = min(self.max_seqs, max(slots, 2 * cur_slots, 4))
        if grown > n and grown * cap <= budget:
            n = grown
        return n, cap

    def _step(self, admitted: list[Sequence], shape: tuple[int, int]) -> None:
        """One forward pass: a token for every running sequence plus the admitted prompts."""
        model = self._get_model()
        if self._cache is None:
            self._cache = new_cache(model)
        cache, decoding = self._cache, list(self._running)
        if admitted:
            if not decoding:
                cache.release()
            cache.ensure(*shape, [s.length for s in decoding])
        ids = [s.tokens[-1] for s in decoding]
        positions = [s.length for s in decoding]
        prefill_rows = []
        for row, seq in enumerate(admitted, start=len(decoding)):
            entry, n = self.prefix_cache.lookup(seq.prompt)
            if entry is not None:
                cache.load(row, entry.keys, entry.values, n)
            ids.extend(seq.prompt[n:])
            positions.extend(range(n, len(seq.prompt)))
            prefill_rows.append((row, len(seq.prompt) - n))
            seq.length, seq.prefill_tokens = n, len(seq.prompt) - n
        routers = self._routers_fn()
        if routers is not None:
            ends = list(range(len(decoding))) + [
                len(decoding) + sum(n for _, n in prefill_rows[: i + 1]) - 1 for i in range(len(prefill_rows))
            ]
            routers.start_step(torch.tensor(ends, dtype=torch.long, device=cache.device))
        logits = forward_step(
            model,
            cache,
            torch.tensor(ids, dtype=torch.long, device=cache.device),
            torch.tensor(positions, dtype=torch.long, device=cache.device),
            len(decoding),
            prefill_rows,
        )
        # Samplers draw from per-sequence CPU generators (a sequence's sample must not depend on its
        # batch): on an accelerator, the step's [rows, V] logits come to the host first.
        logits = logits.cpu()
        for seq in decoding:
            seq.length += 1
        for seq in admitted:
            seq.length = len(seq.prompt)
        self._running.extend(admitted)
        self._sample_rows(logits, self._running, routers)
        self._retire()
        if not self._running and not self._waiting:
            cache.release()

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence], routers) -> None:
        """Sample one token per row (greedy rows together, each sampled row with its own RNG)."""
        tokens, logps = [0] * len(seqs), [0.0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
        if greedy:
            tok, lp = self._sample(logits[greedy], seqs[greedy[0]].params, None)
            for i, t, p in zip(greedy, tok.tolist(), lp.tolist()):
                tokens[i], logps[i] = t, p
        for i, s in enumerate(seqs):
            if s.params.temperature > 0:
                tok, lp = self._sample(logits[i : i + 1], s.params, s.generator)
                tokens[i], logps[i] = int(tok[0]), float(lp[0])
        experts = routers.step_experts().tolist() if routers is not None else None
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            s.tokens.append(tokens[i])
            s.logprobs.append(logps[i])
            if experts is not None:
                s.experts.append(experts[i])
            if tokens[i] in s.stop:
                s.finish_reason = "stop"
            elif len(s.tokens) >= s.params.max_tokens:
                s.finish_reason = "length"
            if s.finish_reason:
                s.latency = now - s.submitted

    def _retire(self) -> None:
        """Resolve finished sequences, cache their K/V for prefix reuse, keep slots contiguous."""
        cache = self._cache
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            if not seq.finish_reason:
                i += 1
                continue
            keys, values = cache.export(i, seq.length)
            tokens = torch.tensor(seq.prompt + seq.tokens[:-1], dtype=torch.long)
            self.prefix_cache.insert(CachedPrefix(tokens, keys, values))
            self.prefix_cache.evict_to(self.max_kv_tokens - cache.allocated_tokens)
            last = len(self._running) - 1
            if i != last:
                cache.move(last, i, self._running[last].length)
                self._running[i] = self._running[last]
            self._running.pop()
            seq.future.set_result(
                Generation(
                    token_ids=seq.tokens,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    latency_s=seq.latency,
                    routed_experts=seq.experts if self._routers_fn() is not None else None,
                    prefill_tokens=seq.prefill_tokens,
                    dtype="float32",  # fp32 compute (over bf16-rounded weights: serving.torch_engine)
                )
            )
