"""The reference engine: a transformers causal LM served in-process with ``generate``, one prompt at
a time, for tests and hosts without vLLM (``flywheel serve`` puts it behind vLLM's HTTP subset).

Production serves on vLLM (:mod:`serving.openai_engine`); this engine has no batching, no KV-cache
management and no prefix reuse of its own. It keeps the engine invariant
(:mod:`app.inference.engine`): each log-prob is of the sampled token under the distribution it was
sampled from, read from ``generate``'s processed scores (temperature, then top-p; greedy: the
untempered logits), so a teacher-forced pass (:func:`teacher_forced_logprobs`) reproduces it.
Serving weights are the bf16 rounding of the checkpoint's (``serving_dtype``), held in fp32, like a
bf16 vLLM server's, so the trainer sees the usual training-inference mismatch.

Invariants: calls are serialised by one lock, so a completion never mixes two checkpoints and never
depends on another request; prompt ``i`` of a seeded call samples with seed ``seed + i`` from its own
generator state (the process's global RNG is restored afterwards).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from app.core.errors import CheckpointError
from app.inference.device import resolve_device
from app.inference.engine import Generation, InferenceEngine, SamplingParams


class _RouteRecorder:
    """Forward hooks on the MoE routers that keep the top-k experts of each call's last position:
    during ``generate`` of one prompt, call ``t`` sampled completion token ``t`` from that position."""

    def __init__(self, model: torch.nn.Module) -> None:
        # the routers ``trainer.router_replay.moe_routers`` replays, in the same (layer) order
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]
        self.calls: list[list[torch.Tensor]] = []
        self.recording = False
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.recording:
            return
        ids = output[-1] if isinstance(output, tuple) else output.topk(module.top_k, dim=-1).indices
        last = ids.reshape(-1, ids.shape[-1])[-1].to(torch.int32)
        if not self.calls or len(self.calls[-1]) == len(self.routers):
            self.calls.append([])
        self.calls[-1].append(last)

    def routes(self, n_tokens: int) -> list[list[list[int]]] | None:
        """``[n_tokens][layers][top_k]`` of the recorded calls (None for a dense model)."""
        if not self.routers:
            return None
        return [torch.stack(layers).tolist() for layers in self.calls[:n_tokens]]


class ReferenceEngine(InferenceEngine):
    """A transformers causal LM (fp32 compute, ``torch.inference_mode``), one prompt at a time.

    Args:
        model_dir: Hugging Face folder (config, safetensors, tokenizer).
        checkpoint_id: name to report (default: the folder name).
        num_threads: ``torch.set_num_threads`` (None leaves the process setting).
        serving_dtype: round weights to this precision at load (``bfloat16``); None keeps them as stored.
        device: ``auto`` | ``cpu`` | ``cuda`` (:func:`app.inference.device.resolve_device`).

    Raises:
        CheckpointError: ``model_dir`` has no ``config.json``.
        ConfigurationError: ``device`` names a device this machine lacks.
    """

    def __init__(
        self,
        model_dir: Path,
        checkpoint_id: str | None = None,
        *,
        num_threads: int | None = None,
        serving_dtype: str | None = "bfloat16",
        device: str = "auto",
    ) -> None:
        self.device = resolve_device(device)
        self.serving_dtype = getattr(torch, serving_dtype) if serving_dtype else None
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._lock = threading.Lock()
        self.load_checkpoint(checkpoint_id or Path(model_dir).resolve().name, Path(model_dir))

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        """Serve the full HF folder at ``path`` as ``checkpoint_id`` (after the running call).

        Raises:
            CheckpointError: ``path`` has no ``config.json``.
        """
        path = Path(path)
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} is not a Hugging Face model folder (no config.json)")
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        if self.serving_dtype is not None:
            with torch.no_grad():
                for t in model.parameters():  # weights only: rotary buffers are not serving weights
                    t.copy_(t.to(self.serving_dtype))
        torch.nn.Module.to(model, self.device)  # transformers wraps PreTrainedModel.to in an untyped decorator
        tokenizer = AutoTokenizer.from_pretrained(path)
        eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        try:
            configured = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json
            configured = None
        eos.update([configured] if isinstance(configured, int) else configured or [])
        with self._lock:
            self.model, self.tokenizer, self.model_dir = model, tokenizer, path
            self.checkpoint_id = checkpoint_id
            self._eos = tuple(sorted(eos))
            self._routes = _RouteRecorder(model)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def max_context_tokens(self) -> int:
        """The model's position limit (tokens)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Complete each prompt in turn; prompt ``i`` samples with seed ``params.seed + i``.

        Raises:
            ValueError: an empty prompt, or prompt + max_tokens beyond the model's positions.
        """
        for prompt in prompts:
            if not prompt:
                raise ValueError("empty prompt")
            if len(prompt) + params.max_tokens > self.max_context_tokens:
                raise ValueError(
                    f"{len(prompt)} prompt + {params.max_tokens} new tokens exceed the model's "
                    f"{self.max_context_tokens} positions"
                )
        with self._lock:
            return [
                self._generate_one(p, params, None if params.seed is None else params.seed + i)
                for i, p in enumerate(prompts)
            ]

    def _generate_one(self, prompt: list[int], params: SamplingParams, seed: int | None) -> Generation:
        stop = sorted(set(self._eos) | set(params.stop_token_ids))
        sample = params.temperature > 0
        config = GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=0 if sample else None,  # no top-k cut (transformers fills an unset one with 50)
            eos_token_id=stop or None,
            pad_token_id=stop[0] if stop else 0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        started = time.perf_counter()
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        self._routes.calls, self._routes.recording = [], True
        try:
            with torch.random.fork_rng(devices=[]), torch.inference_mode():
                if seed is not None:
                    torch.manual_seed(seed)
                out = self.model.generate(  # type: ignore[operator]  # transformers types generate on a mixin
                    input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
                )
        finally:
            self._routes.recording = False
        assert isinstance(out, GenerateDecoderOnlyOutput)  # return_dict_in_generate, a decoder-only model
        tokens = out.sequences[0, len(prompt) :].tolist()
        scores = out.scores or ()  # [1, V] processed logits per new token
        logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(scores, tokens)]
        return Generation(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason="stop" if tokens and tokens[-1] in stop else "length",
            latency_s=time.perf_counter() - started,
            routed_experts=self._routes.routes(len(tokens)),
            prefill_tokens=len(prompt),
            dtype="float32",
        )

    def reset_prefix_cache(self) -> None:
        """Nothing to drop: no prefix outlives its call (the HTTP route stays for vLLM's clients)."""


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs ``[len(completion)]`` of ``completion`` after ``prompt`` in one forward pass.

    The reference the engines' behaviour log-probs are tested against (and what a trainer
    computes): ``log_softmax(logits / T)`` at each completion position (T=1 for greedy).
    """
    ids = torch.tensor([prompt + completion], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1, :].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
