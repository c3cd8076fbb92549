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
seeded `seed + i` when the request has a seed (SGLang's `sampling_seed`, which SGLang honours
only with `enable_deterministic_inference`: without it the adapter warns once). `abort_all`
aborts each sample by its rid, again until it has ended (a request still being tokenized is not
known to SGLang yet).

Weight update: pieces of `update_bucket_mb`, cut on the calling thread from the lazy stream and
sent one at a time (a colocated update never holds the whole gathered model), through
`update_weights_from_tensor(flush_cache=False)`, one payload per TP rank (`MultiprocessingSerializer`: GPU tensors travel as CUDA IPC
handles), then one `flush_cache`. From SGLang 0.5.21 weights load only inside a weight-update
session: `begin_weight_update` first, `end_weight_update` after the last piece (it runs the
post-load processing, FP8's included), closed even when a piece fails so the next update can
open its own. With `quantization=fp8` the pieces are quantized here (sending
side) by `polyrl.weights.fp8.quantize_named_tensors`; the engine was started with the block-FP8
layout (`json_model_override_args`).

Routes (actor.router_replay=R3, SGLang >= 0.5.9): an engine started with
`enable_return_routed_experts` is asked per request (`return_routed_experts`), and each output's
base64 `meta_info["routed_experts"]` becomes `TokenOutput.extra["routed_experts"]`
(polyrl/rollout/engines/routed_experts.py).
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any, Awaitable, Callable, Iterable

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
from polyrl.rollout.engines.routed_experts import asked_routes, response_routes, sglang_rows
from polyrl.rollout.engines.weight_flush import iter_flushes

SLEEP_TAGS = ("kv_cache", "weights")
logger = logging.getLogger(__name__)

DETERMINISTIC_KEY = "enable_deterministic_inference"
"""The `ServerArgs` field without which SGLang ignores every request's `sampling_seed`
(`SamplingBatchInfo.from_schedule_batch` builds the seed tensor only when it is set, 0.5.6 to
0.5.23 alike)."""


def seed_ignored(launch_args: Any, sampling: SamplingParams) -> bool:
    """Whether SGLang would drop this request's seed: one is given, and the engine was started
    without deterministic inference."""
    return sampling.seed is not None and not launch_args.get(DETERMINISTIC_KEY)


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


def push_weight_pieces(run: Callable[[Awaitable[Any]], Any], tm: Any,
                       pieces: Iterable[list[tuple[str, torch.Tensor]]], *, tp_size: int,
                       session: bool, io: Any) -> int:
    """Load `pieces` into the engine behind tokenizer manager `tm`, then flush its cache.

    Driven from the calling thread: each piece is cut from its (lazy) source here and handed to
    the engine with `run(coroutine)` (which runs it on the engine's loop and waits) before the
    next one is read, so a colocated update holds one piece of gathered tensors at a time, never the
    whole model. `io` carries SGLang's request types and serializer
    (`UpdateWeightsFromTensorReqInput`, `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`,
    `serialize`); `session`: open and close a weight-update session around the pieces (SGLang
    >= 0.5.21). Returns the pieces sent; raises RuntimeError with SGLang's message on the first
    refusal."""
    sent = 0
    if session:
        ok, message = _ok(run(tm.begin_weight_update(io.BeginWeightUpdateReqInput(), None)))
        if not ok:
            raise RuntimeError(f"begin_weight_update: {message}")
    try:
        for piece in pieces:
            req = io.UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[io.serialize(piece) for _ in range(tp_size)],
                load_format=None, flush_cache=False)
            ok, message = _ok(run(tm.update_weights_from_tensor(req, None)))
            if not ok:
                raise RuntimeError(message)
            sent += 1
            del piece, req  # loaded: this piece's tensors may go before the next is gathered
    finally:
        if session:  # closed even after a failure: a session left open refuses the next update
            ok, message = _ok(run(tm.end_weight_update(io.EndWeightUpdateReqInput(), None)))
            if not ok:
                raise RuntimeError(f"end_weight_update: {message}")
    run(tm.flush_cache())
    return sent


def weight_pieces(named_tensors: NamedTensors, version: int, *, fp8: bool,
                  budget_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """An update's pieces within `budget_bytes`, read from the source lazily by whoever iterates
    (the calling thread, `push_weight_pieces`): quantized (`fp8`) and cut one piece at a time."""
    return iter_flushes(update_stream(named_tensors, version, fp8=fp8), budget_bytes)


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


def sglang_request(prompt: list[int], sampling: SamplingParams, request_id: str,
                   routes: bool = False) -> dict[str, Any]:
    """`Engine.async_generate` keyword arguments: the n samples as n requests of one batch.
    `routes`: ask for the experts each token was routed to (the engine was started with
    `enable_return_routed_experts`; SGLang >= 0.5.9's request flag)."""
    wanted = sampling.logprobs or sampling.top_logprobs > 0
    request: dict[str, Any] = {
        "input_ids": [list(prompt) for _ in range(sampling.n)],
        "sampling_params": [sglang_sampling_params(sampling, i) for i in range(sampling.n)],
        "return_logprob": wanted,
        "rid": [f"{request_id}-{i}" for i in range(sampling.n)],
    }
    if routes:
        request["return_routed_experts"] = True
    if wanted:
        # the last prompt position: only the output's log-probs (SGLang's own default for a
        # generation). len(prompt) would skip that one too, but SGLang 0.5.6 aborts a request
        # whose start is >= its input length (0.5.7 on: only >), so every sample came back
        # aborted with no tokens. The one input entry this adds (input_token_logprobs) is not read.
        request["logprob_start_len"] = len(prompt) - 1
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
        self._sample_rids: dict[str, list[str]] = {}  # request id -> its samples' SGLang rids
        self._warned_seed = False
        self.routes = asked_routes(self.launch_args, "sglang", self.version, self.model_path)
        """Where the model's routes sit in SGLang's rows when the engine records them
        (`enable_return_routed_experts`, for actor.router_replay=R3), else None."""

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
        if seed_ignored(self.launch_args, sampling) and not self._warned_seed:
            logger.warning("SGLang ignores sampling_seed unless started with %s=true: rollouts are not "
                           "reproducible from their seeds; set rollout.engine_kwargs.sglang.%s=true",
                           DETERMINISTIC_KEY, DETERMINISTIC_KEY)
            self._warned_seed = True
        request = sglang_request(prompt, sampling, request_id, routes=self.routes is not None)
        self._sample_rids[request_id] = list(request["rid"])
        try:
            results = await self.engine.async_generate(**request)
        finally:
            self._sample_rids.pop(request_id, None)
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
            out = self._output(tokens, logprobs, meta["finish_reason"], res.get("text"), top)
            rows = sglang_rows(meta, self.routes) if self.routes is not None else None
            if rows is not None:
                out.extra["routed_experts"] = response_routes(rows, len(prompt), len(tokens), self.routes, "SGLang")
            outs.append(out)
        return outs

    # --- control ---------------------------------------------------------------------------------
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        # read on this thread (a colocated stream gathers shards with collectives here), quantized
        # (sending side) and cut into pieces lazily: one piece is alive at a time
        pieces = weight_pieces(named_tensors, version, fp8=self.fp8, budget_bytes=self.bucket_bytes)

        io = SimpleNamespace(
            UpdateWeightsFromTensorReqInput=io_struct.UpdateWeightsFromTensorReqInput,
            BeginWeightUpdateReqInput=getattr(io_struct, "BeginWeightUpdateReqInput", None),
            EndWeightUpdateReqInput=getattr(io_struct, "EndWeightUpdateReqInput", None),
            serialize=MultiprocessingSerializer.serialize)

        with partial_update_guard("SGLang", version):
            if "weights" in self._asleep:
                self._control(self._resume(["weights"]), "resume weights")
            push_weight_pieces(lambda coro: self._control(coro, f"update_weights to version {version}"),
                               self._tm, pieces,
                               tp_size=self.tp_size, session=self.weight_session, io=io)
        self._version = version

    async def _resume(self, tags: list[str]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None)
        self._asleep.difference_update(tags)

    def sleep(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        if not self.launch_args.get("enable_memory_saver"):
            raise RuntimeError("SGLang was started without enable_memory_saver (disaggregated "
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
        """Abort every request in flight, by each sample's rid, re-sent until each has ended: a
        request still being tokenized is not in the tokenizer manager's `rid_to_state` yet, and
        SGLang drops an abort of an rid it does not know (and `abort_all=True` reaches only what
        the scheduler already holds), so one abort would let it run to its end."""

        async def send_abort(request_ids: list[str]) -> None:
            for request_id in request_ids:
                for rid in self._sample_rids.get(request_id, ()):
                    self._tm.abort_request(rid=rid)

        return self._abort_until_ended(send_abort)

    def shutdown(self) -> None:
        self.engine.shutdown()
        super().shutdown()
