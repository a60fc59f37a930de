"""Packing a cycle's trajectories into padded micro-batches of trainable tokens.

Invariant: a micro-batch holds at most ``micro_batch_tokens`` padded tokens (rows x longest row;
a single longer row gets a micro-batch of its own), and every token the model sampled (loss mask 1,
not the first token of a row) appears in exactly one micro-batch with its behaviour log-prob and its
trajectory's advantage. Each segment is one row: segments of a trajectory share its advantage.
A row's MoE routes sit at the input position whose output sampled each token (one to its left).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.data import TrajectoryData


@dataclass
class MicroBatch:
    """Padded rows plus the flat list of trainable target tokens.

    Attributes:
        input_ids: ``[B, T]`` int64, right-padded with ``pad_id``.
        attention_mask: ``[B, T]`` int64, 1 on real tokens.
        hidden_index: ``[N]`` int64 flat index ``row * T + t`` of the hidden state that predicts
            each trainable token (the token itself sits at ``t + 1``).
        targets: ``[N]`` int64 trainable token ids.
        behaviour_logprobs: ``[N]`` float32, log mu recorded at serving time (nats).
        advantages: ``[N]`` float32, the token's trajectory advantage.
        trajectory_index: ``[N]`` int64 index of the token's trajectory in the cycle's ``used`` list.
        old_logprobs: ``[N]`` float32 log pi_old (policy at cycle start), filled before training.
        routes: MoE only, ``[B, T, layers, top_k]`` int64 serving experts to replay at each input
            position (position ``t`` carries the routes recorded for token ``t + 1``, the token its
            output sampled), -1 elsewhere; None when no row has routes
            (``trainer.router_replay.replay_routes`` takes it).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden_index: torch.Tensor
    targets: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    trajectory_index: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    routes: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in the micro-batch."""
        return int(self.attention_mask.sum())

    @property
    def num_trainable(self) -> int:
        """Trainable target tokens ``N``."""
        return int(self.targets.numel())


def group_ids(trajectories: list[TrajectoryData]) -> torch.Tensor:
    """``[G]`` int64 group id per trajectory: equal task ids share a group (Dr. GRPO groups)."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(t.group, len(index)) for t in trajectories], dtype=torch.int64)


def pack_micro_batches(
    trajectories: list[TrajectoryData],
    advantages: torch.Tensor,
    *,
    micro_batch_tokens: int,
    pad_id: int = 0,
    seed: int = 0,
) -> list[MicroBatch]:
    """Pack every segment of ``trajectories`` into micro-batches (longest first, then shuffled).

    Args:
        trajectories: the cycle's used trajectories.
        advantages: ``[G]`` float, one per trajectory (shared by all its tokens).
        micro_batch_tokens: padded-token budget per micro-batch.
        pad_id: token id used for padding (masked out by the attention mask).
        seed: order of the micro-batches.

    Returns:
        Micro-batches with at least one trainable token each.

    Raises:
        ValueError: ``advantages`` does not have one entry per trajectory.
    """
    if advantages.shape != (len(trajectories),):
        raise ValueError(f"need one advantage per trajectory, got {tuple(advantages.shape)} for {len(trajectories)}")
    rows = [
        (i, seg)
        for i, t in enumerate(trajectories)
        for seg in t.segments
        if len(seg.token_ids) >= 2 and seg.loss_mask[1:].any()
    ]
    rows.sort(key=lambda r: -len(r[1].token_ids))
    batches, current = [], []
    for row in rows:
        longest = len(current[0][1].token_ids) if current else len(row[1].token_ids)
        if current and (len(current) + 1) * longest > micro_batch_tokens:
            batches.append(_collate(current, advantages, pad_id))
            current = []
        current.append(row)
    if current:
        batches.append(_collate(current, advantages, pad_id))
    order = np.random.default_rng(seed).permutation(len(batches))
    return [batches[i] for i in order]


def _collate(rows, advantages: torch.Tensor, pad_id: int) -> MicroBatch:
    width = max(len(seg.token_ids) for _, seg in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    attention = torch.zeros((len(rows), width), dtype=torch.int64)
    hidden_index, targets, behaviour, adv, traj = [], [], [], [], []
    for r, (i, seg) in enumerate(rows):
        n = len(seg.token_ids)
        input_ids[r, :n] = torch.from_numpy(seg.token_ids.astype(np.int64))
        attention[r, :n] = 1
        pos = np.flatnonzero(seg.loss_mask[1:]) + 1  # target positions; position 0 has no context
        hidden_index.append(torch.from_numpy(r * width + pos - 1))
        targets.append(torch.from_numpy(seg.token_ids[pos].astype(np.int64)))
        behaviour.append(torch.from_numpy(seg.behaviour_logprobs[pos].astype(np.float32)))
        adv.append(torch.full((len(pos),), float(advantages[i])))
        traj.append(torch.full((len(pos),), i, dtype=torch.int64))
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        hidden_index=torch.cat(hidden_index).long(),
        targets=torch.cat(targets),
        behaviour_logprobs=torch.cat(behaviour),
        advantages=torch.cat(adv).float(),
        trajectory_index=torch.cat(traj),
        routes=_collate_routes([seg for _, seg in rows], width),
    )


def _collate_routes(segments: list, width: int) -> torch.Tensor | None:
    """``[B, width, layers, top_k]`` routes shifted one position left (see :class:`MicroBatch`), or None.

    Raises:
        ValueError: two rows' routes have different ``[layers, top_k]``.
    """
    shapes = {seg.routed_experts.shape[1:] for seg in segments if seg.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"segments of one micro-batch have routes of different [layers, top_k]: {sorted(shapes)}")
    layers, k = shapes.pop()
    out = torch.full((len(segments), width, layers, k), -1, dtype=torch.int64)
    for r, seg in enumerate(segments):
        if seg.routed_experts is not None:
            n = len(seg.token_ids)
            out[r, : n - 1] = torch.from_numpy(seg.routed_experts[1:n].astype(np.int64))
    return out
