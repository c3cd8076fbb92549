"""SGLang behind `RolloutEngine` (registered as "sglang"; `pip install "polyrl[sglang]"`).

Written against SGLang's offline `sglang.Engine`, supported range in `polyrl/backends.py` (every
name used is listed in `ENGINE_CONTRACTS["sglang"]` and checked against the real releases by
tests/rollout/engines/test_contract_sglang.py): `Engine(**ServerArgs fields)`,
`async_generate(input_ids=..., sampling_params=..., return_logprob=..., top_logprobs_num=...,
rid=...)`, and the tokenizer manager's coroutines that `Engine`'s synchronous wrappers run:
`update_weights_from_tensor`, `flush_cache`, `release_memory_occupation` /
`resume_memory_occupation` (tags "weights", "kv_cache"), and `abort_request(abort_all=True)`.
The engine is created on the adapter's loop thread, so `Engine.loop` is that loop and its
coroutines are awaited there directly (its synchronous wrappers would try to run a loop that is
already running). SGLang before 0.5.10 registers a SIGQUIT handler while it starts, which Python
allows only on the main thread: there the engine is built on the calling thread, which must then
be the main one (the engine's request loop still starts lazily on the adapter's loop).

The n samples of a prompt are n requests of one batch (the radix cache shares their prefill),
seeded `seed + i` when the request has a seed (SGLang's `sampling_seed`).

Weight update: pieces of `update_bucket_mb` through `update_weights_from_tensor(flush_cache=
False)`, one payload per TP rank (`MultiprocessingSerializer`: GPU tensors travel as CUDA IPC
handles), then one `flush_cache`. From SGLang 0.5.21 weights load only inside a weight-update
session: `begin_weight_update` first, `end_weight_update` after the last piece (it runs the
post-load processing, FP8's included), closed even when a piece fails so the next update can
open its own. With `quantization=fp8` the pieces are quantized here (sending
side) by `polyrl.weights.fp8.quantize_named_tensors`; the engine was started with the block-FP8
layout (`json_model_override_args`).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Iterable

import torch
from packaging.version import Version

from polyrl.backends import SGLANG_ANY_THREAD_SINCE, SGLANG_WEIGHT_SESSION_SINCE
from polyrl.rollout.base import SamplingParams, TokenOutput
from polyrl.rollout.engines.common import (
    DEFAULT_CONTROL_TIMEOUT_S,
    AsyncEngineAdapter,
    NamedTensors,
    partial_update_guard,
    sampled_logprobs,
    update_stream,
)
from polyrl.rollout.engines.weight_flush import iter_flushes

SLEEP_TAGS = ("kv_cache", "weights")


def uses_weight_session(version: str | None) -> bool:
    """Whether SGLang `version` loads weights only between begin_/end_weight_update (unknown:
    the newest release, which does)."""
    return version is None or Version(Version(version).base_version) >= Version(SGLANG_WEIGHT_SESSION_SINCE)


def starts_on_main_thread_only(version: str | None) -> bool:
    """Whether SGLang `version` must build its `Engine` on the main thread (signal handler)."""
    return version is not None and Version(Version(version).base_version) < Version(SGLANG_ANY_THREAD_SINCE)


def _ok(result: Any) -> tuple[bool, str]:
    """(success, message) of a tokenizer-manager call: a tuple, an output object, or None."""
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1]) if len(result) > 1 else ""
    if hasattr(result, "success"):
        return bool(result.success), str(getattr(result, "message", ""))
    return True, ""


async def push_weight_pieces(tm: Any, pieces: Iterable[list[tuple[str, torch.Tensor]]], *, tp_size: int,
                             session: bool, io: Any) -> int:
    """Load `pieces` into the engine behind tokenizer manager `tm`, then flush its cache.

    `io` carries SGLang's request types and serializer (`UpdateWeightsFromTensorReqInput`,
    `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`, `serialize`); `session`: open and
    close a weight-update session around the pieces (SGLang >= 0.5.21). Returns the pieces sent;
    raises RuntimeError with SGLang's message on the first refusal."""
    sent = 0
    if session:
        ok, message = _ok(await tm.begin_weight_update(io.BeginWeightUpdateReqInput(), None))
        if not ok:
            raise RuntimeError(f"begin_weight_update: {message}")
    try:
        for piece in pieces:
            req = io.UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[io.serialize(piece) for _ in range(tp_size)],
                load_format=None, flush_cache=False)
            ok, message = _ok(await tm.update_weights_from_tensor(req, None))
            if not ok:
                raise RuntimeError(message)
            sent += 1
    finally:
        if session:  # closed even after a failure: a session left open refuses the next update
            ok, message = _ok(await tm.end_weight_update(io.EndWeightUpdateReqInput(), None))
            if not ok:
                raise RuntimeError(f"end_weight_update: {message}")
    await tm.flush_cache()
    return sent


def sglang_sampling_params(sampling: SamplingParams, sample: int) -> dict[str, Any]:
    """SGLang `sampling_params` for sample `sample` of a request (one request per sample)."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # -1: whole vocabulary
        "max_new_tokens": sampling.max_tokens,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "stop": list(sampling.stop) or None,
        "ignore_eos": sampling.ignore_eos,
        "sampling_seed": None if sampling.seed is None else sampling.seed + sample,
    }
    return {k: v for k, v in params.items() if v is not None}


def sglang_request(prompt: list[int], sampling: SamplingParams, request_id: str) -> dict[str, Any]:
    """`Engine.async_generate` keyword arguments: the n samples as n requests of one batch."""
    wanted = sampling.logprobs or sampling.top_logprobs > 0
    request: dict[str, Any] = {
        "input_ids": [list(prompt) for _ in range(sampling.n)],
        "sampling_params": [sglang_sampling_params(sampling, i) for i in range(sampling.n)],
        "return_logprob": wanted,
        "rid": [f"{request_id}-{i}" for i in range(sampling.n)],
    }
    if wanted:
        request["logprob_start_len"] = len(prompt)  # no prompt log-probs
        if sampling.top_logprobs:
            request["top_logprobs_num"] = sampling.top_logprobs
    return request


def _sampled(record: Any, token: int) -> float:
    logprob, token_id = record[0], record[1]
    if token_id != token:
        raise RuntimeError(f"SGLang log-prob record is for token {token_id}, the output has {token}")
    return logprob


class SGLangEngine(AsyncEngineAdapter):
    """Implements `polyrl.rollout.base.RolloutEngine` on `sglang.Engine`.

    Args: as `VLLMEngine`; `launch_args` are `sglang.Engine` keyword arguments
    (`polyrl.rollout.launch_args.sglang_args`).
    """

    backend = "sglang"

    def __init__(self, launch_args: dict[str, Any], *, tokenizer: Any = True, seed: int = 0,
                 update_bucket_mb: int = 512,
                 control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S):
        import sglang

        from polyrl.backends import installed_engine_version
        from polyrl.rollout.launch_args import builds_polyrl_fp8

        self.version = installed_engine_version("sglang")
        if starts_on_main_thread_only(self.version) and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"sglang {self.version} must be started on the main thread (it "
                               "registers a signal handler); start the engine there or pip install "
                               f"\"sglang>={SGLANG_ANY_THREAD_SINCE}\"")
        self._init_adapter(launch_args, "model_path", tokenizer, seed, update_bucket_mb, control_timeout_s)
        # only polyrl's block-FP8 layout makes the adapter quantize (never a user's own config)
        self.fp8 = builds_polyrl_fp8(self.launch_args, "sglang")
        self.tp_size = int(self.launch_args.get("tp_size", 1))
        self.weight_session = uses_weight_session(self.version)

        if starts_on_main_thread_only(self.version):
            self.engine = sglang.Engine(**self.launch_args)
        else:
            async def start():  # on the loop thread: the engine adopts this running loop
                return sglang.Engine(**self.launch_args)

            self.engine = self._control(start(), "start")
        self._tm = self.engine.tokenizer_manager

    # --- generation ------------------------------------------------------------------------------
    async def _generate_one(self, prompt: list[int], sampling: SamplingParams,
                            request_id: str) -> list[TokenOutput]:
        if self._asleep:
            raise RuntimeError("SGLang engine is sleeping; call wake_up() first")
        results = await self.engine.async_generate(**sglang_request(prompt, sampling, request_id))
        results = results if isinstance(results, list) else [results]
        outs = []
        for res in results:
            meta = res["meta_info"]
            tokens = list(res["output_ids"])
            logprobs = sampled_logprobs(tokens, meta.get("output_token_logprobs"), sampling.logprobs,
                                        _sampled)
            top = None
            if sampling.top_logprobs:
                top = [{rec[1]: rec[0] for rec in row} for row in meta["output_top_logprobs"]]
            outs.append(self._output(tokens, logprobs, meta["finish_reason"], res.get("text"), top))
        return outs

    # --- control ---------------------------------------------------------------------------------
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        # read whole on this thread, quantized (sending side) as the pieces are cut
        named = update_stream(named_tensors, version, fp8=self.fp8, drain=True)

        io = SimpleNamespace(
            UpdateWeightsFromTensorReqInput=io_struct.UpdateWeightsFromTensorReqInput,
            BeginWeightUpdateReqInput=getattr(io_struct, "BeginWeightUpdateReqInput", None),
            EndWeightUpdateReqInput=getattr(io_struct, "EndWeightUpdateReqInput", None),
            serialize=MultiprocessingSerializer.serialize)

        async def push() -> None:
            if "weights" in self._asleep:
                await self._resume(["weights"])
            await push_weight_pieces(self._tm, iter_flushes(named, self.bucket_bytes),
                                     tp_size=self.tp_size, session=self.weight_session, io=io)

        with partial_update_guard("SGLang", version):
            self._control(push(), f"update_weights to version {version}")
        self._version = version

    async def _resume(self, tags: list[str]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None)
        self._asleep.difference_update(tags)

    def sleep(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        if not self.launch_args.get("enable_memory_saver"):
            raise RuntimeError("SGLang was started without enable_memory_saver (standalone "
                               "placement); set rollout.engine_kwargs.sglang.enable_memory_saver=true")
        if self._inflight:
            raise RuntimeError(f"cannot sleep with {len(self._inflight)} running requests; let them "
                               "finish or call abort_all() first")
        req = ReleaseMemoryOccupationReqInput(tags=list(SLEEP_TAGS))
        self._control(self._tm.release_memory_occupation(req, None), "sleep")
        self._asleep = set(SLEEP_TAGS)
        self._sleeping = True

    def wake_up(self) -> None:
        if self._asleep:
            self._control(self._resume(sorted(self._asleep)), "wake_up")
        self._sleeping = False

    def abort_all(self) -> int:
        n = len(self._inflight)

        async def abort() -> None:
            self._tm.abort_request(abort_all=True)

        self._control(abort(), "abort")
        return n

    def shutdown(self) -> None:
        self.engine.shutdown()
        super().shutdown()
