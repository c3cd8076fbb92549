"""A rollout server: one engine in a Ray actor, started with its role's environment plan.

The actor is an *async* Ray actor: Ray runs its `async def` methods on one event loop, so many
`generate` calls are inside the engine at the same time and its continuous batching decodes them
together. Blocking control calls (weight loads, sleep) run in a worker thread so health checks
and new requests keep being answered meanwhile.

    handle = start_rollout_server("/models/Qwen3-0.6B", platform=current_platform())
    outs = ray.get(handle.generate.remote([1, 2, 3], {"n": 4, "max_tokens": 32}, "req-1"))
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping, Sequence

import ray
import torch

from polyrl.distributed.ray_launch import actor_options, plan_for_role
from polyrl.distributed.topologies import DISAGGREGATED, TopologySpec
from polyrl.distributed.waits import gather
from polyrl.platform import Platform, current_platform, get_platform
from polyrl.rollout.base import ROLLOUT_ENGINES, SamplingParams, TokenOutput
from polyrl.rollout.server.protocol import sampling_from_dict


class RolloutServer:
    """Args:
        model_path: what the engine loads (a local HF directory for the native engine).
        backend: a name in `ROLLOUT_ENGINES`.
        platform_name: the platform whose device the engine runs on (detected in the actor).
        engine_kwargs: passed to the engine class (dtype, max_model_len, max_num_seqs, seed...).
        num_threads: torch intra-op threads; match the actor's CPU reservation so replicas on one
            machine do not oversubscribe its cores.
        model_name: the id served over HTTP (default: the directory name).
    """

    def __init__(self, model_path: str, backend: str = "native", platform_name: str | None = None,
                 engine_kwargs: Mapping[str, Any] | None = None, num_threads: int | None = None,
                 model_name: str | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        platform = get_platform(platform_name)
        kwargs = {"device": platform.torch_device(0), **dict(engine_kwargs or {})}
        self.engine = ROLLOUT_ENGINES.get(backend)(model_path, **kwargs)
        self.model_path = model_path
        self.model_name = model_name or os.path.basename(os.path.normpath(model_path))
        self._http = None

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams | Mapping[str, Any] | None,
                       request_id: str | None = None) -> list[TokenOutput]:
        # RolloutInputError pickles, so a Ray caller catches it with the field named
        return await self.engine.generate(prompt_ids, sampling_from_dict(sampling), request_id)

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> int:
        await asyncio.to_thread(self.engine.update_weights, named_tensors, version)
        return self.engine.weight_version

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self.engine.wake_up)

    async def abort_all(self) -> int:
        return await asyncio.to_thread(self.engine.abort_all)

    async def health(self) -> dict:
        return {**self.engine.health(), "pid": os.getpid(), "model": self.model_name,
                "http": self._http.url if self._http else None,
                "stats": dict(getattr(self.engine, "stats", {}))}

    async def environment(self, names: Sequence[str]) -> dict[str, str | None]:
        """This process's values of `names`: what `polyrl env` planned vs what the actor sees."""
        return {name: os.environ.get(name) for name in names}

    async def serve_http(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> str:
        """Also serve the OpenAI-compatible API from this actor (same engine); returns its URL."""
        from polyrl.rollout.server.app import build_app
        from polyrl.rollout.server.http import HTTPServer

        if self._http is None:
            app = build_app(self.engine, self.model_name, aliases=(self.model_path,))
            self._http = HTTPServer(app, host, port)
            self._http_task = asyncio.get_running_loop().create_task(self._http.serve())
            await self._http.wait_started_async(timeout_s)
        return self._http.url


def start_rollout_server(model_path: str, **kwargs: Any) -> ray.actor.ActorHandle:
    """Start one `RolloutServer` actor with the rollout role's planned environment; returns its
    handle once the engine has loaded (a load error is raised here, not at the first request).
    Arguments as for `start_rollout_servers`."""
    return start_rollout_servers(1, model_path, **kwargs)[0]


def start_rollout_servers(
    count: int,
    model_path: str,
    *,
    platform: Platform | None = None,
    backend: str = "native",
    topology: TopologySpec = DISAGGREGATED,
    engine_kwargs: Mapping[str, Any] | None = None,
    num_cpus: float = 1,
    num_devices: float | None = None,
    config_env: Mapping[str, str] | None = None,
    model_name: str | None = None,
    name: str | None = None,
    ready_timeout_s: float = 300.0,
) -> list[ray.actor.ActorHandle]:
    """Start `count` replicas at once (they load in parallel), then wait until all are ready;
    a replica that does not come up within `ready_timeout_s` is named in the error.

    `num_devices` (per replica) defaults to one device of the platform (none on CPU); `name`
    names the actors `name-0`, `name-1`, ... in Ray. `topology`: the run the servers belong to,
    for their environment plan; a server is an engine on devices of its own, so disaggregated
    (STREAMING where an async run's trainer talks to them).
    """
    platform = platform or current_platform()
    plan = plan_for_role(platform, "rollout", topology=topology, backend=backend, config_env=config_env)
    devices = num_devices if num_devices is not None else (1 if platform.ray_resource else 0)
    resources = platform.ray_actor_options(devices, num_cpus=num_cpus)
    names = [f"{name}-{i}" if name else f"rollout server {i} ({model_path})" for i in range(count)]
    handles = [
        ray.remote(RolloutServer).options(**actor_options(plan, resources, name=name and names[i])).remote(
            model_path, backend, platform.name, dict(engine_kwargs or {}), max(1, int(num_cpus)), model_name)
        for i in range(count)
    ]
    gather([h.health.remote() for h in handles], names, phase="rollout server start-up",
           timeout_s=ready_timeout_s)
    return handles
