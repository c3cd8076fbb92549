"""Group collectives that always use the group's leader and always have a deadline.

Every broadcast and gather in polyrl goes through here. The source / destination is
`group_leader(group)` (the group's local rank 0 as a global rank), never a literal 0: with
several rollout replicas, global rank 0 leads only the first (R5, verl PR 5701). Each call waits
through the watchdog, so a rank that never arrives produces a `CollectiveTimeout` naming it and
its last (step, phase) instead of a hang.

Python objects travel as pickled bytes in two broadcasts (length, then payload), so they get the
same deadline as tensors (`broadcast_object_list` has no async form to wait on).
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from polyrl.distributed.layout import group_leader
from polyrl.distributed.watchdog import Watchdog, default_watchdog

DEFAULT_TIMEOUT_S = 300.0


def _dog(watchdog: Watchdog | None) -> Watchdog:
    return watchdog if watchdog is not None else default_watchdog()


def broadcast_from_leader(value: Any, group: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                          phase: str = "broadcast", watchdog: Watchdog | None = None) -> Any:
    """Broadcast `value` from the group's leader to every member; returns the leader's value.

    A tensor is broadcast in place (same shape and dtype on every rank) and returned; any other
    value is pickled on the leader (what non-leaders pass is ignored).
    """
    dog = _dog(watchdog)
    src = group_leader(group)
    if isinstance(value, torch.Tensor):
        dog.run(lambda: dist.broadcast(value, src=src, group=group, async_op=True),
                group=group, phase=phase, timeout_s=timeout_s, what="broadcast")
        return value
    is_src = dist.get_rank() == src
    payload = _to_bytes(value) if is_src else None
    watch = dog.watch(group, phase=phase, timeout_s=timeout_s, what="broadcast")
    size = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64)
    watch.wait(dist.broadcast(size, src=src, group=group, async_op=True))
    buf = payload if is_src else torch.empty(int(size.item()), dtype=torch.uint8)
    watch.wait(dist.broadcast(buf, src=src, group=group, async_op=True))
    return value if is_src else _from_bytes(buf)


def gather_to_leader(value: Any, group: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     phase: str = "gather", watchdog: Watchdog | None = None) -> list[Any] | None:
    """Gather one picklable value per member on the leader, in group-rank order; None elsewhere."""
    dog = _dog(watchdog)
    dst = group_leader(group)
    n = dist.get_world_size(group)
    payload = _to_bytes(value)
    watch = dog.watch(group, phase=phase, timeout_s=timeout_s, what="gather")
    # Sizes first (all_gather: everyone needs the max to pad), then the padded payloads.
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    watch.wait(dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64),
                               group=group, async_op=True))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    is_dst = dist.get_rank() == dst
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)] if is_dst else None
    watch.wait(dist.gather(padded, out, dst=dst, group=group, async_op=True))
    if not is_dst:
        return None
    return [_from_bytes(buf[: int(s.item())]) for buf, s in zip(out, sizes)]


# --- partial weight loading ----------------------------------------------------------------------

def is_vision_language(hf_config: Any) -> bool:
    """A vision-language model: its HF config has a `vision_config` (object attribute or key)."""
    if hf_config is None:
        return False
    if isinstance(hf_config, Mapping):
        return hf_config.get("vision_config") is not None
    return getattr(hf_config, "vision_config", None) is not None


def negotiate_partial_loading(engine: Any, hf_config: Any, group: Any, *,
                              timeout_s: float = DEFAULT_TIMEOUT_S,
                              watchdog: Watchdog | None = None) -> bool:
    """Whether the replica's engine accepts weights a bucket at a time (partial loading).

    Only vision-language models need to ask: their engines may require the whole state at once.
    For them the replica leader asks its engine (`engine.supports_partial_loading()`, or
    `engine()` when given a callable; an engine without the method answers no) and broadcasts
    the answer to its replica (`group`: the replica / exclude-DP group). Text models answer yes
    on every rank without a collective, since every rank reads the same HF config.
    """
    if not is_vision_language(hf_config):
        return True
    answer = None
    if dist.get_rank() == group_leader(group):
        answer = bool(_ask_partial(engine))
    return bool(broadcast_from_leader(answer, group, timeout_s=timeout_s,
                                      phase="negotiate partial weight loading", watchdog=watchdog))


def _ask_partial(engine: Any) -> bool:
    if callable(engine) and not hasattr(engine, "supports_partial_loading"):
        return engine()
    ask: Callable[[], bool] | None = getattr(engine, "supports_partial_loading", None)
    return bool(ask()) if ask is not None else False


def _to_bytes(value: Any) -> torch.Tensor:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _from_bytes(buf: torch.Tensor) -> Any:
    return pickle.loads(buf.numpy().tobytes())
