"""vLLM behind `RolloutEngine` (registered as "vllm"; `pip install "polyrl[vllm]"`).

Written against vLLM's V1 `AsyncLLM` (vllm main at commit 00080ee, read 2026; the same calls
exist since v0.8): `AsyncLLM.from_engine_args(AsyncEngineArgs(**args))`, `generate(prompt,
SamplingParams, request_id)` (an async generator; `RequestOutputKind.FINAL_ONLY` makes it yield
once), `abort(request_ids)`, `sleep(level)` / `wake_up(tags)`, `reset_prefix_cache()` and
`collective_rpc(method, args=...)`, which reaches every worker's `worker_extension_cls`
(`polyrl.rollout.engines.vllm_worker.PolyrlWorkerExtension`, named in the launch arguments).

Weight update: the tensors are cut into buckets of `update_bucket_mb`, each bucket goes to every
worker through `collective_rpc("polyrl_load_bucket")` and into `model.load_weights`; the last RPC
runs `process_weights_after_loading` and the prefix cache is reset (its KV came from the old
weights). With `quantization=fp8` the workers quantize each bucket (receiving side) with
`polyrl.weights.fp8.quantize_named_tensors`. Buckets travel as host bytes plus dtype and shape
(`vllm_worker.encode_tensor`): vLLM's RPC serializer does not hand untyped tensor arguments back
as tensors, and copies through host memory anyway.

LoRA adapter path (`rollout.lora_mode=adapter`; the launch arguments carry `enable_lora`): the
engine reads the base model from disk once, and an update made only of adapter tensors
(`polyrl.training.lora.adapter_named_tensors`: peft's names, B pre-scaled by alpha / rank) is
written as a peft adapter directory (`adapter_files`) and loaded with vLLM's public LoRA API,
`add_lora(LoRARequest(name, id, path))`; the previous adapter is removed (`remove_lora`) and
every generation request then carries the new one (`lora_request=`). A new id per version: vLLM
caches adapters by id. Full-weight updates still work with LoRA on (the hybrid start sends the
base weights first): the worker post-processes each layer once, past vLLM's LoRA wrappers
(`vllm_worker.wrappers_skipped`).

Sleep (hybrid placement): level 1 offloads the weights to host memory and drops the KV cache. A
weight update while asleep wakes the weights only; `wake_up()` then restores the KV cache.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import logging

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
from polyrl.rollout.engines.vllm_worker import encode_tensor
from polyrl.rollout.engines.weight_flush import iter_flushes

ALL_TAGS = ("weights", "kv_cache")
logger = logging.getLogger(__name__)


def vllm_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """`vllm.SamplingParams(**kwargs)` for polyrl's sampling. `logprobs=k` returns the sampled
    token's log-prob plus the top k (0: the sampled token's only); vLLM's default
    `logprobs_mode="raw_logprobs"` reports them before temperature / top-p / top-k, which is
    what `TokenOutput.logprobs` promises."""
    wanted = sampling.logprobs or sampling.top_logprobs > 0
    kwargs: dict[str, Any] = {
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "stop": list(sampling.stop),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": sampling.top_logprobs if wanted else None,
        "seed": sampling.seed,
    }
    if sampling.top_k > 0:  # -1 / 0: disabled, vLLM's default (its sentinel moved from -1 to 0)
        kwargs["top_k"] = sampling.top_k
    return {k: v for k, v in kwargs.items() if v is not None}


LORA_PARTS = (".lora_A.", ".lora_B.")


def is_adapter_update(names: Iterable[str]) -> bool:
    """Whether an update is LoRA adapter tensors (all of them) rather than model weights; a mix
    is an error: the adapter path and the weight path cannot be applied together."""
    names = list(names)
    adapter = [n for n in names if any(p in n for p in LORA_PARTS)]
    if adapter and len(adapter) != len(names):
        other = next(n for n in names if not any(p in n for p in LORA_PARTS))
        raise WeightUpdateError(f"an update mixes LoRA adapter tensors ({adapter[0]}) with model "
                                f"weights ({other}); send one or the other")
    return bool(names) and bool(adapter)


def adapter_files(named: Iterable[tuple[str, torch.Tensor]], base_model: str) -> tuple[dict, dict]:
    """(adapter_config.json, adapter_model.safetensors tensors) of a peft LoRA adapter directory
    from adapter tensors whose B already carries alpha / rank (lora_alpha = r: scaling 1).
    The rank is lora_A's first dimension, the target modules the adapted modules' own names."""
    tensors: dict[str, torch.Tensor] = {}
    ranks, targets = set(), set()
    for name, tensor in named:
        if not (name.endswith(".lora_A.weight") or name.endswith(".lora_B.weight")):
            raise WeightUpdateError(f"'{name}' is not a LoRA adapter tensor (.lora_A.weight / .lora_B.weight)")
        module = name.rsplit(".lora_", 1)[0]
        targets.add(module.rsplit(".", 1)[-1])
        if ".lora_A." in name:
            ranks.add(int(tensor.shape[0]))
        tensors[name] = tensor.detach().cpu().contiguous()
    if len(ranks) != 1:
        raise WeightUpdateError(f"LoRA adapter tensors of ranks {sorted(ranks)}: expected one rank")
    r = ranks.pop()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": r, "lora_alpha": r, "target_modules": sorted(targets), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "modules_to_save": None}
    return config, tensors


def lora_request_kwargs(lora_id: int, version: int, path: str) -> dict[str, Any]:
    """`vllm.lora.request.LoRARequest(**kwargs)` for the adapter of `version` at `path`; ids
    start at 1 (vLLM reserves 0 for no adapter)."""
    if lora_id < 1:
        raise ValueError(f"vLLM LoRA ids start at 1, got {lora_id}")
    return {"lora_name": f"polyrl-v{version}", "lora_int_id": lora_id, "lora_path": path}


def _sampled(record: Mapping[int, Any], token: int) -> float:
    if token not in record:
        raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token}")
    return record[token].logprob


def _sleep_mode_available() -> bool:
    """Whether this vLLM build can release memory in sleep() (CUDA / ROCm builds; not CPU)."""
    from vllm.platforms import current_platform

    check = getattr(current_platform, "is_sleep_mode_available", None)
    return bool(check()) if check is not None else True


class VLLMEngine(AsyncEngineAdapter):
    """Implements `polyrl.rollout.base.RolloutEngine` on vLLM's `AsyncLLM`.

    Args:
        launch_args: `AsyncEngineArgs` keyword arguments (`polyrl.rollout.launch_args.vllm_args`).
        tokenizer: True loads the model's tokenizer (for `eos_token_ids` and callers that decode).
        seed: kept for interface parity; per-request seeds are passed through.
        update_bucket_mb: bytes per `load_weights` bucket.
        control_timeout_s: deadline of every control call (start, update, sleep, abort).
    """

    backend = "vllm"

    def __init__(self, launch_args: dict[str, Any], *, tokenizer: Any = True, seed: int = 0,
                 update_bucket_mb: int = 512,
                 control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._init_adapter(launch_args, "model", tokenizer, seed, update_bucket_mb, control_timeout_s)
        self.fp8 = self.launch_args.get("quantization") == "fp8"
        self.lora_adapters = bool(self.launch_args.get("enable_lora"))
        """rollout.lora_mode=adapter: updates of adapter tensors load as a vLLM LoRA adapter."""
        self._lora_request: Any = None
        self._lora_ids = 0
        self._lora_root: str | None = None
        self._warned_sleep = False

        self.sleep_frees_memory = _sleep_mode_available()
        """False on vLLM's CPU build: it refuses `enable_sleep_mode` at start ("Sleep mode is not
        supported on current platform"), so the engine starts without it and sleep() only stops
        generation (weights and KV cache stay resident; host memory is what the trainer uses)."""
        args = dict(self.launch_args)
        if args.get("enable_sleep_mode") and not self.sleep_frees_memory:
            args.pop("enable_sleep_mode")

        async def start():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        self.engine = self._control(start(), "start")

    # --- generation ------------------------------------------------------------------------------
    async def _generate_one(self, prompt: list[int], sampling: SamplingParams,
                            request_id: str) -> list[TokenOutput]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._asleep:
            raise RuntimeError("vLLM engine is sleeping; call wake_up() first")
        params = VLLMSamplingParams(**vllm_sampling_kwargs(sampling),
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        lora = {"lora_request": self._lora_request} if self._lora_request is not None else {}
        async for out in self.engine.generate({"prompt_token_ids": prompt}, params, request_id, **lora):
            final = out
        if final is None:
            raise RuntimeError(f"vLLM returned nothing for request {request_id}")
        wanted = sampling.logprobs or sampling.top_logprobs > 0
        outs = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            logprobs = sampled_logprobs(c.token_ids, c.logprobs, wanted, _sampled)
            top = None
            if sampling.top_logprobs and c.logprobs is not None:
                top = [{tid: lp.logprob for tid, lp in rec.items()} for rec in c.logprobs]
            outs.append(self._output(c.token_ids, logprobs if sampling.logprobs else [],
                                     c.finish_reason, c.text, top))
        return outs

    # --- control ---------------------------------------------------------------------------------
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        items: Iterable[tuple[str, torch.Tensor]] = update_stream(named_tensors, version)
        if self.lora_adapters:  # adapters are small: look at the whole update first
            items = list(items)
            if is_adapter_update(n for n, _ in items):
                self._load_adapter(items, version)
                return

        def named():  # consumed bucket by bucket: a weight stream is never held whole
            for name, tensor in items:
                if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                    raise WeightUpdateError(f"parameter '{name}': expected a floating-point tensor")
                yield name, tensor

        async def push() -> int:
            await self._wake_weights()
            await self.engine.collective_rpc("polyrl_begin_update", args=(self.fp8,))
            for piece in iter_flushes(named(), self.bucket_bytes):
                host = [(n, encode_tensor(t)) for n, t in piece]  # see vllm_worker: bytes travel
                await self.engine.collective_rpc("polyrl_load_bucket", args=(host,))
            loaded = await self.engine.collective_rpc("polyrl_finish_update", args=(version,))
            await self.engine.reset_prefix_cache()
            return loaded

        with partial_update_guard("vLLM", version):
            self._control(push(), f"update_weights to version {version}")
        self._version = version

    def _load_adapter(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the adapter as a peft directory and swap it in through vLLM's LoRA API."""
        import json
        import shutil
        import tempfile
        from pathlib import Path

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        config, tensors = adapter_files(items, self.launch_args["model"])
        if self._lora_root is None:
            self._lora_root = tempfile.mkdtemp(prefix="polyrl-lora-")
        self._lora_ids += 1
        directory = Path(self._lora_root) / f"{self._lora_ids}"
        directory.mkdir()
        (directory / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        request = LoRARequest(**lora_request_kwargs(self._lora_ids, version, str(directory)))
        previous = self._lora_request

        async def swap() -> None:
            await self._wake_weights()
            await self.engine.add_lora(request)
            if previous is not None:
                await self.engine.remove_lora(previous.lora_int_id)
            await self.engine.reset_prefix_cache()  # its KV came from the old adapter

        try:
            self._control(swap(), f"load the LoRA adapter of version {version}")
        except Exception as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise WeightUpdateError(f"vLLM could not load the LoRA adapter of version {version} ({exc}); "
                                    "the previous adapter keeps serving") from exc
        self._lora_request = request
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self._version = version

    async def _wake_weights(self) -> None:
        """Weights must be resident before new ones are loaded into them (sleep frees them)."""
        if "weights" in self._asleep:
            await self.engine.wake_up(tags=["weights"])
            self._asleep.discard("weights")

    def sleep(self) -> None:
        if self.launch_args.get("enable_sleep_mode") and not self.sleep_frees_memory:
            if self._inflight:
                raise RuntimeError(f"cannot sleep with {len(self._inflight)} running requests")
            if not self._warned_sleep:
                logger.warning("this vLLM build has no sleep mode (CPU): sleep() keeps the weights "
                               "and KV cache resident and only stops generation until wake_up()")
                self._warned_sleep = True
            self._sleeping = True
            return
        if not self.launch_args.get("enable_sleep_mode"):
            raise RuntimeError("vLLM was started without enable_sleep_mode (standalone placement); "
                               "set rollout.engine_kwargs.vllm.enable_sleep_mode=true to use sleep()")
        if self._inflight:
            raise RuntimeError(f"cannot sleep with {len(self._inflight)} running requests; let them "
                               "finish or call abort_all() first")
        self._control(self.engine.sleep(level=1), "sleep")
        self._asleep = set(ALL_TAGS)
        self._sleeping = True

    def wake_up(self) -> None:
        if self._asleep:
            self._control(self.engine.wake_up(tags=sorted(self._asleep)), "wake_up")
        self._asleep.clear()
        self._sleeping = False

    def abort_all(self) -> int:
        # re-sent until each request has ended: vLLM registers an id only after input processing
        return self._abort_until_ended(self.engine.abort)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.engine = None  # collected now, not in interpreter teardown (its __del__ shuts down again)
        if self._lora_root is not None:
            import shutil

            shutil.rmtree(self._lora_root, ignore_errors=True)
        super().shutdown()
