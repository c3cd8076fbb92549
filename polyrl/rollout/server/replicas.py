"""One rollout replica as the router sees it: a Ray server actor or an HTTP server.

Both speak the engine's token-in / token-out call and both turn "this replica cannot serve"
(actor died, connection refused, no answer within the deadline) into `ReplicaDown`, so the router
has one failure to handle. Input errors stay `RolloutInputError`: a bad request would fail on any
replica and is not retried.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, Sequence

import ray
from ray.exceptions import RayActorError

from polyrl.rollout.base import RolloutInputError, TokenOutput


class ReplicaDown(RuntimeError):
    """The replica could not serve the request: dead, unreachable or past its deadline."""


class Replica(Protocol):
    name: str

    async def generate(self, prompt_ids: Sequence[int], sampling: dict, request_id: str,
                       timeout_s: float) -> list[TokenOutput]: ...

    async def health(self, timeout_s: float) -> dict: ...


class RayReplica:
    def __init__(self, handle: Any, name: str | None = None):
        self.handle = handle
        self.name = name or f"actor-{handle._actor_id.hex()[:8]}"

    async def _call(self, ref: ray.ObjectRef, what: str, timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
        except RayActorError as exc:  # died, or unreachable (ActorUnavailableError)
            raise ReplicaDown(f"{self.name}: {type(exc).__name__} during {what}") from exc
        except asyncio.TimeoutError:
            ray.cancel(ref)
            raise ReplicaDown(f"{self.name}: no answer to {what} within {timeout_s:.0f}s") from None

    async def generate(self, prompt_ids, sampling, request_id, timeout_s):
        ref = self.handle.generate.remote(list(prompt_ids), sampling, request_id)
        return await self._call(ref, f"generate {request_id}", timeout_s)

    async def health(self, timeout_s):
        return await self._call(self.handle.health.remote(), "health", timeout_s)


class HTTPReplica:
    """A server started by `polyrl serve` (or any polyrl HTTP server), via POST /generate."""

    def __init__(self, base_url: str):
        import httpx  # only routers over HTTP replicas need it

        self.name = base_url.rstrip("/")
        self._httpx = httpx
        self._client = httpx.AsyncClient(base_url=self.name)

    async def _request(self, method: str, path: str, what: str, timeout_s: float, **kwargs) -> dict:
        httpx = self._httpx
        try:
            resp = await self._client.request(method, path, timeout=timeout_s, **kwargs)
        except (httpx.TransportError, httpx.TimeoutException) as exc:  # refused, reset, timed out
            raise ReplicaDown(f"{self.name}: {type(exc).__name__} during {what}") from exc
        body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
        if resp.status_code == 400:
            err = body.get("error", {})
            raise RolloutInputError(err.get("param") or "request", err.get("message", resp.text))
        if resp.status_code in (502, 503, 504):  # a proxy or the server says: not serving
            raise ReplicaDown(f"{self.name}: HTTP {resp.status_code} during {what}")
        if resp.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status_code} during {what}: {resp.text[:500]}")
        return body

    async def generate(self, prompt_ids, sampling, request_id, timeout_s):
        body = await self._request("POST", "/generate", f"generate {request_id}", timeout_s, json={
            "prompt_ids": list(prompt_ids), "sampling": sampling, "request_id": request_id})
        return [_token_output(o) for o in body["outputs"]]

    async def health(self, timeout_s):
        return await self._request("GET", "/health", "health", timeout_s)


def _token_output(data: dict) -> TokenOutput:
    """JSON made top-log-prob keys strings; give them back their token-id type."""
    tops = data.get("top_logprobs")
    if tops is not None:
        data["top_logprobs"] = [{int(k): v for k, v in pos.items()} for pos in tops]
    return TokenOutput(**data)


def as_replica(target: Any) -> Replica:
    """A Ray actor handle, an http(s) base URL, or an object that already is a replica."""
    if isinstance(target, str):
        if not target.startswith(("http://", "https://")):
            raise ValueError(f"replica '{target}': expected an http(s):// base URL or a Ray actor handle")
        return HTTPReplica(target)
    if isinstance(target, ray.actor.ActorHandle):
        return RayReplica(target)
    if hasattr(target, "generate") and hasattr(target, "health") and hasattr(target, "name"):
        return target
    raise TypeError(f"cannot route to {type(target).__name__}; pass Ray actor handles or base URLs")
