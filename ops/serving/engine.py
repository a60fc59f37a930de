"""The inference engine seam: one interface for vLLM (over HTTP) and the in-process torch engine.

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

from app.core.errors import ConfigurationError


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
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    latency_s: float
    routed_experts: list[list[list[int]]] | None = field(default=None)
    prefill_tokens: int = 0


class InferenceEngine(ABC):
    """Generate completions of token-id prompts with a named checkpoint's weights.

    Attributes:
        checkpoint_id: the checkpoint whose weights currently serve.
        tokenizer: a transformers tokenizer (chat template available).
        applies_deltas: whether :meth:`apply_delta` patches the served weights with flywheel's bf16
            delta (False: it reloads the full checkpoint folder, as vLLM must).
    """

    checkpoint_id: str
    tokenizer: Any
    applies_deltas: bool = True

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Complete each prompt (token ids); returns one ``Generation`` per prompt, in order."""

    @abstractmethod
    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        """Serve the full HF folder at ``path`` as ``checkpoint_id``."""

    @abstractmethod
    def apply_delta(self, checkpoint_id: str, delta_path: Path, parent_id: str) -> None:
        """Serve ``parent + delta`` as ``checkpoint_id``.

        Raises:
            CheckpointError: the engine does not currently serve ``parent_id``, or the delta does
                not apply.
        """

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a completion by default."""
        eos = self.tokenizer.eos_token_id
        return () if eos is None else (int(eos),)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (HTTP clients); the default does nothing."""


ENGINE_TYPES = ("torch", "vllm", "openai")
ROLES = ("production", "eval")


def setup_engine(settings=None, *, checkpoint_id: str | None = None, model_dir: Path | None = None,
                 engine: str | None = None, url: str | None = None, role: str = "production") -> InferenceEngine:
    """Build the configured engine (``FLYWHEEL_SERVING_ENGINE``: ``torch`` | ``vllm``).

    ``torch`` loads ``model_dir`` if given, else the checkpoint ``checkpoint_id`` (default: the
    production checkpoint from the registry) from the checkpoint store, on
    ``FLYWHEEL_SERVING_DEVICE``; the engine is this process's own, whatever the role. ``vllm``
    (alias ``openai``) talks to a server (vLLM or ``flywheel serve``) and asks it to load
    ``model_dir`` / the checkpoint when one is named, else it serves what the server has. Which
    server depends on ``role``:

    * ``production``: ``url`` / ``FLYWHEEL_SERVING_URL``, the server users are served by (the
      serving watcher and the simulator use it);
    * ``eval``: ``url`` / ``FLYWHEEL_SERVING_EVAL_URL``, a server of its own, so loading a candidate
      never changes the weights production serves.

    Raises:
        ConfigurationError: unknown engine type or role, no URL for the role, an eval URL equal to
            the production URL, or no production checkpoint.
    """
    from app.core.settings import get_settings

    settings = settings or get_settings()
    kind = (engine or settings.serving.engine).lower()
    if kind not in ENGINE_TYPES:
        raise ConfigurationError(f"unknown inference engine {kind!r}; expected one of {', '.join(ENGINE_TYPES)}")
    if role not in ROLES:
        raise ConfigurationError(f"unknown engine role {role!r}; expected one of {', '.join(ROLES)}")
    if kind == "torch":
        from ops.serving.torch_engine import TorchEngine

        cid, path = resolve_checkpoint(checkpoint_id, model_dir)
        return TorchEngine(path, checkpoint_id=cid, device=settings.serving.device)
    from ops.serving.openai_engine import OpenAICompatEngine

    base_url = url or (settings.serving.eval_url if role == "eval" else settings.serving.url)
    if not base_url:
        env = "FLYWHEEL_SERVING_EVAL_URL" if role == "eval" else "FLYWHEEL_SERVING_URL"
        raise ConfigurationError(f"engine 'vllm' in role {role} needs {env} (an OpenAI-compatible server"
                                 + (" that does not serve production)" if role == "eval" else ")"))
    if role == "eval" and settings.serving.url and _same_server(base_url, settings.serving.url):
        raise ConfigurationError(f"the eval server {base_url} is the production server: evaluating a candidate "
                                 "there would swap production's weights; run a second server for evals")
    key = settings.serving.api_key.get_secret_value() if settings.serving.api_key else None
    client = OpenAICompatEngine(base_url, api_key=key)
    if model_dir is not None or checkpoint_id is not None:
        cid, path = resolve_checkpoint(checkpoint_id, model_dir)
        if cid != client.checkpoint_id:
            client.load_checkpoint(cid, path)
    return client


def _same_server(a: str, b: str) -> bool:
    return a.rstrip("/").removesuffix("/v1") == b.rstrip("/").removesuffix("/v1")


def resolve_checkpoint(checkpoint_id: str | None, model_dir: Path | None) -> tuple[str, Path]:
    """(checkpoint id, folder) for an explicit folder, a named checkpoint or the production one.

    Raises:
        ConfigurationError: no checkpoint named and none in production.
        CheckpointError: the named checkpoint is not STABLE.
    """
    from app.checkpoint_store import CheckpointStore

    if model_dir is not None:
        return checkpoint_id or Path(model_dir).resolve().name, Path(model_dir)
    if checkpoint_id is None:
        from app.core.db import session_scope
        from app.repositories.checkpoints import get_production

        with session_scope() as session:
            prod = get_production(session)
            if prod is None:
                raise ConfigurationError("no production checkpoint: run `flywheel model init` first")
            checkpoint_id = prod.id
    return checkpoint_id, CheckpointStore.from_settings().stable_path(checkpoint_id)
