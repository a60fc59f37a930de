"""Packing a cycle's trajectories into padded micro-batches of trainable tokens.

Invariant: a micro-batch holds at most ``micro_batch_tokens`` padded tokens (rows x longest row;
a single longer row gets a micro-batch of its own), and every token the model sampled (loss mask 1,
not the first token of a row) appears in exactly one micro-batch with its behaviour log-prob and its
trajectory's advantage. Each segment is one row: segments of a trajectory share its advantage.
A row's MoE routes sit at the input position whose output sampled each token (one to its left).

Shared prefixes (``share_prefixes``): the sessions of one task group start from the same prompt
(the simulator and the product send a group's request unchanged; 50 % of a real cycle's tokens were
a group's common prefix). Rows are then packed group by group, and each micro-batch holds every
distinct prefix once, concatenated without padding (``prefix_ids``), and each row's remaining
tokens (``input_ids``): :func:`trainer.step.token_logprobs` runs the decoder over the prefixes
(each attending only to itself), gathers each row's prefix keys and values, and runs the suffixes
on them, so a prefix's tokens are computed (and back-propagated) once however many rows continue it. The budget still counts every row's full
length, so a cycle has about as many micro-batches and optimizer steps with sharing as without. A
prefix ends before the position that predicts any of its rows' first sampled token, so every
trainable token's hidden state comes from the suffix pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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
        prefix_ids: shared-prefix layout only, ``[1, Np]`` int64, the micro-batch's distinct prefixes
            one after another; ``input_ids`` then holds each row's tokens after its prefix, and
            ``hidden_index`` indexes those suffix positions. None: every row is whole.
        prefix_positions: ``[1, Np]`` int64, each prefix token's position in its own prefix (0 starts one).
        prefix_gather: ``[B, Lp]`` int64, where in ``prefix_ids`` row ``b``'s prefix token ``j`` sits
            (0 past the row's prefix).
        prefix_mask: ``[B, Lp]`` int64, 1 on each row's real prefix tokens.
        prefix_lengths: ``[B]`` int64, real tokens of each row's prefix (its suffix's first position).
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
    prefix_ids: torch.Tensor | None = None
    prefix_positions: torch.Tensor | None = None
    prefix_gather: torch.Tensor | None = None
    prefix_mask: torch.Tensor | None = None
    prefix_lengths: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens of the micro-batch's rows, a shared prefix counted in every row
        that continues it (the tokens the rows hold, with or without sharing)."""
        if self.prefix_lengths is None:
            return int(self.attention_mask.sum())
        return int(self.attention_mask.sum() + self.prefix_lengths.sum())

    @property
    def computed_tokens(self) -> int:
        """Real tokens the forward pass computes: a shared prefix once."""
        shared = 0 if self.prefix_ids is None else self.prefix_ids.shape[1]
        return int(self.attention_mask.sum()) + shared

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
    share_prefixes: bool = False,
) -> list[MicroBatch]:
    """Pack every segment of ``trajectories`` into micro-batches (longest first, then shuffled).

    Args:
        trajectories: the cycle's used trajectories.
        advantages: ``[G]`` float, one per trajectory (shared by all its tokens).
        micro_batch_tokens: padded-token budget per micro-batch (rows x longest row).
        pad_id: token id used for padding (masked out by the attention mask).
        seed: order of the micro-batches.
        share_prefixes: pack task groups together and compute each group's common prefix once
            (module doc); a cycle with MoE routes is packed whole.

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
    if share_prefixes and not any(seg.routed_experts is not None for _, seg in rows):
        shared = _pack_shared(rows, trajectories, advantages, micro_batch_tokens, pad_id)
        order = np.random.default_rng(seed).permutation(len(shared))
        return [shared[i] for i in order]
    rows.sort(key=lambda r: -len(r[1].token_ids))
    batches: list[MicroBatch] = []
    current: list[Any] = []
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


def _collate(rows, advantages: torch.Tensor, pad_id: int, offsets: list[int] | None = None) -> MicroBatch:
    """A micro-batch of ``rows`` (``(trajectory index, segment)``), each from token ``offsets[r]``
    on (0: the whole row; the shared-prefix layout passes each row's prefix length)."""
    offsets = offsets or [0] * len(rows)
    width = max(len(seg.token_ids) - o for (_, seg), o in zip(rows, offsets))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    attention = torch.zeros((len(rows), width), dtype=torch.int64)
    hidden_index, targets, behaviour, adv, traj = [], [], [], [], []
    for r, ((i, seg), o) in enumerate(zip(rows, offsets)):
        n = len(seg.token_ids) - o
        input_ids[r, :n] = torch.from_numpy(seg.token_ids[o:].astype(np.int64))
        attention[r, :n] = 1
        pos = np.flatnonzero(seg.loss_mask[1:]) + 1  # target positions; position 0 has no context
        hidden_index.append(torch.from_numpy(r * width + pos - 1 - o))  # all past the offset
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


MIN_SHARED_PREFIX = 16
"""A group's common prefix shorter than this (tokens) is not shared: its rows keep their own."""


def _first_target(seg) -> int:
    """Position of a row's first trainable token (>= 1)."""
    return int(np.flatnonzero(seg.loss_mask[1:])[0]) + 1


def shared_prefix_length(segments: list) -> int:
    """Tokens the rows of one group can share: their common leading tokens, ending at least one
    position before any row's first trainable token (that position's hidden state predicts it and
    must come from the row's own suffix pass). 0 for a group of one row."""
    if len(segments) < 2:
        return 0
    limit = min(_first_target(seg) - 1 for seg in segments)
    first = segments[0].token_ids[:limit]
    for seg in segments[1:]:
        differ = np.flatnonzero(seg.token_ids[:limit] != first[:limit])
        if differ.size:
            limit = int(differ[0])
    return limit


def _pack_shared(rows, trajectories, advantages, budget: int, pad_id: int) -> list[MicroBatch]:
    """Micro-batches of whole groups (longest suffix first) in the shared-prefix layout."""
    by_group: dict[str, list] = {}
    for row in rows:
        by_group.setdefault(trajectories[row[0]].group, []).append(row)
    units = []  # (prefix length, rows) per group; a short common prefix: each row its own prompt
    for members in by_group.values():
        members.sort(key=lambda r: -len(r[1].token_ids))
        shared = shared_prefix_length([seg for _, seg in members])
        if shared >= MIN_SHARED_PREFIX:
            units.append((shared, members))
        else:
            units += [(_first_target(seg) - 1, [(i, seg)]) for i, seg in members]
    units.sort(key=lambda u: u[0] - len(u[1][0][1].token_ids))  # longest suffix first: less padding
    batches: list[MicroBatch] = []
    current: list[Any] = []  # (unit number, prefix length, row)
    longest = 0
    for u, (shared, members) in enumerate(units):
        for row in members:
            width = max(longest, len(row[1].token_ids))
            if current and (len(current) + 1) * width > budget:
                batches.append(_collate_shared(current, advantages, pad_id))
                current, width = [], len(row[1].token_ids)
            current.append((u, shared, row))
            longest = width
    if current:
        batches.append(_collate_shared(current, advantages, pad_id))
    return batches


def _collate_shared(entries, advantages: torch.Tensor, pad_id: int) -> MicroBatch:
    rows, offsets = [row for _, _, row in entries], [shared for _, shared, _ in entries]
    if not any(offsets):  # rows sampled from their second token on: nothing to share
        return _collate(rows, advantages, pad_id)
    prefixes = {u: seg.token_ids[:shared] for u, shared, (_, seg) in entries}  # first-seen order
    starts = dict(zip(prefixes, np.cumsum([0] + [len(p) for p in prefixes.values()])[:-1].tolist()))
    prefix_width = max(len(p) for p in prefixes.values())
    prefix_gather = torch.zeros((len(entries), prefix_width), dtype=torch.int64)
    prefix_mask = torch.zeros((len(entries), prefix_width), dtype=torch.int64)
    for r, (u, shared, _) in enumerate(entries):
        prefix_gather[r, :shared] = torch.arange(starts[u], starts[u] + shared)
        prefix_mask[r, :shared] = 1
    return dataclasses.replace(
        _collate(rows, advantages, pad_id, offsets),
        prefix_ids=torch.from_numpy(np.concatenate(list(prefixes.values())).astype(np.int64))[None],
        prefix_positions=torch.cat([torch.arange(len(p)) for p in prefixes.values()])[None],
        prefix_gather=prefix_gather,
        prefix_mask=prefix_mask,
        prefix_lengths=torch.tensor(offsets, dtype=torch.int64),
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
