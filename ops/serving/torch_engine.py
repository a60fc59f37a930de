"""In-process torch inference engine (transformers model, fp32 on the CPU, batched, KV cache).

Invariant (see ``engine.py``): every returned log-prob is of the sampled token under the
distribution it was sampled from. Serving weights are the bf16 rounding of the checkpoint's
weights (``serving_dtype``; the trainer's deltas are bf16 serving-weight deltas), held in fp32
so the CPU computes in fp32: a full load of checkpoint C and ``apply_delta`` from C's parent serve
bit-identical weights. Prompts of different lengths are LEFT-padded; the attention
mask hides the padding and position ids count only real tokens, so a prompt's completion and
log-probs do not depend on what else is in its batch (up to float rounding, ~1e-6).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from app.core.errors import CheckpointError
from ops.serving.engine import Generation, InferenceEngine, SamplingParams


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
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
    """Forward hooks on MoE routers that keep the top-k expert ids of each layer's LAST position."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]
        self.last: list[torch.Tensor] = []
        self._batch = 0
        self._handles = [m.register_forward_hook(self._hook) for m in self.routers]

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def start_step(self, batch: int) -> None:
        self.last, self._batch = [], batch

    def _hook(self, module, args, output) -> None:
        if not self._batch:  # a forward pass outside generate (e.g. a teacher-forced check)
            return
        idx = output[-1] if isinstance(output, tuple) else output.topk(module.top_k, dim=-1).indices
        self.last.append(idx.reshape(self._batch, -1, idx.shape[-1])[:, -1, :].to(torch.int32))

    def step_experts(self) -> torch.Tensor:
        """``[B, layers, top_k]`` expert ids of the last forward call; stops recording."""
        self._batch = 0
        return torch.stack(self.last, dim=1)


class TorchEngine(InferenceEngine):
    """A transformers causal LM served in-process (fp32, ``torch.inference_mode``).

    Args:
        model_dir: Hugging Face folder (config, safetensors, tokenizer).
        checkpoint_id: name to report (default: the folder name).
        max_batch_size: prompts per forward batch; larger requests are split.
        num_threads: ``torch.set_num_threads`` (None leaves the process setting).
        serving_dtype: round weights to this precision at load (``bfloat16``), None keeps them as stored.
        device: ``auto`` | ``cpu`` | ``cuda`` (``trainer.device.resolve_device``; the weights stay fp32).

    Raises:
        ConfigurationError: ``device`` names a device this machine lacks.

    Thread-safe: one ``generate`` / load at a time (a lock), so the HTTP server can share it.
    """

    def __init__(self, model_dir: Path, checkpoint_id: str | None = None, *, max_batch_size: int = 16,
                 num_threads: int | None = None, serving_dtype: str | None = "bfloat16", device: str = "auto") -> None:
        from trainer.device import resolve_device

        self.device = resolve_device(device)
        self.serving_dtype = getattr(torch, serving_dtype) if serving_dtype else None
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.max_batch_size = max_batch_size
        self._lock = threading.RLock()
        self.model = None
        self.load_checkpoint(checkpoint_id or Path(model_dir).resolve().name, Path(model_dir))

    # ---- weights ---------------------------------------------------------------------------

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        """Load the full HF folder at ``path`` (fp32) and serve it as ``checkpoint_id``.

        Raises:
            CheckpointError: ``path`` has no ``config.json``.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} is not a Hugging Face model folder (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        if self.serving_dtype is not None:
            with torch.no_grad():
                for t in model.parameters():  # weights only: rotary buffers are not serving weights
                    if t.is_floating_point():
                        t.copy_(t.to(self.serving_dtype))
        model.to(self.device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        with self._lock:
            self.model, self.tokenizer, self.checkpoint_id, self.model_dir = model, tokenizer, checkpoint_id, path
            self._routers = _RouterRecorder(model)
            self._eos = self._eos_ids(path)

    def apply_delta(self, checkpoint_id: str, delta_path: Path, parent_id: str) -> None:
        """Serve ``parent + delta`` (``trainer.delta.apply_delta``) as ``checkpoint_id``.

        Raises:
            CheckpointError: the engine serves another checkpoint than ``parent_id``.
        """
        from trainer.delta import apply_delta

        with self._lock:
            if self.checkpoint_id != parent_id:
                raise CheckpointError(
                    f"delta {checkpoint_id} applies to {parent_id}, but the engine serves {self.checkpoint_id}")
            parent = {k: v for k, v in self.model.state_dict().items()}
            new_state = apply_delta(parent, Path(delta_path))
            # strict=False: tied weights (lm_head = embed_tokens) may appear once in the delta.
            missing, unexpected = self.model.load_state_dict(new_state, strict=False)
            if unexpected:
                raise CheckpointError(f"delta {delta_path} has unknown tensors: {unexpected[:5]}")
            self.checkpoint_id = checkpoint_id

    def _eos_ids(self, path: Path) -> tuple[int, ...]:
        from transformers import GenerationConfig

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

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Complete each prompt; batches of ``max_batch_size`` share one KV-cached decode loop.

        Raises:
            ValueError: an empty prompt.
        """
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        out: list[Generation] = []
        with self._lock:
            for i in range(0, len(prompts), self.max_batch_size):
                chunk = prompts[i:i + self.max_batch_size]
                seed = None if params.seed is None else params.seed + i
                out.extend(self._generate_batch(chunk, params, seed))
        return out

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> list[Generation]:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        model = self.model
        bsz, width = len(prompts), max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self._eos[0]
        input_ids = torch.full((bsz, width), pad, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, mask, positions = input_ids.to(self.device), mask.to(self.device), positions.to(self.device)
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        stop = torch.tensor(sorted(set(self._eos) | set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        routers = self._routers

        cache = DynamicCache(config=model.config)
        routers.start_step(bsz)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1, :]
        next_pos = positions[:, -1] + 1
        tokens_out: list[list[int]] = [[] for _ in range(bsz)]
        logps_out: list[list[float]] = [[] for _ in range(bsz)]
        experts_out: list[list] = [[] for _ in range(bsz)]
        finish = [""] * bsz
        latency = [0.0] * bsz
        done = torch.zeros(bsz, dtype=torch.bool)
        for step in range(params.max_tokens):
            tok, logp = sample_next(logits, params, generator)
            step_experts = routers.step_experts().tolist() if routers.active else None
            tok_l, logp_l, is_stop = tok.tolist(), logp.tolist(), torch.isin(tok, stop).tolist()
            now = time.perf_counter() - t0
            for row in range(bsz):
                if done[row]:
                    continue
                tokens_out[row].append(tok_l[row])
                logps_out[row].append(logp_l[row])
                if step_experts is not None:
                    experts_out[row].append(step_experts[row])
                if is_stop[row] or step + 1 == params.max_tokens:
                    done[row] = True
                    finish[row] = "stop" if is_stop[row] else "length"
                    latency[row] = now
            if bool(done.all()):
                routers.start_step(0)
                break
            mask = torch.cat([mask, torch.ones((bsz, 1), dtype=torch.long, device=self.device)], dim=1)
            routers.start_step(bsz)
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1, :]
            next_pos = next_pos + 1
        return [Generation(token_ids=tokens_out[r], logprobs=logps_out[r], finish_reason=finish[r],
                           latency_s=latency[r], routed_experts=experts_out[r] if routers.active else None)
                for r in range(bsz)]


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``[len(completion)]`` of ``completion`` after ``prompt`` in one unpadded forward pass.

    The reference the engine's behaviour log-probs are tested against (and what a trainer
    computes): ``log_softmax(logits / T)`` at each completion position (T=1 for greedy).
    """
    ids = torch.tensor([prompt + completion], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1, :].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
