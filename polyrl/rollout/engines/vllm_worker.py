"""The vLLM worker extension polyrl's vLLM adapter names in `worker_extension_cls`.

vLLM mixes this class into each of its workers (so `self.model_runner`, `self.device` and
`self.model_config` are the worker's) and calls its methods through `collective_rpc`; see vLLM's
`examples/offline_inference/rlhf_utils.py` for the pattern. Every tensor-parallel worker gets
the whole HF-named bucket and `load_weights` keeps its own shard. Imported only inside vLLM's
worker processes: nothing here runs on import.

How tensors travel: `collective_rpc` arguments cross vLLM's msgpack serializer (front end ->
engine core process). Its tensor encoding is only decoded back into a tensor where a type hint
asks for one; untyped RPC arguments arrive as `[dtype, shape, buffer]` lists, whose buffer may
even be an index into side buffers the RPC never hands over. So the adapter sends each tensor as
plain bytes plus its dtype name and shape (`encode_tensor`), which every vLLM release carries
unchanged, and `decode_tensor` here rebuilds it (a tensor is still accepted, for a serializer
that passes tensors through).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def encode_tensor(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """(dtype name, shape, raw bytes) of a tensor; plain msgpack types only."""
    host = tensor.detach().to("cpu").contiguous()
    dtype = str(host.dtype).removeprefix("torch.")
    data = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return dtype, list(host.shape), data


def decode_tensor(encoded: Any) -> torch.Tensor:
    """The tensor `encode_tensor` made (or a tensor, passed through)."""
    if isinstance(encoded, torch.Tensor):
        return encoded
    if not (isinstance(encoded, (list, tuple)) and len(encoded) == 3 and isinstance(encoded[0], str)
            and isinstance(encoded[2], (bytes, bytearray, memoryview))):
        raise TypeError(f"expected (dtype, shape, bytes) for a tensor, got {type(encoded).__name__}")
    dtype_name, shape, data = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown tensor dtype '{dtype_name}'")
    if len(data) == 0:
        return torch.empty(list(shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(list(shape))


def restore_packed_linear_weights(model: Any) -> int:
    """Give back the linear layers' weight parameters that vLLM's CPU build dropped.

    On CPU, `process_weights_after_loading` packs each linear weight for oneDNN / its own GEMM
    kernels and replaces `layer.weight` with an empty parameter (no weight loader), so a second
    `load_weights` fails ("Attempted to load weight ... into parameter (torch.Size([0]))"). The
    layer's own quant method re-creates the parameter exactly as at construction; the next
    `process_weights_after_loading` packs the new weights. A no-op on GPU builds (nothing is
    dropped). Returns how many layers were restored."""
    try:
        from vllm.model_executor.layers import linear
    except ImportError:
        return 0
    v2 = getattr(linear, "WEIGHT_LOADER_V2_SUPPORTED", [])
    restored = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(module, linear.LinearBase) and isinstance(weight, torch.Tensor)
                and weight.numel() == 0 and hasattr(module, "cpu_linear")):
            continue
        replicated = isinstance(module, linear.ReplicatedLinear)
        loader = (module.weight_loader_v2 if not replicated and hasattr(module, "weight_loader_v2")
                  and module.quant_method.__class__.__name__ in v2 else module.weight_loader)
        # built on a bare holder, then put in place: under LoRA some layers expose `weight`
        # as a class attribute, which register_parameter refuses to shadow
        holder = torch.nn.Module()
        module.quant_method.create_weights(
            layer=holder,
            input_size_per_partition=getattr(module, "input_size_per_partition", module.input_size),
            output_partition_sizes=module.output_partition_sizes, input_size=module.input_size,
            output_size=module.output_size, params_dtype=weight.dtype, weight_loader=loader)
        module._parameters["weight"] = holder.weight
        restored += 1
    return restored


def forwarded_quant_methods(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose `quant_method` is not their own but reached through `__getattr__`.

    With `enable_lora`, vLLM wraps each linear layer in a LoRA layer (vllm/lora/layers/base.py,
    `BaseLayerWithLoRA.__getattr__`) that forwards every public attribute it lacks to its
    `base_layer`, `quant_method` included. vLLM's `process_weights_after_loading`
    (vllm/model_executor/model_loader/utils.py) post-processes every module of
    `model.named_modules()` that answers `quant_method`, so it meets each linear layer twice:
    as the wrapper, then as its base layer. A module owning `quant_method` (an instance or class
    attribute, or a submodule: an MoE layer's `FusedMoEMethodBase` is an `nn.Module`, registered in
    `_modules`) is a real layer; one that only forwards it is a wrapper."""
    found = []
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        if ("quant_method" in vars(module) or "quant_method" in module._modules
                or any("quant_method" in vars(c) for c in type(module).__mro__)):
            continue
        found.append(module)
    return found


@contextlib.contextmanager
def wrappers_skipped(model: torch.nn.Module) -> Iterator[int]:
    """For the duration, the LoRA wrappers answer `quant_method = None`, so vLLM's
    `process_weights_after_loading` post-processes each layer once, as its base layer.

    Why: on the CPU build, processing the wrapper runs `dispatch_cpu_unquantized_gemm(wrapper,
    remove_weight=True)` (vllm/model_executor/layers/utils.py), whose `layer.weight =
    nn.Parameter(...)` cannot replace the wrapper's read-only `weight` property
    (vllm/lora/layers/base_linear.py): `KeyError: "attribute 'weight' already exists"`, every
    layer after it left unpacked. On any build, processing a wrapper would post-process its base
    layer's weights a second time (a GPU FP8 method would requantize them). vLLM itself never
    meets this: it post-processes at load, before it wraps the layers for LoRA. Only the
    instances' own attribute dictionaries change, and they are restored on exit. Yields how
    many wrappers were skipped."""
    wrappers = forwarded_quant_methods(model)
    for module in wrappers:
        object.__setattr__(module, "quant_method", None)
    try:
        yield len(wrappers)
    finally:
        for module in wrappers:
            vars(module).pop("quant_method", None)


def cpu_packed_expert_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """(MoE layer, its experts kernel) for each expert layer vLLM serves with its CPU grouped-gemm
    kernel (`CPUUnquantizedExperts`, vllm/model_executor/layers/fused_moe/experts/cpu_moe.py), the
    kernel that prepacks `w13_weight` / `w2_weight`. Empty on a vLLM without that module and on
    any build that picked another experts kernel (the GPU ones), so the repack below is gated on
    the kernel the installed vLLM actually chose. LoRA wrappers that only forward `quant_method`
    are skipped: their base layer is met on its own."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    wrappers = {id(m) for m in forwarded_quant_methods(model)}
    found = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if (id(module) not in wrappers and isinstance(experts, CPUUnquantizedExperts)
                and isinstance(getattr(module, "w13_weight", None), torch.Tensor)):
            found.append((module, experts))
    return found


def unpack_cpu_experts(layers: list[tuple[torch.nn.Module, Any]]) -> None:
    """Before a sync: give each CPU-packed expert layer plain `w13_weight` / `w2_weight` parameters
    of their construction shape (gate+up rows, unpadded), keeping the old ones' attributes (their
    weight loader).

    Why: the CPU kernel's first `process_weights_after_loading` pads the intermediate size and
    replaces both with a prepacked grouped-gemm layout. On an update vLLM 0.32's unquantized MoE
    method (`_setup_kernel`, fused_moe/unquantized_fused_moe_method.py) sees `moe_kernel` already
    built (`is_weight_update`) and skips the experts' own post-processing, so the loaders would
    write plain rows into the packed tensors and the kernel would read them as packed (the
    log-prob gap after one sync of unchanged weights was 6.2e-2, docs/moe.md "vLLM"). Every
    expert is rewritten by the sync (polyrl syncs whole models, as for the linear layers in
    `restore_packed_linear_weights`); `repack_cpu_experts` packs them again afterwards."""
    for module, experts in layers:
        cfg = experts.moe_config
        num_experts, _, hidden = module.w13_weight.shape  # padding changes only the intermediate size
        inter = cfg.intermediate_size_per_partition
        shapes = {"w13_weight": (num_experts, (2 if cfg.is_act_and_mul else 1) * inter, hidden),
                  "w2_weight": (num_experts, hidden, inter)}
        for name, shape in shapes.items():
            old = module._parameters[name]
            fresh = torch.nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=False)
            fresh.__dict__.update(old.__dict__)
            module._parameters[name] = fresh


def repack_cpu_experts(layers: list[tuple[torch.nn.Module, Any]]) -> None:
    """After vLLM's own post-processing of a sync: run the CPU experts kernel's post-load step (pad,
    prepack) that vLLM skips on a weight update (see `unpack_cpu_experts`)."""
    for module, experts in layers:
        experts.process_weights_after_loading(module)


def layerwise_reload_api() -> tuple[Any, Any] | None:
    """(initialize_layerwise_reload, finalize_layerwise_reload) of this vLLM (>= 0.16), else None."""
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


class PolyrlWorkerExtension:
    def polyrl_begin_update(self, fp8: bool) -> None:
        """Start a version: FP8 rollout quantizes every bucket here (the receiving side).

        FP8 goes through vLLM's own reload, as its workers' `reload_weights` / `update_weights`
        do it: `initialize_layerwise_reload` puts back the checkpoint-format parameters and
        their weight loaders (FP8 post-processing replaced them with kernel-format ones), each
        layer is processed as its last weight arrives, `finalize_layerwise_reload` processes the
        rest. A vLLM without it (< VLLM_FP8_RELOAD_SINCE) would assert in its weight loaders at
        the first FP8 update: refused here in one line (pre-flight refuses it first)."""
        self._polyrl_fp8 = bool(fp8)
        self._polyrl_loaded = 0
        self._polyrl_layerwise = None
        self._polyrl_cpu_experts = []
        if self._polyrl_fp8:
            api = self._polyrl_reload_api()
            if api is None:
                from polyrl.backends import VLLM_FP8_RELOAD_SINCE

                raise RuntimeError(f"rollout.quantization=fp8: this vLLM has no layerwise weight reload, "
                                   f"which FP8 weight updates need: pip install \"vllm>={VLLM_FP8_RELOAD_SINCE}\"")
            with torch.device(self.device):
                api[0](self.model_runner.model)
            self._polyrl_layerwise = api
            return
        restore_packed_linear_weights(self.model_runner.model)
        self._polyrl_cpu_experts = cpu_packed_expert_layers(self.model_runner.model)
        unpack_cpu_experts(self._polyrl_cpu_experts)

    def _polyrl_reload_api(self) -> tuple[Any, Any] | None:
        return layerwise_reload_api()

    def polyrl_load_bucket(self, named: list[tuple[str, Any]]) -> int:
        """Load one bucket of HF-named tensors (as `encode_tensor` sent them) into the worker's
        model; returns how many."""
        weights = [(name, decode_tensor(tensor).to(self.device, non_blocking=True)) for name, tensor in named]
        if getattr(self, "_polyrl_fp8", False):
            from polyrl.weights.fp8 import quantize_named_tensors

            weights = list(quantize_named_tensors(weights))
        # a layerwise reload materializes each finished layer on the current default device
        with torch.device(self.device) if getattr(self, "_polyrl_layerwise", None) else contextlib.nullcontext():
            self.model_runner.model.load_weights(weights=weights)
        self._polyrl_loaded = getattr(self, "_polyrl_loaded", 0) + len(weights)
        return len(weights)

    def polyrl_finish_update(self, version: int) -> int:
        """Post-process the loaded weights (FP8 layers repack here); returns tensors loaded."""
        model = self.model_runner.model
        layerwise = getattr(self, "_polyrl_layerwise", None)
        if layerwise is not None:
            with torch.device(self.device):
                layerwise[1](model, self.model_config)
            self._polyrl_layerwise = None
        else:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            with wrappers_skipped(model):  # enable_lora: each layer once (see wrappers_skipped)
                process_weights_after_loading(model, self.model_config, self.device)
            repack_cpu_experts(getattr(self, "_polyrl_cpu_experts", []))
            self._polyrl_cpu_experts = []
        self._polyrl_version = version
        return getattr(self, "_polyrl_loaded", 0)
