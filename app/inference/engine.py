"""The inference engine seam: one interface for vLLM (over HTTP) and the in-process reference engine.

Invariant: ``Generation.logprobs[i]`` is the natural log-probability of ``Generation.token_ids[i]``
under the distribution the token was actually sampled from (the behaviour policy):

* ``temperature > 0``: ``log_softmax(logits / temperature)``, restricted to the top-p nucleus and
  renormalised when ``top_p < 1`` (vLLM's ``--logprobs-mode processed_logprobs``);
* ``temperature == 0`` (greedy): ``log_softmax(logits)`` of the untempered model.

The trainer recomputes the same quantity with the temperature it is configured with; the
simulator records the temperature in its run metadata. Stop tokens (EOS / ``stop_token_ids``) are
part of ``token_ids`` (and have a log-prob), because the policy must learn when to stop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one ``generate`` call.

    Attributes:
        max_tokens: completion tokens per prompt (upper bound).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        seed: seeds the sampler so a batch is reproducible (same prompts, same weights).
        stop_token_ids: extra ids that end a completion (the model's EOS always does).
    """

    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """One completion.

    Attributes:
        token_ids: completion token ids (including the stop token when ``finish_reason == "stop"``).
        logprobs: per-token log-probs in nats, same length (see the module invariant).
        finish_reason: ``stop`` (EOS or a stop id) or ``length`` (max_tokens reached).
        latency_s: wall-clock seconds from the request to this completion's last token.
        routed_experts: MoE only, ``[len(token_ids)][layers][top_k]`` expert ids that routed the
            position whose output distribution sampled each token; None for dense models.
        prefill_tokens: prompt tokens actually encoded for this request (the rest reused a cached
            prefix's K/V); 0 when the engine does not report it.
        dtype: the dtype the serving engine computed ``logprobs`` in (``bfloat16`` / ``float32``);
            None when the engine does not know it (a server it did not start).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    latency_s: float
    routed_experts: list[list[list[int]]] | None = field(default=None)
    prefill_tokens: int = 0
    dtype: str | None = None


class InferenceEngine(ABC):
    """Generate completions of token-id prompts with a named checkpoint's weights.

    Attributes:
        checkpoint_id: the checkpoint whose weights currently serve.
        tokenizer: a transformers tokenizer (chat template available).
    """

    checkpoint_id: str
    tokenizer: Any

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Complete each prompt (token ids); returns one ``Generation`` per prompt, in order."""

    @abstractmethod
    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        """Serve the full HF folder at ``path`` as ``checkpoint_id``."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a completion by default."""
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (int(eos),)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (HTTP clients); the default does nothing."""
