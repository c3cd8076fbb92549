"""Pushing a new policy into a GPU engine a piece at a time, and across the ranks of a replica.

`iter_flushes` cuts a stream of named tensors into consecutive pieces within a byte budget (one
vLLM `load_weights` bucket, one SGLang tensor batch, one TRT-LLM IPC-handle flush). A tensor
bigger than the budget travels alone rather than failing.

`push_to_replica` is the TRT-LLM path of verl PR 5701, without its hard-coded rank 0 (R5): each
rank of a replica turns its next piece into a payload (its device id -> serialized IPC handles),
the payloads are gathered to the replica's leader (the group's local rank 0 as a global rank),
the leader hands them to the engine, and tells every rank whether another round follows. Ranks
may hold different amounts of weights: a rank that has run out sends an empty payload until all
have. Whether the engine accepts pieces at all (partial loading) is asked by the leader, only for
vision-language models, and broadcast to the replica (`negotiate_partial_loading`); without it the
whole state goes in one piece. A rank keeps its piece's tensors alive until the leader has
applied the round, so IPC handles never outlive their memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from polyrl.distributed.collectives import (
    DEFAULT_TIMEOUT_S,
    broadcast_from_leader,
    gather_to_leader,
    is_vision_language,
    negotiate_partial_loading,
)
from polyrl.distributed.layout import group_leader
from polyrl.rollout.base import WeightUpdateError

Named = tuple[str, torch.Tensor]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_flushes(named: Iterable[Named], budget_bytes: int | None) -> Iterator[list[Named]]:
    """Consecutive pieces of `named` whose bytes stay within `budget_bytes` (None: one piece).

    Streams: a piece is yielded as soon as the next tensor would overflow it, so a lazy source
    (an FP8 quantizer) is never materialised whole."""
    if budget_bytes is not None and budget_bytes < 1:
        raise ValueError(f"flush budget must be >= 1 byte, got {budget_bytes}")
    piece: list[Named] = []
    used = 0
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"parameter '{name}': expected a tensor, got {type(tensor).__name__}")
        size = tensor_nbytes(tensor)
        if piece and budget_bytes is not None and used + size > budget_bytes:
            yield piece
            piece, used = [], 0
        piece.append((name, tensor))
        used += size
    if piece:
        yield piece


def merge_device_payloads(payloads: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """One {device id: handles} dict from every rank's; two ranks claiming one device is a
    visibility misconfiguration (both would write the same GPU), so it raises."""
    merged: dict[str, Any] = {}
    for rank, payload in enumerate(payloads):
        for device, handles in (payload or {}).items():
            if device in merged:
                raise WeightUpdateError(f"two ranks of the replica sent weights for device {device} "
                                        f"(the second is group rank {rank}); check the devices each "
                                        "rank sees (CUDA/HIP_VISIBLE_DEVICES)")
            merged[device] = handles
    return merged



def read_hf_config(model_path: str) -> dict | None:
    """The model's config.json (None when absent): decides the partial-loading negotiation."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None

@dataclass
class PushResult:
    rounds: int
    """Pieces the leader handed to its engine (0 on other ranks)."""
    tensors: int
    """Tensors this rank sent."""
    bytes: int
    """Bytes this rank sent."""
    partial: bool
    """Whether the engine took the weights in pieces."""


def push_to_replica(
    named: Iterable[Named],
    *,
    make_payload: Callable[[list[Named]], dict[str, Any]],
    apply: Callable[[dict[str, Any]], None] | None,
    finish: Callable[[], None] | None,
    budget_bytes: int,
    group: Any = None,
    hf_config: Any = None,
    engine: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PushResult:
    """Send this rank's weights into its replica's engine (collective over `group`).

    `make_payload(piece)` -> {device id: serialized handles}; `apply(merged)` and `finish()` run
    on the leader only (pass None elsewhere). `engine` answers `supports_partial_loading()` on the
    leader. `group=None` means a replica of one process: no collectives."""
    leader = group is None or dist.get_rank() == group_leader(group)
    if leader and (apply is None or finish is None):
        raise ValueError("the replica leader needs apply and finish")
    if group is None:
        partial = (not is_vision_language(hf_config)) or _ask(engine)
    else:
        partial = negotiate_partial_loading(engine, hf_config, group, timeout_s=timeout_s)
    pieces = iter_flushes(named, budget_bytes if partial else None)
    rounds = tensors = nbytes = 0
    more = True
    while more:
        piece = next(pieces, None)
        payload = make_payload(piece) if piece else {}
        if piece:
            tensors += len(piece)
            nbytes += sum(tensor_nbytes(t) for _, t in piece)
        if group is None:
            gathered, mine_done = [payload], piece is None
        else:
            gathered = gather_to_leader((payload, piece is None), group, timeout_s=timeout_s,
                                        phase="gather weight handles to the replica leader")
            mine_done = None
        if leader:
            if group is not None:
                mine_done = all(done for _, done in gathered)
                gathered = [p for p, _ in gathered]
            merged = merge_device_payloads(gathered)
            if merged:
                apply(merged)  # type: ignore[misc]
                rounds += 1
        if group is not None:
            mine_done = broadcast_from_leader(mine_done, group, timeout_s=timeout_s,
                                              phase="weight flush round")
        more = not mine_done
        del piece, payload  # the leader has applied this round: the handles may go
    if leader:
        finish()  # type: ignore[misc]
    return PushResult(rounds=rounds, tensors=tensors, bytes=nbytes, partial=partial)


def _ask(engine: Any) -> bool:
    ask = getattr(engine, "supports_partial_loading", None)
    return bool(ask()) if ask is not None else False


def push_shares(named: Iterable[Named], version: int, *, engine: Any, group: Any, share: tuple[int, int],
                hf_config: Any, budget_bytes: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> PushResult:
    """The replica-leader path for engines that load whole named tensors in one process (the
    built-in engine, vLLM, SGLang): rank `share = (i, k)` of the replica sends every k-th tensor
    from the i-th, so the leader's engine gets each tensor exactly once, in pieces of
    `budget_bytes` (or one piece for a vision-language model whose engine cannot load in parts),
    and applies them in one all-or-nothing `update_weights(..., version)` after the last round.
    `engine` is the leader's engine (None elsewhere). Tensors cross the group as host copies of
    their own (a view into a shared staging segment would pickle the whole segment)."""
    index, size = share
    mine = (item for i, item in enumerate(named) if i % size == index)
    arrived: list[Named] = []

    def payload(piece: list[Named]) -> dict[str, Any]:
        return {f"replica rank {index}": [(n, t.detach().to("cpu").clone()) for n, t in piece]}

    def collect(merged: dict[str, Any]) -> None:
        for handles in merged.values():
            arrived.extend(handles)

    leader = engine is not None
    result = push_to_replica(mine, make_payload=payload, apply=collect if leader else None,
                             finish=(lambda: engine.update_weights(arrived, version)) if leader else None,
                             budget_bytes=budget_bytes, group=group, hf_config=hf_config,
                             engine=engine, timeout_s=timeout_s)
    return result
