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
`polyrl.weights.fp8.quantize_named_tensors` and load through vLLM's own layerwise reload
(`vllm_worker.PolyrlWorkerExtension`), which exists from vLLM 0.16.0: the FP8 floor declared in
`polyrl/backends.py`, below which FP8 is refused in one line. Buckets travel as host bytes plus dtype and shape
(`vllm_worker.encode_tensor`): vLLM's RPC serializer does not hand untyped tensor arguments back
as tensors, and copies through host memory anyway.

LoRA adapter path (`rollout.lora_mode=adapter`; the launch arguments carry `enable_lora`): the
engine reads the base model from disk once, and an update made only of adapter tensors
(`polyrl.training.lora.adapter_named_tensors`: peft's names, B pre-scaled by alpha / rank) is
written as a peft adapter directory (`adapter_files`) and loaded with vLLM's public LoRA API,
`add_lora(LoRARequest(name, id, path))`; the previous adapter is removed (`remove_lora`) and
every generation request then carries the new one (`lora_request=`). A new id per version: vLLM
caches adapters by id. Full-weight updates still work with LoRA on (the colocated start sends the
base weights first): the worker post-processes each layer once, past vLLM's LoRA wrappers
(`vllm_worker.wrappers_skipped`).

Image prompts (Qwen2-VL / Qwen2.5-VL, issue #31; vLLM >= 0.17.0, the images floor declared in
`polyrl/backends.py`, below which an image prompt is refused in one line): `images=` takes the prompt's `ImageInputs`
(polyrl/data/multimodal.py), whose ids already hold the processor's expanded `<|image_pad|>`
runs. They go to vLLM as an already-processed multimodal input (`vllm_image_prompt`: the ids
unchanged, the processor's `pixel_values` / `image_grid_thw` as the model's keyword items, one
placeholder range per run), so vLLM's HF processor never runs and the engine sees exactly the
trainer's ids and pixels (no re-tokenization, no second resize). Each image's hash carries the
weight version: vLLM caches vision-tower outputs by that hash, and a weight update must not
serve embeddings of the old tower. The trainer's names (`model.visual.*`,
`model.language_model.*`) are mapped by vLLM's own Qwen2-VL loader (`hf_to_vllm_mapper`).

Routes (actor.router_replay=R3, vLLM >= 0.14.0, GPU builds): an engine started with
`enable_return_routed_experts` returns `CompletionOutput.routed_experts` for every finished
sample, which becomes `TokenOutput.extra["routed_experts"]` (routed_experts.py). vLLM's CPU build
cannot record them (Model Runner V2 needs Triton): asking it is one line before vLLM starts.

Sleep (colocated placement): level 1 offloads the weights to host memory and drops the KV cache. A
weight update while asleep wakes the weights only; `wake_up()` then restores the KV cache.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import json
import logging
from pathlib import Path

import torch

from polyrl.rollout.base import RolloutInputError, SamplingParams, TokenOutput, WeightUpdateError
from polyrl.rollout.engines.common import (
    DEFAULT_CONTROL_TIMEOUT_S,
    AsyncEngineAdapter,
    NamedTensors,
    partial_update_guard,
    sampled_logprobs,
    update_stream,
)
from polyrl.backends import feature_platform_problem
from polyrl.rollout.engines.routed_experts import ENGINE_FLAG, asked_routes, response_routes
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


def image_spec(model_path: str) -> tuple[int, int] | None:
    """(image_token_id, spatial_merge_size) of a Qwen2-VL-shaped model directory; None for a
    text-only model (no `vision_config`) or a model name that is not a local directory."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    vision = config.get("vision_config")
    if not isinstance(vision, dict) or "image_token_id" not in config:
        return None
    return int(config["image_token_id"]), int(vision.get("spatial_merge_size", 2))


def image_launch_args(args: Mapping[str, Any], engine_args_cls: Any) -> dict[str, Any]:
    """What a vision-language model's engine needs on top of its launch arguments.

    vLLM >= 0.32 normalizes Qwen2-VL pixels on the device by default (`mm_device_do_normalize`:
    its processor then sends raw uint8 pixels, and the vision tower's input norm rescales them).
    polyrl sends the processor's pixel_values, already normalized as the trainer's forward
    reads them, so the engine must not normalize them again. Releases without the field
    normalize in the processor only: nothing to add."""
    import dataclasses

    fields = ({f.name for f in dataclasses.fields(engine_args_cls)}
              if dataclasses.is_dataclass(engine_args_cls) else set())
    if "mm_device_do_normalize" not in fields:
        return {}
    if args.get("mm_device_do_normalize"):
        raise ValueError("rollout.engine_kwargs.vllm.mm_device_do_normalize=true would normalize image pixels "
                         "a second time (polyrl sends the processor's normalized pixel_values); remove it")
    return {"mm_device_do_normalize": False}


def image_placeholder_ranges(prompt: list[int], images: Any, image_token_id: int,
                             merge_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each image's `<|image_pad|>` run in the prompt ids, checked against
    the image grids: image i needs t*h*w / merge_size**2 consecutive pad tokens, in order, and
    the ids hold no other pad tokens (what Hugging Face's processor writes)."""
    pixel_values, grid = getattr(images, "pixel_values", None), getattr(images, "image_grid_thw", None)
    if not isinstance(pixel_values, torch.Tensor) or not isinstance(grid, torch.Tensor):
        raise RolloutInputError("images", f"expected ImageInputs (pixel_values, image_grid_thw), got "
                                f"{type(images).__name__}")
    if grid.dim() != 2 or grid.shape[1] != 3 or bool((grid[:, 1:] % merge_size != 0).any()):
        raise RolloutInputError("images", f"image_grid_thw must be (images, 3) with height and width "
                                f"multiples of spatial_merge_size={merge_size}")
    patches = int(grid.prod(dim=1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != patches:
        raise RolloutInputError("images", f"pixel_values has shape {tuple(pixel_values.shape)}; the grids "
                                f"describe {patches} patches")
    counts = [int(n) // merge_size**2 for n in grid.prod(dim=1)]
    pads = [i for i, t in enumerate(prompt) if t == image_token_id]
    ranges, k = [], 0
    for n in counts:
        run = pads[k:k + n]
        if len(run) != n or run[-1] - run[0] != n - 1:
            break
        ranges.append((run[0], n))
        k += n
    if len(ranges) != len(counts) or k != len(pads):
        raise RolloutInputError("images", f"prompt_ids hold {len(pads)} image placeholder tokens, the images "
                                f"need runs of {counts} (expand each image as the processor does)")
    return ranges


def vllm_image_prompt(prompt: list[int], images: Any, image_token_id: int, merge_size: int,
                      version: int) -> dict[str, Any]:
    """vLLM's already-processed multimodal input (`vllm.inputs.engine.MultiModalInput`, a dict
    of type "multimodal") for ids that hold expanded placeholders and their `ImageInputs`.

    The fields are laid out as vLLM's Qwen2-VL processor lays them out
    (vllm/model_executor/models/qwen2_vl.py, `_create_qwen2vl_field_factory`): `pixel_values`
    cut per image by its patch count, `image_grid_thw` one row per image, kept on the CPU.
    vLLM computes the M-RoPE positions from the grids and placeholder offsets itself."""
    from transformers import BatchFeature
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems, PlaceholderRange

    from polyrl.rollout.native.vision import image_digest

    ranges = image_placeholder_ranges(prompt, images, image_token_id, merge_size)
    grid = images.image_grid_thw.detach().to("cpu", torch.int64)
    pixels = images.pixel_values.detach().to("cpu")
    sizes = grid.prod(dim=1)
    fields = {"pixel_values": MultiModalFieldConfig.flat_from_sizes("image", sizes),
              "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True)}
    items = MultiModalKwargsItems.from_hf_inputs(
        BatchFeature({"pixel_values": pixels, "image_grid_thw": grid}), fields)
    starts = [0] + torch.cumsum(sizes, 0).tolist()
    # the version in the hash: vLLM's encoder cache reuses a vision-tower output by hash
    hashes = [f"{image_digest(pixels[starts[i]:starts[i + 1]], grid[i])}-v{version}" for i in range(len(ranges))]
    return {"type": "multimodal", "prompt_token_ids": prompt, "mm_kwargs": items,
            "mm_hashes": {"image": hashes},
            "mm_placeholders": {"image": [PlaceholderRange(offset=o, length=n) for o, n in ranges]}}


def _sampled(record: Mapping[int, Any], token: int) -> float:
    if token not in record:
        raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token}")
    return record[token].logprob


def _cpu_build() -> bool:
    """Whether this is vLLM's CPU build (its own platform says)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def check_routes_platform(launch_args: Mapping[str, Any], cpu_build: bool) -> None:
    """One line (ValueError) when routes are asked of vLLM's CPU build, before vLLM refuses them
    with a traceback from its config ("AuxOutput Connector requires Model Runner V2", then
    "Model Runner V2 requires Triton")."""
    if launch_args.get(ENGINE_FLAG) and cpu_build:
        raise ValueError(feature_platform_problem(
            "vllm", "routed_experts", "cpu", f"{ENGINE_FLAG}=true",
            "run vLLM's GPU build for actor.router_replay=R3, or rollout.backend=native"))


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
        self.image_spec = image_spec(self.model_path)
        """(image_token_id, spatial_merge_size) of a vision-language model, else None."""
        from polyrl.backends import feature_version_problem, installed_engine_version

        self.images_problem = feature_version_problem("vllm", "images", installed_engine_version("vllm"),
                                                      "images")
        """One line when this vLLM is below the version floor for image prompts, else None."""
        if self.image_spec is not None:
            args.update(image_launch_args(args, AsyncEngineArgs))
        check_routes_platform(args, _cpu_build())
        self.routes = asked_routes(args, "vllm", installed_engine_version("vllm"), self.model_path)
        """Where the model's routes sit in vLLM's rows when the engine records them
        (`enable_return_routed_experts`, for actor.router_replay=R3), else None."""

        async def start():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        self.engine = self._control(start(), "start")

    # --- generation ------------------------------------------------------------------------------
    def _check_images(self, prompt: list[int], images: Any) -> Any:
        if self.image_spec is None:
            if images is not None:
                raise RolloutInputError("images", "this model is text-only; serve a vision-language model "
                                        "(Qwen2-VL, Qwen2.5-VL) for image prompts")
            return None
        token, merge = self.image_spec
        if images is None:
            if token in prompt:
                raise RolloutInputError("images", "prompt_ids hold image placeholder tokens but no images "
                                        "were given")
            return None
        if self.images_problem:  # below the floor polyrl/backends.py declares for images
            raise RolloutInputError("images", self.images_problem)
        image_placeholder_ranges(prompt, images, token, merge)
        return images

    async def _generate_one(self, prompt: list[int], sampling: SamplingParams,
                            request_id: str, images: Any = None) -> list[TokenOutput]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._asleep:
            raise RuntimeError("vLLM engine is sleeping; call wake_up() first")
        params = VLLMSamplingParams(**vllm_sampling_kwargs(sampling),
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        lora = {"lora_request": self._lora_request} if self._lora_request is not None else {}
        if images is not None:
            assert self.image_spec is not None  # _check_images let them through
            engine_input: dict[str, Any] = vllm_image_prompt(prompt, images, *self.image_spec, self._version)
        else:
            engine_input = {"prompt_token_ids": prompt}
        async for out in self.engine.generate(engine_input, params, request_id, **lora):
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
            out = self._output(c.token_ids, logprobs if sampling.logprobs else [], c.finish_reason, c.text, top)
            rows = getattr(c, "routed_experts", None) if self.routes is not None else None
            if rows is not None:  # the whole sequence's rows, prompt included (routed_experts.py)
                out.extra["routed_experts"] = response_routes(rows, len(prompt), len(c.token_ids), self.routes,
                                                              "vLLM")
            outs.append(out)
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
            raise RuntimeError("vLLM was started without enable_sleep_mode (disaggregated placement); "
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
