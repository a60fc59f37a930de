"""In-process torch inference engine (transformers model, fp32 on the CPU) with continuous batching.

Invariant (see ``engine.py``): every returned log-prob is of the sampled token under the
distribution it was sampled from. Serving weights are the bf16 rounding of the checkpoint's
weights (``serving_dtype``; the trainer's deltas are bf16 serving-weight deltas), held in fp32
so the CPU computes in fp32: a full load of checkpoint C and ``apply_delta`` from C's parent serve
bit-identical weights. Every request is one sequence of a shared decode loop (``scheduler.py``):
its completion and log-probs do not depend on what else runs (up to float rounding, ~1e-6), and
no completion mixes two checkpoints (a weight swap drains the running sequences first).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from app.checkpoints.delta import apply_delta
from app.core.errors import CheckpointError
from app.core.settings import get_settings
from app.inference.device import resolve_device
from app.inference.engine import Generation, InferenceEngine, SamplingParams
from serving.batched_forward import check_supported, forward_step, new_cache
from serving.scheduler import Scheduler, Sequence


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return its behaviour log-prob.

    Args:
        logits: ``[B, V]`` float32 next-token logits.
        params: temperature (0 = greedy) and top-p (Holtzman et al. 2020, "The Curious Case of
            Neural Text Degeneration": smallest set of tokens whose mass >= top_p, renormalised).
        generator: torch RNG for reproducible sampling (None: the global RNG).

    Returns:
        ``(tokens [B] int64, logprobs [B] float32)``; log-probs are of the tempered (and nucleus-
        truncated) distribution the token was drawn from, or of the untempered one when greedy.
    """
    logits = logits.float()
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
        drop_sorted = mass_before >= params.top_p  # the first token always survives (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
        logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class _RouterRecorder:
    """Forward hooks on MoE routers that keep the top-k expert ids of each row's last new token."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]
        self.last: list[torch.Tensor] = []
        self._token_index: torch.Tensor | None = None
        self._handles = [m.register_forward_hook(self._hook) for m in self.routers]

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def start_step(self, token_index: torch.Tensor | None) -> None:
        """Record the next forward pass: ``token_index`` ``[R]`` int64 flat indices (over the pass's
        batch x positions) of the token whose routing each row reports; None stops recording."""
        self.last, self._token_index = [], token_index

    def _hook(self, module, args, output) -> None:
        if self._token_index is None:  # a forward pass outside generation (e.g. a teacher-forced check)
            return
        idx = output[-1] if isinstance(output, tuple) else output.topk(module.top_k, dim=-1).indices
        self.last.append(idx.reshape(-1, idx.shape[-1])[self._token_index].to(torch.int32))

    def step_experts(self) -> torch.Tensor:
        """``[R, layers, top_k]`` expert ids of the last forward call; stops recording."""
        self._token_index = None
        return torch.stack(self.last, dim=1)


class TorchEngine(InferenceEngine):
    """A transformers causal LM served in-process (fp32, ``torch.inference_mode``), continuously batched.

    Args:
        model_dir: Hugging Face folder (config, safetensors, tokenizer).
        checkpoint_id: name to report (default: the folder name).
        max_seqs: most sequences decoded together (default: ``FLYWHEEL_SERVING_MAX_SEQS``, 64).
        max_kv_tokens: bound on cached key/value entries, in tokens, of running sequences (each
            reserves prompt + max_tokens) plus reusable prefixes (default:
            ``FLYWHEEL_SERVING_MAX_KV_TOKENS``); ``kv_bytes_per_token`` converts it to bytes.
        num_threads: ``torch.set_num_threads`` (None leaves the process setting).
        serving_dtype: round weights to this precision at load (``bfloat16``), None keeps them as stored.
        device: ``auto`` | ``cpu`` | ``cuda`` (``trainer.device.resolve_device``; weights stay fp32 and
            the key/value buffers live there; sampling reads each step's logits on the host).

    Raises:
        ConfigurationError: ``device`` names a device this machine lacks.

    Attributes:
        decode_s_per_token: seconds per decode step of one sequence (batch 1, median of a few
            steps measured at load on an idle engine).
        prefill_s_per_token: seconds per prompt token of a batch-1 prefill, measured likewise.

    Thread-safe: any number of threads may call :meth:`generate` / :meth:`submit` at once; their
    sequences decode together. :meth:`close` stops the decode thread.
    """

    def __init__(
        self,
        model_dir: Path,
        checkpoint_id: str | None = None,
        *,
        max_seqs: int | None = None,
        max_kv_tokens: int | None = None,
        num_threads: int | None = None,
        serving_dtype: str | None = "bfloat16",
        device: str = "auto",
    ) -> None:
        settings = get_settings().serving
        self.device = resolve_device(device)
        self.serving_dtype = getattr(torch, serving_dtype) if serving_dtype else None
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model = None
        self._routers: _RouterRecorder | None = None
        self._scheduler: Scheduler | None = None
        self.load_checkpoint(checkpoint_id or Path(model_dir).resolve().name, Path(model_dir))
        self._scheduler = Scheduler(
            lambda: self.model,
            sample_next,
            lambda: self._routers if self._routers.active else None,
            max_seqs=max_seqs or settings.max_seqs,
            max_kv_tokens=max_kv_tokens or settings.max_kv_tokens,
        )

    # ---- weights ---------------------------------------------------------------------------

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        """Load the full HF folder at ``path`` (fp32) and serve it as ``checkpoint_id`` once the
        running sequences have finished (new requests wait for the swap).

        Raises:
            CheckpointError: ``path`` has no ``config.json``, or the architecture cannot be batched.
        """
        path = Path(path)
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} is not a Hugging Face model folder (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        check_supported(model)
        if self.serving_dtype is not None:
            with torch.no_grad():
                for t in model.parameters():  # weights only: rotary buffers are not serving weights
                    if t.is_floating_point():
                        t.copy_(t.to(self.serving_dtype))
        model.to(self.device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        with self._drained():
            self.model, self.tokenizer, self.checkpoint_id, self.model_dir = model, tokenizer, checkpoint_id, path
            self._routers = _RouterRecorder(model)
            self._eos = self._eos_ids(path)
            self._measure_speed()

    def apply_delta(self, checkpoint_id: str, delta_path: Path, parent_id: str) -> None:
        """Serve ``parent + delta`` (``app.checkpoints.delta.apply_delta``) as ``checkpoint_id`` once the
        running sequences have finished.

        Raises:
            CheckpointError: the engine serves another checkpoint than ``parent_id``.
        """
        with self._drained():
            if self.checkpoint_id != parent_id:
                raise CheckpointError(
                    f"delta {checkpoint_id} applies to {parent_id}, but the engine serves {self.checkpoint_id}"
                )
            parent = {k: v for k, v in self.model.state_dict().items()}
            new_state = apply_delta(parent, Path(delta_path))
            # strict=False: tied weights (lm_head = embed_tokens) may appear once in the delta.
            missing, unexpected = self.model.load_state_dict(new_state, strict=False)
            if unexpected:
                raise CheckpointError(f"delta {delta_path} has unknown tensors: {unexpected[:5]}")
            self.checkpoint_id = checkpoint_id

    def _drained(self):
        return self._scheduler.paused() if self._scheduler is not None else contextlib.nullcontext()

    def _measure_speed(self, prompt_tokens: int = 32, steps: int = 5) -> None:
        """Set ``prefill_s_per_token`` and ``decode_s_per_token`` (batch 1, median of ``steps``)."""
        cache = new_cache(self.model)
        cache.ensure(1, prompt_tokens + steps + 1, [])
        dev = self.device
        ids = torch.arange(1, prompt_tokens + 1, device=dev)
        prefill, decode = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            forward_step(
                self.model, cache, ids, torch.arange(prompt_tokens, device=dev), 0, [(0, prompt_tokens)]
            ).cpu()  # .cpu() waits for an accelerator's queue
            prefill.append((time.perf_counter() - t0) / prompt_tokens)
        for step in range(steps):
            t0 = time.perf_counter()
            forward_step(self.model, cache, ids[:1], torch.tensor([prompt_tokens + step], device=dev), 1, []).cpu()
            decode.append(time.perf_counter() - t0)
        self.prefill_s_per_token = statistics.median(prefill)
        self.decode_s_per_token = statistics.median(decode)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of cached keys and values per token (all layers)."""
        return new_cache(self.model).bytes_per_token

    def _eos_ids(self, path: Path) -> tuple[int, ...]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
        return tuple(sorted(ids))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def max_context_tokens(self) -> int:
        """The model's position limit (tokens)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    # ---- generation ------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        """Queue one prompt; the future resolves to its ``Generation``.

        ``params.seed`` seeds this sequence's own sampler (None: a fresh random seed), so its
        sample does not depend on its batch companions.

        Raises:
            ValueError: an empty prompt, or prompt + max_tokens above the KV bound.
            RuntimeError: the engine is closed.
        """
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        generator = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            generator = torch.Generator().manual_seed(seed)
        future: Future = Future()
        stop = frozenset(self._eos) | frozenset(params.stop_token_ids)
        self._scheduler.submit(Sequence(list(prompt), params, future, stop, generator))
        return future

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Complete each prompt (blocking); prompt ``i`` samples with seed ``params.seed + i``.

        Raises:
            ValueError: an empty prompt, or prompt + max_tokens above the KV bound.
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        futures = [
            self.submit(p, params if params.seed is None else replace(params, seed=params.seed + i))
            for i, p in enumerate(prompts)
        ]
        return [f.result() for f in futures]

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (waits for running sequences, like a weight swap)."""
        with self._drained():
            pass

    @property
    def in_flight(self) -> int:
        """Sequences queued or decoding."""
        return self._scheduler.in_flight

    def close(self) -> None:
        """Stop the decode thread; requests still in flight fail with RuntimeError."""
        self._scheduler.close()


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``[len(completion)]`` of ``completion`` after ``prompt`` in one unpadded forward pass.

    The reference the engine's behaviour log-probs are tested against (and what a trainer
    computes): ``log_softmax(logits / T)`` at each completion position (T=1 for greedy).
    """
    ids = torch.tensor([prompt + completion], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1, :].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
