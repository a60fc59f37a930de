"""Test helpers for the trainer: tiny policies, behaviour log-probs, and trajectory rows.

Used by the trainer's unit and integration tests and benches; not imported by the service.
Trajectories are written straight into ``trajectory`` / ``trajectory_segment`` / ``reward_label``
the way the consumers project them (token arrays packed with ``producers.events.packing``).
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import uuid
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig

from app.checkpoints.testing import build_tiny_model, tiny_config, write_model_folder
from app.models import RewardLabel, Trajectory, TrajectorySegment
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint
from producers.events.packing import pack_floats, pack_ints
from trainer.data import Segment, TrajectoryData
from trainer.distributed import DataParallel
from trainer.sharding import init_sharded
from trainer.training import train_policy


def tiny_policy(seed: int = 0, vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2):
    """A tiny random ``LlamaForCausalLM`` (fp32, tied embeddings) built in memory."""
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model


def tiny_policy_dir(directory: Path, seed: int = 0) -> Path:
    """A tiny random Llama HF folder with the SmolLM2 tokenizer (``app.checkpoints.testing.build_tiny_model``)."""
    return build_tiny_model(directory, seed=seed)


def build_tiny_moe(
    directory: Path,
    *,
    seed: int = 0,
    experts: int = 8,
    top_k: int = 2,
    num_layers: int = 4,
    hidden_size: int = 64,
    kind: str = "mixtral",
    initializer_range: float = 0.2,
) -> Path:
    """Write a tiny random MoE causal LM (SmolLM2 tokenizer) as a Hugging Face folder, fp32.

    ``kind``: ``mixtral`` (``MixtralConfig``: top-k renormalised) or ``qwen2_moe`` (``Qwen2MoeConfig``
    with a shared expert, ``norm_topk_prob`` false); ``initializer_range``: std of the random init.
    Same seed and arguments -> identical weights.
    """
    config = tiny_config(moe=True, hidden_size=hidden_size, num_layers=num_layers, initializer_range=initializer_range)
    if kind == "qwen2_moe":
        config = Qwen2MoeConfig(
            **{
                k: v
                for k, v in config.to_dict().items()
                if k in Qwen2MoeConfig().to_dict() and k not in ("model_type", "architectures")
            },
            num_experts=experts,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            norm_topk_prob=False,
        )
    elif kind == "mixtral":
        config.num_local_experts = experts
    else:
        raise ValueError(f"unknown MoE kind {kind!r} (mixtral | qwen2_moe)")
    config.num_experts_per_tok = top_k
    return write_model_folder(directory, config, seed)


@torch.no_grad()
def sequence_logprobs(model, token_ids: list[int], temperature: float = 1.0) -> np.ndarray:
    """``[T]`` float32 log-probs of each token given its prefix under ``model`` (0 for token 0)."""
    ids = torch.tensor([token_ids])
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
    return np.concatenate([[0.0], lp.numpy()]).astype(np.float32)


def make_segment(prompt: list[int], completion: list[int], behaviour: np.ndarray | None = None) -> Segment:
    """A one-turn segment: ``prompt + completion`` with the loss mask on the completion.

    ``behaviour`` is the ``[T]`` log-prob array of the whole sequence (only completion positions
    are kept); zeros when omitted.
    """
    ids = np.asarray(prompt + completion, dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(prompt) :] = 1
    lp = np.zeros(len(ids), dtype=np.float32) if behaviour is None else np.asarray(behaviour, dtype=np.float32).copy()
    lp[mask == 0] = 0.0
    return Segment(ids, mask, lp)


def make_trajectory(segments: list[Segment], reward: float, task_id: str | None = "task-0") -> TrajectoryData:
    """An in-memory :class:`TrajectoryData` (no database)."""
    tid = uuid.uuid4()
    return TrajectoryData(
        id=tid,
        session_id=f"s-{tid.hex[:8]}",
        user_id="u",
        task_id=task_id,
        reward=reward,
        group=task_id or f"session:{tid}",
        finalized_at=datetime.now(UTC),
        segments=segments,
        event_ids=[],
        offsets={},
        max_event_seq=None,
        serving_checkpoints=["base"],
    )


# One task group of two outcomes: a completion the reward favours and one it does not.
PROMPT = [1, 40, 41, 42, 43]
GOOD = [100, 101, 102, 103, 2]  # reward 1
BAD = [200, 201, 202, 203, 2]  # reward 0


def good_bad_trajectories(model, copies: int = 2) -> list[TrajectoryData]:
    """``copies`` x (``PROMPT + GOOD`` at reward 1, ``PROMPT + BAD`` at reward 0), one task group
    ``"t"``, behaviour log-probs scored by ``model`` at temperature 1 (on-policy for it)."""
    out = []
    for _ in range(copies):
        for completion, reward in ((GOOD, 1.0), (BAD, 0.0)):
            mu = sequence_logprobs(model, PROMPT + completion)
            out.append(make_trajectory([make_segment(PROMPT, completion, mu)], reward, task_id="t"))
    return out


def insert_trajectory(
    session,
    *,
    segments: list[Segment],
    reward: float | None,
    task_id: str | None = "task-0",
    checkpoint_id: str = "base",
    spec: str = "implicit@4",
    user_id: str = "user-1",
    finalized_at: datetime | None = None,
    last_event_at: datetime | None = None,
    status: str = "finalized",
    reserved_for_eval: bool = False,
    max_event_seq: int | None = None,
) -> uuid.UUID:
    """Insert a trajectory, its segments and (unless ``reward`` is None) its reward label; flush.

    Returns:
        The trajectory id.
    """
    now = datetime.now(UTC)
    finalized_at = finalized_at or now - timedelta(minutes=10)
    tid = uuid.uuid4()
    event_ids = [uuid.uuid4() for _ in segments]
    session.add(
        Trajectory(
            id=tid,
            session_id=f"sess-{tid.hex[:12]}",
            user_id=user_id,
            org_id="org",
            task_id=task_id,
            task_source="test",
            checkpoint_id=checkpoint_id,
            status=status,
            started_at=finalized_at - timedelta(minutes=5),
            ended_at=finalized_at - timedelta(minutes=1),
            last_event_at=last_event_at or finalized_at - timedelta(minutes=1),
            finalized_at=finalized_at if status == "finalized" else None,
            num_segments=len(segments),
            num_turns=len(segments),
            completion_tokens=int(sum(int(s.loss_mask.sum()) for s in segments)),
            ran_tests=False,
            test_commands=[],
            expected_signals=[],
            signals={},
            event_ids=event_ids,
            max_event_seq=max_event_seq,
            reserved_for_eval=reserved_for_eval,
        )
    )
    session.flush()
    for i, seg in enumerate(segments):
        session.add(
            TrajectorySegment(
                trajectory_id=tid,
                segment_index=i,
                checkpoint_id=checkpoint_id,
                token_ids=pack_ints(seg.token_ids),
                loss_mask=seg.loss_mask.astype(np.uint8).tobytes(),
                behaviour_logprobs=pack_floats(seg.behaviour_logprobs),
                num_tokens=len(seg.token_ids),
                num_completion_tokens=int(seg.loss_mask.sum()),
                num_turns=1,
                tool_calls=[],
                tool_results=[],
                event_ids=[event_ids[i]],
                min_offset={"editor.interactions:0": 10 * i},
                max_offset={"editor.interactions:0": 10 * i + 5},
            )
        )
    if reward is not None:
        session.add(RewardLabel(trajectory_id=tid, spec=spec, reward=reward, components={"test": reward}))
    session.flush()
    return tid


def register_checkpoint_dir(
    session,
    store,
    src: Path,
    checkpoint_id: str = "base",
    *,
    status: CheckpointStatus = CheckpointStatus.PRODUCTION,
    generation: int = 0,
    parent_id: str | None = None,
) -> Path:
    """Publish a HF folder into ``store`` as ``checkpoint_id`` and insert its row; flush.

    Returns:
        The STABLE directory.
    """
    with store.writer(checkpoint_id) as staging:
        for f in Path(src).iterdir():
            if f.is_file():
                shutil.copy2(f, staging / f.name)
        (staging / "manifest.json").write_text(
            json.dumps({"checkpoint_id": checkpoint_id, "kind": "base", "parent_id": parent_id})
        )
    path = store.stable_path(checkpoint_id)
    add_checkpoint(
        session,
        checkpoint_id=checkpoint_id,
        path=str(path),
        status=status,
        parent_id=parent_id,
        generation=generation,
        manifest=store.manifest(checkpoint_id),
    )
    return path


def train_on_ranks(model_dir: Path, trajectories: list[TrajectoryData], config, world_size: int, workdir: Path) -> dict:
    """Run :func:`trainer.training.train_policy` on ``world_size`` local gloo ranks (spawned processes,
    ``file://`` rendezvous in ``workdir``), or in this process without a process group for 1.

    Returns:
        Rank 0's ``{"history": [StepMetrics dicts], "mismatch": {...}, "state": fp32 state dict (CPU)}``;
        with several ranks also ``"published"`` (rank 0's model saved there as safetensors),
        ``"tied"`` (its LM head is its input embedding) and ``"ranks"``: per rank, ``{"reductions": [(fp32 elements, inside a
        backward pass) of each fp32 all_reduce], "flushes": steps whose finish_step all-reduced,
        "start_rss_bytes": the rank's RSS before loading the model, "peak_rss_bytes": its peak RSS
        from then on}``
        (DDP; ``config.parallel.mode = "fsdp"`` trains sharded, :mod:`trainer.sharding`).
    """
    if world_size == 1:
        trained = train_policy(config, Path(model_dir), trajectories)
        assert trained.model is not None  # one process: rank 0
        return {
            "history": [asdict(m) for m in trained.history],
            "mismatch": trained.mismatch,
            "state": {k: v.detach().cpu().clone() for k, v in trained.model.state_dict().items()},
        }
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rendezvous = workdir / "rendezvous"
    rendezvous.unlink(missing_ok=True)
    start_processes(
        _train_rank,
        args=(world_size, str(rendezvous), str(model_dir), trajectories, config, str(workdir)),
        nprocs=world_size,
        start_method="spawn",
    )
    result = torch.load(workdir / "rank0.pt", weights_only=False)
    result["ranks"] = [torch.load(workdir / f"rank{r}.pt", weights_only=False)["record"] for r in range(world_size)]
    result["published"] = workdir / "published"
    return result


def train_sharded_in_process(model_dir: Path, trajectories: list[TrajectoryData], config, workdir: Path) -> dict:
    """Run :func:`trainer.training.train_policy` sharded (FSDP2, :mod:`trainer.sharding`) on one rank
    in this process: a process group of world size 1 (NCCL when ``config.device`` is CUDA, else gloo;
    ``file://`` rendezvous in ``workdir``), destroyed before returning. On a single GPU this is the
    sharded code path end to end (mesh, ``fully_shard``, mixed precision, CPU offload, the gathered
    state dict) that several ranks run.

    Returns:
        ``{"history": [StepMetrics dicts], "mismatch": {...}, "state": fp32 state dict (CPU),
        "tied": the gathered model's LM head is its input embedding, "peak_cuda_bytes": the CUDA
        allocator's peak during training (0 on the CPU)}``.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rendezvous = workdir / "rendezvous"
    rendezvous.unlink(missing_ok=True)
    device = torch.device(config.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        trained = train_policy(config, Path(model_dir), trajectories, dp=init_sharded(device, config.parallel))
        model = trained.model
        assert model is not None  # rank 0
        return {
            "history": [asdict(m) for m in trained.history],
            "mismatch": trained.mismatch,
            "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,  # type: ignore[operator]  # a transformers/peft method (torch: Tensor | Module)
            "peak_cuda_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        }
    finally:
        dist.destroy_process_group()


def _reset_peak_rss() -> None:
    """Reset this process's peak RSS (``VmHWM``; Linux ``/proc/self/clear_refs``, no-op elsewhere)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    """This process's peak RSS in bytes since :func:`_reset_peak_rss` (``VmHWM``), else ``ru_maxrss``."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _train_rank(
    rank: int, world_size: int, rendezvous: str, model_dir: str, trajectories, config, workdir: str
) -> None:
    torch.set_num_threads(1)
    _reset_peak_rss()  # the spawn's own start-up (imports, unpickling the arguments) is not training
    record: dict[str, Any] = {"reductions": [], "flushes": [], "start_rss_bytes": psutil.Process().memory_info().rss}
    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):  # the gradients are fp32, the metric sums fp64
        if tensor.dtype == torch.float32:
            record["reductions"].append((tensor.numel(), torch._C._current_graph_task_id() != -1))
        return all_reduce(tensor, *args, **kwargs)

    class RecordingDataParallel(DataParallel):
        def finish_step(self) -> None:
            before = self.reduced_buckets
            super().finish_step()
            record["flushes"].append(self.reduced_buckets > before)

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    dist.all_reduce = recording_all_reduce  # this spawned process's own module
    sharded = config.parallel.mode == "fsdp"
    dp = init_sharded(torch.device("cpu"), config.parallel) if sharded else RecordingDataParallel(rank, world_size)
    try:
        trained = train_policy(config, Path(model_dir), trajectories, dp=dp)
        record["peak_rss_bytes"] = _peak_rss()
        out: dict[str, Any] = {"record": record}
        if rank == 0:
            assert trained.model is not None
            out |= {
                "history": [asdict(m) for m in trained.history],
                "mismatch": trained.mismatch,
                "state": {k: v.detach().cpu().clone() for k, v in trained.model.state_dict().items()},
                "tied": trained.model.get_output_embeddings().weight is trained.model.get_input_embeddings().weight,  # type: ignore[operator]  # a transformers/peft method (torch: Tensor | Module)
            }
            trained.model.save_pretrained(Path(workdir) / "published", safe_serialization=True)  # type: ignore[operator]  # a transformers/peft method (torch: Tensor | Module)
        torch.save(out, Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
