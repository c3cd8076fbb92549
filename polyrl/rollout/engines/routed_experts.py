"""The experts vLLM and SGLang routed each token to, as polyrl's routes rows (polyrl/batch/routes.py),
for actor.router_replay=R3 (docs/moe.md).

Both engines, asked at start (`enable_return_routed_experts`, the same name in vLLM's engine
arguments and SGLang's server arguments), return one row per token of the whole sequence but the
last, in order: [prompt + response - 1, num_hidden_layers, k], row i holding the top-k expert ids
each decoder layer chose while token i was the model's input.
- SGLang (0.5.7 to 0.5.23 alike): the scheduler reads `req_to_token[: seqlen - 1]` of the
  capturer's int32 host buffer, and the detokenizer (or the tokenizer manager) puts the bytes in
  `meta_info["routed_experts"]` base64-encoded; an output without them is absent or `[]`.
- vLLM (0.14.0 on): `CompletionOutput.routed_experts`, a numpy array of `num_tokens - 1` rows
  (int32 through 0.17; from the aux-output connector, uint8 / uint16, in 0.32).
The layer axis counts every decoder layer (`num_hidden_layers`); a dense layer's rows hold
whatever the buffer held. polyrl's rows are the MoE layers only, and row j is response token j
as input: sequence row prompt + j. The last response token is never fed back, so it is marked
not routed, as the native engine marks it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyrl.batch.routes import encode, routes_dtype

ENGINE_FLAG = "enable_return_routed_experts"
"""The launch argument that makes vLLM (`AsyncEngineArgs`) and SGLang (`ServerArgs`) record
routes (`ROUTES_LAUNCH_ARGUMENT` in polyrl/backends.py, which actor.router_replay=R3 sets); the
adapters read and ask for routes only when it is set."""


@dataclass(frozen=True)
class RouteLayout:
    """Where a model's routes sit in an engine's rows."""

    num_layers: int
    """Decoder layers: the engines' layer axis."""
    moe_layers: tuple[int, ...]
    """The mixture-of-experts layers among them, in order: polyrl's layer axis."""
    num_experts: int
    top_k: int


def route_layout(model_path: str) -> RouteLayout:
    """The layout of the Qwen3-MoE / Qwen2-MoE model in directory `model_path`; ValueError in one
    line for a model with no routers polyrl replays."""
    from polyrl.rollout.native.loader import load_config
    from polyrl.rollout.native.moe import MOE_ARCHITECTURES, moe_spec

    config = load_config(Path(model_path))
    arch = next((a for a in getattr(config, "architectures", None) or [] if a in MOE_ARCHITECTURES), None)
    spec = moe_spec(config, arch) if arch else None
    if spec is None:
        raise ValueError(f"{ENGINE_FLAG}: {model_path} is not a Qwen3-MoE / Qwen2-MoE model, so it has no "
                         "routes polyrl replays (docs/moe.md); set actor.router_replay=R2 or off")
    return RouteLayout(num_layers=len(spec.sparse_layers),
                       moe_layers=tuple(i for i, sparse in enumerate(spec.sparse_layers) if sparse),
                       num_experts=spec.num_experts, top_k=spec.top_k)


def asked_routes(launch_args: dict[str, Any], backend: str, version: str | None,
                 model_path: str) -> RouteLayout | None:
    """The route layout when the launch arguments ask the engine for routes (None: they do not);
    ValueError in one line when the installed engine is below the floor declared for them
    (`EngineCapabilities.since`, polyrl/backends.py), before the engine starts."""
    from polyrl.backends import feature_version_problem

    if not launch_args.get(ENGINE_FLAG):
        return None
    problem = feature_version_problem(backend, "routed_experts", version, f"{ENGINE_FLAG}=true")
    if problem:
        raise ValueError(problem)
    return route_layout(model_path)


def response_routes(rows: Any, prompt_len: int, length: int, layout: RouteLayout,
                    engine: str) -> torch.Tensor:
    """polyrl's routes [length, MoE layers, k] (`TokenOutput.extra["routed_experts"]`) of a
    sample whose `length` response tokens follow `prompt_len` prompt tokens, from the engine's
    sequence rows [n, num_layers, k]. Rows missing at the end (an engine that dropped a stop
    string's tokens) are marked not routed; RuntimeError for rows of another shape or an id
    that is not an expert (SGLang's physical ids under redundant experts)."""
    values = np.asarray(rows)
    if values.ndim != 3 or values.shape[1:] != (layout.num_layers, layout.top_k):
        raise RuntimeError(f"{engine} returned routed experts of shape {tuple(values.shape)}; expected "
                           f"[tokens, {layout.num_layers} layers, {layout.top_k}]")
    mine = torch.from_numpy(values[prompt_len: prompt_len + length][:, list(layout.moe_layers)].astype(np.int64))
    if mine.numel() and (int(mine.min()) < 0 or int(mine.max()) >= layout.num_experts):
        raise RuntimeError(f"{engine} returned expert id {int(mine.max())} (of {layout.num_experts} experts, ids "
                           "from 0): not the model's expert ids (redundant or remapped experts?); start the "
                           "engine without expert redistribution for actor.router_replay=R3")
    return encode(mine, length, routes_dtype(layout.num_experts), len(layout.moe_layers), layout.top_k)


def sglang_rows(meta_info: dict[str, Any], layout: RouteLayout) -> np.ndarray | None:
    """The sequence rows in an SGLang output's `meta_info` (None: it carries none)."""
    encoded = meta_info.get("routed_experts")
    if encoded is None or (isinstance(encoded, (list, tuple)) and not encoded):
        return None
    data = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if data.size % (layout.num_layers * layout.top_k):
        raise RuntimeError(f"SGLang returned {data.size} routed-expert ids, not a whole number of tokens of "
                           f"{layout.num_layers} layers x {layout.top_k}")
    return data.reshape(-1, layout.num_layers, layout.top_k)
