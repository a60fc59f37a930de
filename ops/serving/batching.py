"""Micro-batching: concurrent ``generate`` calls from several threads become one engine batch.

An engine that batches continuously itself (it has ``submit``, e.g. ``TorchEngine``) is called
straight through: its callers' sequences already decode together, each with its own seed.

Concurrent agent sessions (the simulator runs a group of sessions on one task side by side) each
call ``generate`` with one prompt; decoding them together costs little more than one on a CPU
(the weights are read once per step). Invariant: each caller gets exactly the completion its
own prompt would get from a batch with the others — same log-prob semantics, its own
``max_tokens`` (a row is cut at its limit, ``finish_reason="length"``), its own stop tokens; only
the sampling RNG stream is shared by the batch (the first request's seed seeds it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from ops.serving.engine import Generation, InferenceEngine, SamplingParams


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Generation] | None = None
    error: BaseException | None = None


class BatchingEngine(InferenceEngine):
    """Wraps an engine; requests arriving within ``window_s`` of each other share one batch.

    Requests batch together only when their temperature, top-p (they define the behaviour
    distribution) and stop tokens agree; others wait for the next batch.

    Args:
        engine: the wrapped engine (its ``generate`` runs on the caller thread that leads a batch).
        max_batch: most prompts per batch.
        window_s: how long a batch leader waits for company (seconds).
        expected: how many callers to wait for at most (a full batch starts at once).
    """

    def __init__(self, engine: InferenceEngine, *, max_batch: int = 8, window_s: float = 0.05,
                 expected: int | None = None) -> None:
        self.engine = engine
        self.max_batch, self.window_s, self.expected = max_batch, window_s, expected or max_batch
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._busy = False

    @property
    def checkpoint_id(self) -> str:  # type: ignore[override]
        return self.engine.checkpoint_id

    @property
    def tokenizer(self):  # type: ignore[override]
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        with self._cv:
            self.engine.load_checkpoint(checkpoint_id, path)

    def apply_delta(self, checkpoint_id: str, delta_path: Path, parent_id: str) -> None:
        with self._cv:
            self.engine.apply_delta(checkpoint_id, delta_path, parent_id)

    def set_expected(self, n: int) -> None:
        """How many concurrent callers there are now (a batch starts once this many are queued)."""
        with self._cv:
            self.expected = max(1, n)
            self._cv.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if hasattr(self.engine, "submit"):  # continuous batching: nothing to group
            return self.engine.generate(prompts, params)
        req = _Request(prompts, params)
        with self._cv:
            self._queue.append(req)
            self._cv.notify_all()
            while not req.done.is_set() and self._busy:
                self._cv.wait()
            if req.done.is_set():
                return self._result(req)
            self._busy = True  # this thread leads the next batch
            self._cv.wait_for(lambda: sum(len(r.prompts) for r in self._queue) >= min(self.expected, self.max_batch),
                              timeout=self.window_s)
            batch = self._take(req)
        try:
            self._run(batch)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
        return self._result(req)

    def _take(self, leader: _Request) -> list[_Request]:
        batch, rest, size = [], [], 0
        for r in self._queue:
            if (r is leader or _key(r.params) == _key(leader.params)) and size + len(r.prompts) <= self.max_batch:
                batch.append(r)
                size += len(r.prompts)
            else:
                rest.append(r)
        if leader not in batch:  # a single oversized request still runs
            batch, rest = [leader], [r for r in self._queue if r is not leader]
        self._queue = rest
        return batch

    def _run(self, batch: list[_Request]) -> None:
        prompts = [p for r in batch for p in r.prompts]
        params = replace(batch[0].params, max_tokens=max(r.params.max_tokens for r in batch))
        try:
            gens = self.engine.generate(prompts, params)
        except BaseException as exc:  # hand the failure to every caller of the batch
            for r in batch:
                r.error = exc
                r.done.set()
            return
        i = 0
        for r in batch:
            own_stop = set(self.engine.eos_token_ids) | set(r.params.stop_token_ids)
            r.result = [_cut(g, r.params.max_tokens, own_stop) for g in gens[i:i + len(r.prompts)]]
            i += len(r.prompts)
            r.done.set()

    @staticmethod
    def _result(req: _Request) -> list[Generation]:
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result


def _key(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_p, tuple(sorted(p.stop_token_ids)))


def _cut(gen: Generation, max_tokens: int, stop: set[int]) -> Generation:
    """The completion as this request would have produced it alone: up to its first own stop token
    or its own ``max_tokens`` (causal decoding makes the kept prefix identical)."""
    ids = gen.token_ids
    end = next((i + 1 for i, t in enumerate(ids[:max_tokens]) if t in stop), None)
    if end is not None:
        finish, n = "stop", end
    elif len(ids) >= max_tokens:
        finish, n = "length", max_tokens
    else:
        finish, n = gen.finish_reason, len(ids)
    experts = gen.routed_experts[:n] if gen.routed_experts is not None else None
    return Generation(token_ids=ids[:n], logprobs=gen.logprobs[:n], finish_reason=finish, latency_s=gen.latency_s,
                      routed_experts=experts)
