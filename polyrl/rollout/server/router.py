"""Client-side routing over rollout replicas: least-in-flight, sticky sessions, failover.

- Load: a new request goes to the healthy replica with the fewest requests in flight (ties: the
  one that has served fewest), so a slow replica naturally gets less work.
- Stickiness: requests sharing a session id (or, without one, a request id) go to the replica that
  served the first of them while it is healthy, so a multi-turn conversation reuses that
  replica's state.
- Failover: a replica that dies, refuses connections or misses its deadline is marked unhealthy
  and the request is retried on another replica; `metrics()` reports it. `check_health()` probes
  every replica and brings recovered ones back.

Every wait has a deadline (`timeout_s`); when no healthy replica is left the error lists each
replica with the reason it was dropped — never a silent hang.

    router = Router([start_rollout_server(path) for _ in range(2)])
    outs = await router.generate(prompt_ids, {"n": 4, "max_tokens": 64}, session_id="conv-7")
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from polyrl.rollout.base import SamplingParams, TokenOutput
from polyrl.rollout.server.replicas import Replica, ReplicaDown, as_replica

logger = logging.getLogger(__name__)


class NoHealthyReplica(RuntimeError):
    """Every replica is unhealthy (or was already tried for this request)."""


@dataclass(eq=False)
class _Slot:
    replica: Replica
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    last_error: str | None = None


class Router:
    """Args:
        replicas: Ray server actor handles, HTTP base URLs, or `Replica` objects.
        timeout_s: deadline of one attempt of one request on one replica.
        max_retries: extra attempts after a replica failure (default: one per other replica).
        sticky_capacity: most session ids remembered (least recently used are forgotten).
    """

    def __init__(self, replicas: Sequence[Any], *, timeout_s: float = 600.0,
                 max_retries: int | None = None, sticky_capacity: int = 100_000):
        if not replicas:
            raise ValueError("Router needs at least one replica")
        self._slots = [_Slot(as_replica(r)) for r in replicas]
        names = [s.replica.name for s in self._slots]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names}")
        self.timeout_s = timeout_s
        self.max_retries = len(self._slots) - 1 if max_retries is None else max_retries
        self._sticky: OrderedDict[str, _Slot] = OrderedDict()
        self._sticky_capacity = sticky_capacity
        self._retries = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any] | None = None,
                       request_id: str | None = None, *, session_id: str | None = None) -> list[TokenOutput]:
        """`sampling.n` outputs for one prompt, from whichever replica serves it."""
        if isinstance(sampling, SamplingParams):
            sampling = dataclasses.asdict(sampling)
        sampling = dict(sampling or {})
        request_id = request_id or uuid.uuid4().hex
        key = session_id or request_id
        tried: set[int] = set()
        for attempt in range(self.max_retries + 1):
            slot = self._pick(key, tried)
            if attempt:
                self._retries += 1
            slot.in_flight += 1
            slot.requests += 1
            try:
                return await slot.replica.generate(prompt_ids, sampling, request_id, self.timeout_s)
            except ReplicaDown as exc:
                self._mark_unhealthy(slot, str(exc))
                tried.add(id(slot))
            finally:
                slot.in_flight -= 1
        raise NoHealthyReplica(f"request {request_id}: gave up after {self.max_retries + 1} attempts; "
                               f"{self._describe_unhealthy()}")

    def _pick(self, key: str, tried: set[int]) -> _Slot:
        sticky = self._sticky.get(key)
        if sticky is not None and sticky.healthy and id(sticky) not in tried:
            self._sticky.move_to_end(key)
            return sticky
        candidates = [s for s in self._slots if s.healthy and id(s) not in tried]
        if not candidates:
            raise NoHealthyReplica(f"no healthy replica left; {self._describe_unhealthy()}")
        slot = min(candidates, key=lambda s: (s.in_flight, s.requests))
        self._sticky[key] = slot
        self._sticky.move_to_end(key)
        while len(self._sticky) > self._sticky_capacity:
            self._sticky.popitem(last=False)
        return slot

    def _mark_unhealthy(self, slot: _Slot, reason: str) -> None:
        if slot.healthy:
            logger.warning("rollout replica %s marked unhealthy: %s", slot.replica.name, reason)
        slot.healthy, slot.last_error = False, reason
        slot.failures += 1

    def _describe_unhealthy(self) -> str:
        down = [f"{s.replica.name} ({s.last_error})" for s in self._slots if not s.healthy]
        return "unhealthy: " + ("; ".join(down) if down else "none")

    async def check_health(self, timeout_s: float = 10.0) -> dict[str, bool]:
        """Probe every replica (in turn, each with a deadline); recovered ones serve again."""
        for slot in self._slots:
            try:
                status = await slot.replica.health(timeout_s)
                ok = bool(status.get("ok", True))
                slot.healthy, slot.last_error = ok, None if ok else f"health says {status}"
            except ReplicaDown as exc:
                self._mark_unhealthy(slot, str(exc))
        return {s.replica.name: s.healthy for s in self._slots}

    def metrics(self) -> dict:
        """Requests per replica, retries, unhealthy replicas, requests in flight."""
        return {
            "replicas": {s.replica.name: {"healthy": s.healthy, "requests": s.requests,
                                          "in_flight": s.in_flight, "failures": s.failures,
                                          "last_error": s.last_error} for s in self._slots},
            "requests": sum(s.requests for s in self._slots) - self._retries,
            "retries": self._retries,
            "unhealthy": [s.replica.name for s in self._slots if not s.healthy],
            "in_flight": sum(s.in_flight for s in self._slots),
        }
