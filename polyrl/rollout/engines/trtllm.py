"""TensorRT-LLM behind `RolloutEngine` (registered as "trtllm"; `pip install "polyrl[trtllm]"`).

Written against TRT-LLM's PyTorch-backend `AsyncLLM` with the Ray orchestrator, as verl's
`trtllm_rollout` drives it (verl main, read 2026; TRT-LLM 1.1 / 1.2, the range in
`polyrl/backends.py`, every name used listed in `ENGINE_CONTRACTS["trtllm"]`):
`await AsyncLLM(**args)` with its placement arguments (`placement`, below),
`generate_async(prompt_ids, sampling_params)` (awaitable; `.abort()` cancels), `release(tags)` /
`resume(tags)` (needs `enable_sleep`; 1.1 and 1.2 have no `SleepConfig`), and
`collective_rpc(method, args=...)` into polyrl's worker extension
(`polyrl/rollout/engines/trtllm_worker.py`: TRT-LLM's `rlhf_utils.WorkerExtension` plus
`supports_partial_loading`), whose `update_weights(ipc_handles)` loads {device uuid:
base64(pickle([(name, reduce_tensor(t))]))} and, called with None, finalizes (post-load
processing, prefix-cache reset).

Weight update (`update_weights`, or `push_rank_weights` from every rank of a multi-process
replica): `weight_flush.push_to_replica` cuts the tensors into IPC-handle flushes within
`update_bucket_mb`, gathers each rank's flush to the replica leader, which hands them to the
engine; for vision-language models the leader first asks the engine whether it accepts partial
loading (`supports_partial_loading`, answered no when the extension lacks it) and broadcasts
the answer (R5). IPC handles need device tensors: host tensors (what every disaggregated
transport hands over: the broadcast stages on the CPU, the object store returns numpy-backed
tensors) are copied to the adapter's device one tensor at a time as the flushes are cut, so at
most one flush is staged there (`stage_on_device`). With `quantization=fp8` the tensors are
quantized here (sending side).

Log-probs: TRT-LLM releases before the PyTorch sampler always included the sampled token
return only the top-k record, which may miss the sampled token at a non-greedy step. Such a
position's log-prob is NaN (never a made-up value), counted in the output's
`extra["missing_logprobs"]`, and warned about once.
"""

from __future__ import annotations

import base64
import logging
import math
import pickle
from typing import Any, Iterable, Iterator, Mapping

import torch

from polyrl.rollout.base import SamplingParams, TokenOutput, WeightUpdateError
from polyrl.rollout.engines.common import (
    DEFAULT_CONTROL_TIMEOUT_S,
    AsyncEngineAdapter,
    NamedTensors,
    partial_update_guard,
    sampled_logprobs,
    update_stream,
)
from polyrl.rollout.engines.weight_flush import PushResult, push_to_replica, read_hf_config

WEIGHT_TAGS = ("sampler", "drafter", "guided_decoder", "spec_resource_manager", "model_extra",
               "executor_extra", "model", "draft_model")
"""TRT-LLM memory tags holding weights (verl's list); "kv_cache" is the other one."""
ALL_TAGS = (*WEIGHT_TAGS, "kv_cache")


def trtllm_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """`tensorrt_llm.SamplingParams(**kwargs)`. top_k 0 disables; `logprobs=k` returns the
    sampled token's log-prob (k >= 1)."""
    wanted = sampling.logprobs or sampling.top_logprobs > 0
    kwargs: dict[str, Any] = {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(sampling.top_k, 0),
        "max_tokens": sampling.max_tokens,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "stop": list(sampling.stop) or None,
        "ignore_eos": sampling.ignore_eos,
        "seed": sampling.seed,
        "logprobs": max(sampling.top_logprobs, 1) if wanted else None,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


logger = logging.getLogger(__name__)


def _sampled(record: Mapping[int, Any], token: int) -> float:
    """The sampled token's log-prob, NaN when the record (a top-k) does not hold it."""
    if token not in record:
        return math.nan
    entry = record[token]
    return getattr(entry, "logprob", entry)


def stage_on_device(named: Iterable[tuple[str, torch.Tensor]],
                    device: torch.device | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with each host tensor copied to `device` as it is read (lazily: the flush being
    cut holds the only staged copies); device tensors pass through. `device` None (no
    accelerator here): host tensors pass through, and `serialize_handles` names the problem."""
    for name, tensor in named:
        if device is not None and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            tensor = tensor.to(device)
        yield name, tensor


def staging_device() -> torch.device | None:
    """Where host tensors are staged for IPC: this process's current accelerator device, the
    one the TRT-LLM worker of its bundle uses (None on a platform without devices)."""
    from polyrl.platform import current_platform

    platform = current_platform()
    if platform.device_type == "cpu" or platform.device_count() == 0:
        return None
    return platform.torch_device(platform.device_module().current_device())


def serialize_handles(piece: list[tuple[str, torch.Tensor]]) -> str:
    """One flush as TRT-LLM's extension reads it: base64(pickle([(name, (rebuild, args))]))."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for name, tensor in piece:
        if tensor.device.type == "cpu":
            raise WeightUpdateError(f"parameter '{name}' is in host memory; TensorRT-LLM weight "
                                    "updates travel as device IPC handles")
        handles.append((name, reduce_tensor(tensor.detach().contiguous())))
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


def device_payload(piece: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{uuid of the piece's device: serialized handles}: the key TRT-LLM's workers look up."""
    from tensorrt_llm._torch.utils import get_device_uuid

    index = piece[0][1].device.index or 0
    return {get_device_uuid(index): serialize_handles(piece)}



def quantizes_fp8(launch_args: Mapping[str, Any]) -> bool:
    """Whether the engine was built for polyrl's block-FP8 weights (`rollout.quantization=fp8`):
    its `model_kwargs.quantization_config` carries every FP8_QUANT_CONFIG entry. Any other
    quantization config a user gives (a pre-quantized checkpoint) must not make the adapter
    quantize the weights it sends."""
    from polyrl.rollout.launch_args import builds_polyrl_fp8

    return builds_polyrl_fp8(dict(launch_args), "trtllm")


BUNDLE_ENV = "POLYRL_PLACEMENT_BUNDLE"
"""The placement-group bundle index polyrl's launcher starts an engine-starting actor in (Ray
tells an actor its group, not its bundle; the environment plan's `placement` source sets it)."""


def placement(tp: int, given: Mapping[str, Any] | None = None,
              env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`AsyncLLM`'s placement arguments for an engine started in this actor: the placement group
    it runs in and the bundles of its replica's `tp` devices, which start at its own bundle.

    The actor that starts the engine (a colocated policy rank, or a disaggregated replica's leader:
    a rank like the others, not an engine host) asks Ray for the rest of its device
    (`1 - TRTLLM_WORKER_GPU_SHARE`, polyrl/rollout/launch_args.py) while its bundle keeps the
    whole device plus a CPU; TRT-LLM's Ray workers, one per TP rank, each ask for
    `per_worker_gpu_share` (0.5) of a device in these bundles
    (polyrl/topology/launch_plan.py:beside_engine_worker). polyrl/placement/ray_groups.py gives
    a node's actors bundles in device order, a replica's ranks side by side, its leader first.
    The bundle comes from `given` (`placement_bundle_indices` in the launch arguments) or the
    `POLYRL_PLACEMENT_BUNDLE` variable. Empty outside a placement group: TRT-LLM then asks Ray
    for devices as it likes."""
    import os

    import ray
    from ray.util import get_current_placement_group

    group = get_current_placement_group() if ray.is_initialized() else None
    if group is None:
        return {}
    if given and given.get("placement_bundle_indices"):
        return {"placement_groups": [group], "placement_bundle_indices": given["placement_bundle_indices"]}
    bundle = (os.environ if env is None else env).get(BUNDLE_ENV)
    if bundle is None or not bundle.isdigit():
        raise RuntimeError(f"the actor starting TensorRT-LLM runs in a placement group but {BUNDLE_ENV} "
                           "does not name its bundle; set rollout.engine_kwargs.trtllm."
                           "placement_bundle_indices=[[first, ..., last]]")
    index = int(bundle)
    return {"placement_groups": [group], "placement_bundle_indices": [list(range(index, index + tp))]}


class TRTLLMEngine(AsyncEngineAdapter):
    """Implements `polyrl.rollout.base.RolloutEngine` on TensorRT-LLM's `AsyncLLM`.

    Args: as `VLLMEngine`; `launch_args` from `polyrl.rollout.launch_args.trtllm_args`
    (the `kv_cache_config` dict becomes a `KvCacheConfig` here, and the placement group the
    actor runs in is added: `placement`).
    """

    backend = "trtllm"

    def __init__(self, launch_args: dict[str, Any], *, tokenizer: Any = True, seed: int = 0,
                 update_bucket_mb: int = 512,
                 control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S):
        from tensorrt_llm import AsyncLLM
        from tensorrt_llm.llmapi import KvCacheConfig

        self._init_adapter(launch_args, "model", tokenizer, seed, update_bucket_mb, control_timeout_s)
        self.fp8 = quantizes_fp8(self.launch_args)
        self.hf_config = read_hf_config(self.model_path)
        self.device = staging_device()
        """Where host tensors of a weight update are staged, one flush at a time."""
        self._requests: dict[str, Any] = {}
        self._warned_logprobs = False
        args = dict(self.launch_args)
        args["kv_cache_config"] = KvCacheConfig(**args.get("kv_cache_config", {}))
        args.update(placement(int(args.get("tensor_parallel_size", 1)), args))

        async def start():
            return await AsyncLLM(**args)

        self.engine = self._control(start(), "start")

    # --- generation ------------------------------------------------------------------------------
    async def _generate_one(self, prompt: list[int], sampling: SamplingParams,
                            request_id: str) -> list[TokenOutput]:
        from tensorrt_llm import SamplingParams as TRTSamplingParams

        if self._asleep:
            raise RuntimeError("TensorRT-LLM engine is sleeping; call wake_up() first")
        request = self.engine.generate_async(prompt, sampling_params=TRTSamplingParams(
            **trtllm_sampling_kwargs(sampling)))
        self._requests[request_id] = request
        try:
            result = await request
        finally:
            self._requests.pop(request_id, None)
        return self._outputs(result, sampling)

    def _outputs(self, result: Any, sampling: SamplingParams) -> list[TokenOutput]:
        """polyrl's outputs of one TRT-LLM `RequestOutput`."""
        outs = []
        for c in result.outputs:
            logprobs = sampled_logprobs(c.token_ids, c.logprobs, sampling.logprobs, _sampled)
            out = self._output(c.token_ids, logprobs, c.finish_reason, c.text)
            missing = sum(math.isnan(lp) for lp in logprobs)
            if missing:
                out.extra["missing_logprobs"] = missing
                self._warn_missing_logprobs()
            outs.append(out)
        return outs

    def _warn_missing_logprobs(self) -> None:
        if not self._warned_logprobs:
            logger.warning("TensorRT-LLM returned top-k log-prob records without the sampled token; those "
                           "positions' rollout log-probs are NaN (old log-probs are recomputed by the "
                           "trainer; the off-policy correction counts them on-policy and "
                           "rollout/logprob_diff_* leaves them out); pip install a TensorRT-LLM whose "
                           "PyTorch sampler includes the sampled token")
            self._warned_logprobs = True

    # --- weights ---------------------------------------------------------------------------------
    def supports_partial_loading(self) -> bool:
        """Asked by the replica leader for vision-language models only."""
        try:
            return bool(self._control(self.engine.collective_rpc("supports_partial_loading",
                                                                 unique_reply_rank=0),
                                      "supports_partial_loading"))
        except Exception:  # noqa: BLE001 - an extension without the method cannot load in parts
            return False

    def _apply(self, handles: dict[str, str] | None) -> None:
        self._control(self.engine.collective_rpc("update_weights", args=(handles,)),
                      "update_weights" if handles is not None else "finalize update_weights")

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """This process is the whole replica (group=None). Multi-process replicas: every rank
        calls `push_rank_weights` and the leader's adapter is passed as `engine`."""
        push_rank_weights(named_tensors, version, engine=self, group=None, fp8=self.fp8,
                          budget_bytes=self.bucket_bytes, hf_config=self.hf_config, device=self.device)

    def _before_update(self) -> None:
        if "model" in self._asleep:
            self._control(self.engine.resume(tags=list(WEIGHT_TAGS)), "resume weights")
            self._asleep.difference_update(WEIGHT_TAGS)

    # --- control ---------------------------------------------------------------------------------
    def sleep(self) -> None:
        if not self.launch_args.get("enable_sleep"):
            raise RuntimeError("TensorRT-LLM was started without enable_sleep (disaggregated "
                               "placement); set rollout.engine_kwargs.trtllm.enable_sleep=true")
        if self._inflight:
            raise RuntimeError(f"cannot sleep with {len(self._inflight)} running requests; let them "
                               "finish or call abort_all() first")
        self._control(self.engine.release(tags=list(ALL_TAGS)), "sleep")
        self._asleep = set(ALL_TAGS)
        self._sleeping = True

    def wake_up(self) -> None:
        if self._asleep:
            self._control(self.engine.resume(tags=[t for t in ALL_TAGS if t in self._asleep]), "wake_up")
        self._asleep.clear()
        self._sleeping = False

    def abort_all(self) -> int:
        requests = list(self._requests.values())

        async def abort() -> None:
            for request in requests:
                request.abort()

        self._control(abort(), "abort")
        return len(requests)

    def shutdown(self) -> None:
        self.engine.shutdown()
        super().shutdown()


def push_rank_weights(named_tensors: NamedTensors, version: int, *, engine: TRTLLMEngine | None,
                      group: Any, fp8: bool, budget_bytes: int, hf_config: Any,
                      timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S, device: Any = "current",
                      make_payload: Any = None) -> PushResult:
    """Every rank of a replica calls this with its weights (its shard, on its device or in host
    memory); `engine` is the adapter on the replica leader and None elsewhere; `fp8`
    (rollout.quantization=fp8) quantizes on this rank before sending. Host tensors are staged on
    `device` ("current": `staging_device()`) flush by flush. `make_payload`: one flush's
    {device uuid: handles} (default `device_payload`). On success the leader's engine serves
    `version`."""
    target = staging_device() if device == "current" else device
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    # staged before quantizing: FP8 then runs on the device, and the version is checked first
    named = update_stream(stage_on_device(items, target), version, fp8=fp8)
    if engine is not None:
        engine._before_update()
    with partial_update_guard("TensorRT-LLM", version, passthrough=(WeightUpdateError,)):
        result = push_to_replica(
            named, make_payload=make_payload or device_payload,
            apply=engine._apply if engine is not None else None,
            finish=(lambda: engine._apply(None)) if engine is not None else None,
            budget_bytes=budget_bytes, group=group, hf_config=hf_config, engine=engine,
            timeout_s=timeout_s)
    if engine is not None:
        engine._version = version
    return result

