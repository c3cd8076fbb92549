"""LoRA on `peft`: adapters on the policy, merged weights for the engines, the base model as the
reference policy, adapter checkpoints and exports (docs/training.md, "LoRA").

Why these pieces and not more: with peft's LoRA layers the base weights stay frozen in place, so
- the optimizer sees only the adapter parameters (its state shrinks with them);
- the reference policy is the same module with the adapters switched off (`adapters_disabled`),
  no second copy of the model;
- rollout engines that know nothing of LoRA get full weights under their Hugging Face names with
  the adapters folded in (`merged_named_weights`), one tensor at a time so a sync never holds a
  merged copy of the whole model;
- a checkpoint needs only the adapter (`save_adapter` / `load_adapter`), the base being the
  unchanged `model.path`.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from polyrl.training import sharded_load
from polyrl.training.lora_config import LoraConfig

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_DIR = "policy_adapter"
"""Where a training checkpoint keeps the adapter (beside the merged `policy/`)."""


class LoraError(ValueError):
    """A LoRA setting that cannot apply to this model; the message names the key and the fix."""


def linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _output_head(model: torch.nn.Module) -> str | None:
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def check_lora_fits(hf_config: Any, cfg: LoraConfig, trust_remote_code: bool = False) -> None:
    """The layer checks `apply_lora` makes in every rank, made on the model built from its
    transformers config on the meta device: module names and shapes exist, no weight is read or
    allocated (milliseconds). Raises LoraError; what `from_config` raises for a model transformers
    does not know passes through. For the pre-flight of `polyrl train` and `polyrl sft`."""
    from polyrl.training import vlm

    with torch.device("meta"):
        model = vlm.model_class(hf_config).from_config(hf_config, trust_remote_code=trust_remote_code)
    lora_targets(model, cfg)


def targeted_layers(model: torch.nn.Module, cfg: LoraConfig) -> dict[str, torch.nn.Linear]:
    """The linear layers `cfg` puts adapters on; raises LoraError naming model.lora_target_modules
    (with the names that exist) or model.lora_rank (with the layers it does not fit)."""
    return lora_targets(model, cfg)[0]


# The fused expert tensors of transformers 5's mixture-of-experts blocks (Qwen3-MoE, Qwen2-MoE,
# docs/moe.md): `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate and up rows) and
# `mlp.experts.down_proj` [E, H, I]. A target name of the per-expert projections selects them.
_FUSED_EXPERTS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def fused_experts(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The fused expert tensors by full parameter name (none in a dense model)."""
    return {name: p for name, p in model.named_parameters()
            if p.ndim == 3 and name.rpartition(".")[2] in set(_FUSED_EXPERTS.values())}


def lora_targets(model: torch.nn.Module, cfg: LoraConfig
                 ) -> tuple[dict[str, torch.nn.Linear], dict[str, torch.nn.Parameter]]:
    """(linear layers, fused expert tensors) that `cfg` puts adapters on, by full name. all-linear:
    every linear layer but the output head (and a frozen vision tower), and every expert tensor;
    a list: the linear layers of those names, and the expert tensors they name (gate_up_proj,
    down_proj, or the per-expert names: gate_proj with up_proj, down_proj). Raises LoraError
    naming the key and the fix."""
    layers = linear_layers(model)
    experts = fused_experts(model)
    short_names = sorted({name.rpartition(".")[2] for name in (*layers, *experts)})
    if cfg.lora_target_modules == "all-linear":
        from polyrl.training import vlm

        head = _output_head(model)
        # peft's all-linear keeps the head out; a vision-language model's frozen tower too (training/vlm.py)
        frozen = vlm.lora_excluded(model, getattr(cfg, "train_vision_tower", False))
        # an MoE block's gates take none, as its router (not a linear layer) takes none: Qwen2-MoE's
        # shared_expert_gate has one output, so no rank above 1 fits it
        gates = {n for n in layers if experts and n.endswith("_gate")}
        chosen = {n: m for n, m in layers.items() if n != head and n not in frozen and n not in gates}
        chosen_experts = dict(experts)
    else:
        targets = list(cfg.lora_target_modules)
        if experts and ("gate_proj" in targets) != ("up_proj" in targets):
            named, other = ("gate_proj", "up_proj") if "gate_proj" in targets else ("up_proj", "gate_proj")
            raise LoraError(f"model.lora_target_modules: this mixture-of-experts model holds each expert's "
                            f"gate_proj and up_proj as one tensor (mlp.experts.gate_up_proj), so '{named}' "
                            f"needs '{other}' beside it; name both or neither")
        chosen, chosen_experts = {}, {}
        for target in targets:
            hits = {n: m for n, m in layers.items() if n == target or n.endswith("." + target)}
            fused = _FUSED_EXPERTS.get(target, target)
            expert_hits = {n: p for n, p in experts.items() if n == fused or n.endswith("." + fused)}
            if not hits and not expert_hits:
                raise LoraError(f"model.lora_target_modules: '{target}' matches no linear layer of "
                                f"this model; its linear layers are named {', '.join(short_names)} "
                                "(or use all-linear)")
            chosen.update(hits)
            chosen_experts.update(expert_hits)
    if not chosen and not chosen_experts:
        raise LoraError("model.lora_target_modules: no linear layer to adapt; linear layers of this "
                        f"model: {', '.join(short_names) or '(none)'}")
    if (chosen_experts or _through_weight(chosen, experts)) and cfg.lora_dropout > 0:
        raise LoraError(f"model.lora_dropout={cfg.lora_dropout}: peft's adapters on a mixture-of-experts "
                        "model's fused expert tensors (and the MLPs beside them) take no dropout; set "
                        "model.lora_dropout=0")
    sides = {f"{n.rpartition('.')[2]} ({m.in_features}x{m.out_features})": min(m.in_features, m.out_features)
             for n, m in chosen.items()}
    sides.update({f"experts.{n.rpartition('.')[2]} ({p.shape[2]}x{p.shape[1]})": min(p.shape[1:])
                  for n, p in chosen_experts.items()})
    too_small = sorted(name for name, side in sides.items() if cfg.lora_rank > side)
    if too_small:
        raise LoraError(f"model.lora_rank={cfg.lora_rank} is larger than layer(s) {', '.join(too_small)} "
                        "(a rank can be at most the smaller side); lower model.lora_rank or leave "
                        "those out of model.lora_target_modules")
    return chosen, chosen_experts


def peft_lora_config(model: torch.nn.Module, cfg: LoraConfig, layers: dict[str, torch.nn.Linear],
                     experts: dict[str, torch.nn.Parameter]) -> Any:
    """peft's LoraConfig for exactly `layers, experts = lora_targets(model, cfg)`.

    With transformers 5, peft rewrites a target module whose name ends in gate_proj / up_proj /
    down_proj on a Qwen3-MoE / Qwen2-MoE into the fused expert tensors (`target_parameters`), on
    every get_peft_model and every PeftModel.from_pretrained of a saved adapter; a dense MLP's
    projections of those names (a layer of `mlp_only_layers` / `decoder_sparse_step`, Qwen2-MoE's
    shared expert) would get no adapter. So on a model with fused experts those linear layers
    are targeted through their weight (`target_parameters`, peft's `ParamWrapper`: W + B @ A x
    alpha / rank, the same factors and saved names as a LoRA linear layer), which peft leaves as
    it is, and the experts by their full names. The experts' gate_up_proj holds two projections
    (gate and up), so it gets rank 2r at alpha 2 x alpha (the same scaling), as peft gives it."""
    import peft

    through_weight = _through_weight(layers, fused_experts(model))
    rank_pattern, alpha_pattern = {}, {}
    for name in experts:
        if name.endswith(".gate_up_proj"):
            rank_pattern[name], alpha_pattern[name] = 2 * cfg.lora_rank, 2 * cfg.alpha
    # full module paths, not short names: what we validated is exactly what peft adapts
    return peft.LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.alpha, lora_dropout=cfg.lora_dropout, bias="none",
        target_modules=sorted(set(layers) - through_weight),
        target_parameters=sorted([*experts, *(f"{n}.weight" for n in through_weight)]) or None,
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)


def _through_weight(layers: dict[str, torch.nn.Linear], experts: dict) -> set[str]:
    """The linear layers peft would rewrite into a fused expert tensor (see peft_lora_config)."""
    return {n for n in layers if experts and n.rpartition(".")[2] in _FUSED_EXPERTS}


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> Any:
    """`model` wrapped by peft with adapters on the targeted layers; only adapter parameters
    require grad. The adapters start as a no-op (B = 0), so the first policy is the base model."""
    import peft

    if not cfg.enabled:
        raise LoraError("apply_lora needs model.lora_rank > 0")
    layers, experts = lora_targets(model, cfg)
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        # peft matches rank_pattern against the adapted modules' names only, so it warns that the
        # experts' gate_up_proj entries were ignored while it applies them (adapted_targets and
        # tests/training/test_moe_lora_dense_layers.py check the ranks)
        warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
        wrapped = peft.get_peft_model(model, peft_lora_config(model, cfg, layers, experts))
    if sharded_load.is_deferred(model):  # peft moved its adapters to the meta device: values to fill
        sharded_load.set_initial_values(model, _adapter_init(wrapped.get_base_model(), rng))
    for name, param in wrapped.named_parameters():
        if param.requires_grad and "lora_" not in name:  # peft's contract; fail loudly if it changes
            raise LoraError(f"peft left a base parameter trainable: {name}")
    adapted, wanted = adapted_targets(wrapped), {*layers, *experts}
    if adapted != wanted:  # peft rewrote a target (see peft_lora_config); fail loudly
        raise LoraError(f"peft adapted {sorted(adapted - wanted)[:4]} and not {sorted(wanted - adapted)[:4]} of "
                        "model.lora_target_modules (a peft version that renames targets?)")
    return wrapped


def adapted_targets(model: torch.nn.Module) -> set[str]:
    """Full names (as in the base model) of the linear layers and expert tensors holding an adapter."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    out = set()
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer):
            continue
        owner = name.replace(".base_layer", "")  # every level of a nested wrapper
        if isinstance(module, ParamWrapper) and module.parameter_name != "weight":
            out.add(f"{owner}.{module.parameter_name}")
        else:
            out.add(owner)
    return out


def _adapter_init(model: torch.nn.Module, rng: torch.Tensor) -> dict[str, torch.Tensor]:
    """The adapter values peft draws when it wraps a loaded model, drawn again from the RNG
    state it started from (`rng`), in its order: per adapted layer, `lora_A` and `lora_B` built
    as `nn.Linear` (each drawing its default init), then `reset_lora_parameters` draws A again
    and zeroes B. On a meta model peft draws the same values and then moves them to the meta
    device; tests/training/test_sharded_load.py checks these equal a loaded model's, and
    tests/training/test_moe_lora_dense_layers.py an MoE model's (experts and dense MLPs)."""
    import math

    from peft.tuners.lora import LoraLayer, ParamWrapper

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    # peft draws the target modules' adapters first, then the target parameters' (ParamWrapper:
    # fused experts, an MoE model's dense MLPs) module by module, a nested wrapper's innermost first
    wrapped: dict[str, list] = {}
    for name, layer in layers:
        if isinstance(layer, ParamWrapper):
            wrapped.setdefault(name.replace(".base_layer", ""), []).insert(0, (name, layer))
    order = [(n, m) for n, m in layers if not isinstance(m, ParamWrapper)] + \
        [entry for chain in wrapped.values() for entry in chain]
    out: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng)
        for name, layer in order:
            for adapter, meta_a in layer.lora_A.items():
                meta_b = layer.lora_B[adapter]
                # the meta factors' shapes: [r, in] / [out, r], or an expert tensor's [r x E, in] / [out, r x E]
                a = torch.nn.Linear(meta_a.weight.shape[1], meta_a.weight.shape[0], bias=False)
                torch.nn.Linear(meta_b.weight.shape[1], meta_b.weight.shape[0], bias=False)  # its draw, then zeroed
                torch.nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
                out[f"{name}.lora_A.{adapter}.weight"] = a.weight.detach().to(meta_a.weight.dtype)
                out[f"{name}.lora_B.{adapter}.weight"] = torch.zeros(meta_b.weight.shape, dtype=meta_b.weight.dtype)
    return out


def is_lora(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # no PeftModel can exist before peft is imported: never import it here
    return peft is not None and isinstance(model, peft.PeftModel)


def is_lora_layer(module: torch.nn.Module | None) -> bool:
    """Whether `module` is one of peft's LoRA layers (a wrapped linear layer: `base_layer`,
    `lora_A`, `lora_B`)."""
    peft = sys.modules.get("peft")  # as is_lora: never import it here
    return peft is not None and module is not None and isinstance(module, peft.tuners.lora.LoraLayer)


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer gets: the parameters that require grad (the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def _merge_plan(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, Any]]:
    """(Hugging Face name, base parameter, the LoRA layer to fold in or None) in the order of the
    base model's `named_parameters`, lora tensors left out."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and leaf != "weight":  # a mixture-of-experts' fused experts
            yield _expert_plan(adapted, owner, leaf, param)
            continue
        module_name = owner.removesuffix(".base_layer")
        layer = adapted.get(module_name) if owner.endswith(".base_layer") else None
        hf_name = f"{module_name}.{leaf}" if layer is not None else name
        merge = layer is not None and leaf == "weight" and not layer.merged \
            and not getattr(layer, "disable_adapters", False)
        yield hf_name, param, layer if merge else None


def _expert_plan(adapted: dict, owner: str, leaf: str, param: torch.nn.Parameter) -> tuple[str, Any, Any]:
    """A 3-D expert tensor (transformers 5's fused `gate_up_proj` / `down_proj` of a Qwen3-MoE /
    Qwen2-MoE, docs/moe.md) under peft's `ParamWrapper`s, one per adapted tensor, nested: its
    Hugging Face name, and the wrapper whose `parameter_name` it is (None: not adapted)."""
    module_name = owner
    while module_name.endswith(".base_layer"):
        module_name = module_name.removesuffix(".base_layer")
    layer = None
    for candidate in (m for n, m in adapted.items() if n == module_name or n.startswith(module_name + ".base_layer")):
        if getattr(candidate, "parameter_name", None) == leaf:
            layer = candidate
    merge = layer is not None and not layer.merged and not getattr(layer, "disable_adapters", False)
    return f"{module_name}.{leaf}", param, layer if merge else None


@torch.no_grad()
def merged_named_weights(model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor] | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, weight) of the base model with the active adapters folded in:
    W + B @ A x alpha / rank on adapted layers, the plain weight elsewhere. No `base_model.model.`
    prefix, no lora tensors, tied weights once (as `named_parameters`). One merged tensor is
    alive at a time; the model itself is not changed.

    `full(t)` makes a sharded tensor whole (FSDP2: `DTensor.full_tensor`, a collective every
    rank must run in this same order: W, then each adapter's A and B); by default tensors are
    whole already and peft computes the delta."""
    for hf_name, param, layer in _merge_plan(model):
        weight = param.detach() if full is None else full(param.detach())
        if layer is not None:
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    delta = layer.get_delta_weight(adapter) if full is None else _full_delta(layer, adapter, full)
                    weight = weight + delta.to(weight.dtype)
        yield hf_name, weight


def _full_delta(layer: Any, adapter: str, full: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """peft's `get_delta_weight` of a linear LoRA layer (B @ A, transposed for fan_in_fan_out,
    times the scaling) from gathered A and B."""
    a = full(layer.lora_A[adapter].weight.detach())
    b = full(layer.lora_B[adapter].weight.detach())
    experts = getattr(layer, "num_experts", 1)
    if experts > 1:  # peft's ParamWrapper on fused experts: its get_delta_weight, from whole A and B
        a, b = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)
        pattern = "o r e, e r i -> e o i" if layer._did_swap_in_out_features else "o r e, e r i -> e i o"
        return torch.einsum(pattern, b, a) * layer.scaling[adapter]
    delta = b @ a
    return (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]


def merged_weight_specs(model: torch.nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """Name, shape and dtype of every tensor `merged_named_weights` yields, without merging."""
    return [(name, param.shape, param.dtype) for name, param, _ in _merge_plan(model)]


def _adapter_plan(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, float]]:
    """(peft's saved name, lora parameter, factor) of every active adapter tensor, in the order
    of `named_parameters`: the name `save_pretrained` writes (adapter name dropped), and the
    scaling alpha / rank folded into B (factor 1 for A)."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, param in model.named_parameters():
        for part in (".lora_A.", ".lora_B."):
            if part not in name:
                continue
            owner, _, rest = name.partition(part)
            adapter, _, leaf = rest.partition(".")
            layer = layers.get(owner)
            if layer is None or adapter not in layer.active_adapters:
                continue
            factor = layer.scaling[adapter] if part == ".lora_B." else 1.0
            yield f"{owner}{part}{leaf}", param, factor


@torch.no_grad()
def adapter_named_tensors(model: torch.nn.Module, full: Callable[[torch.Tensor], torch.Tensor] | None = None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter alone, for an engine that applies LoRA itself (rollout.lora_mode=adapter):
    peft's saved names (`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`), with B
    already multiplied by alpha / rank, so that an adapter config with lora_alpha = r (scaling 1)
    describes it whatever the run's alpha. `full` as in `merged_named_weights`."""
    for name, param, factor in _adapter_plan(model):
        t = param.detach() if full is None else full(param.detach())
        yield name, t * factor if factor != 1.0 else t


def adapter_specs(model: torch.nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """Name, shape and dtype of every tensor `adapter_named_tensors` yields."""
    return [(name, param.shape, param.dtype) for name, param, _ in _adapter_plan(model)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The base model for the duration: the reference policy without a second copy."""
    if not is_lora(model):
        raise LoraError("adapters_disabled needs a model from apply_lora (model.lora_rank > 0)")
    with model.disable_adapter():
        yield model


def save_adapter(model: torch.nn.Module, directory: str | Path, state_dict: dict | None = None) -> Path:
    """The adapter weights and peft's adapter_config.json in `directory` (Hugging Face / peft
    format: `PeftModel.from_pretrained(base, directory)` loads it elsewhere). `state_dict`: the
    adapter tensors under the model's parameter names, when the model's own are shards."""
    directory = Path(directory)
    extra = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(directory), safe_serialization=True, **extra)
    return directory


def load_adapter(model: torch.nn.Module, directory: str | Path) -> None:
    """Put the adapter saved in `directory` into `model` (built by apply_lora with the same
    settings), exactly; a checkpoint of other LoRA settings is an error naming them."""
    import json

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / ADAPTER_FILE).is_file():
        raise LoraError(f"{directory} holds no {ADAPTER_FILE}; is it a LoRA checkpoint?")
    saved = json.loads((directory / "adapter_config.json").read_text())
    ours = model.peft_config["default"]
    if saved["r"] != ours.r or set(saved["target_modules"]) != set(ours.target_modules):
        raise LoraError(f"{directory} holds a rank-{saved['r']} adapter on {len(saved['target_modules'])} "
                        f"modules, this run has rank {ours.r} on {len(ours.target_modules)}; resume with "
                        "the model.lora_rank / model.lora_target_modules it was written with")
    saved_params, our_params = set(saved.get("target_parameters") or []), set(ours.target_parameters or [])
    if saved_params != our_params:  # e.g. written before a mixture-of-experts model's dense MLPs had adapters
        raise LoraError(f"{directory} holds adapters on the parameters {sorted(saved_params)[:4]}, this run "
                        f"on {sorted(our_params)[:4]} (polyrl adapts a mixture-of-experts model's fused experts "
                        "and its dense MLP layers by name, docs/moe.md); an adapter from an older polyrl "
                        "does not resume: start a run from its merged policy/ as model.path")
    result = set_peft_model_state_dict(model, load_file(str(directory / ADAPTER_FILE)))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise LoraError(f"{directory}: adapter tensors this model has no place for: {unexpected[:5]}")


def export(model: torch.nn.Module, directory: str | Path, adapter_only: bool = False,
           tokenizer: Any = None) -> Path:
    """`polyrl export`: the merged model as a plain Hugging Face checkpoint (loads without peft),
    or with `adapter_only` the adapter alone."""
    from polyrl.training.checkpoint_io import write_hf_dir
    from polyrl.weights.base import WeightStream

    directory = Path(directory)
    if adapter_only:
        save_adapter(model, directory)
    else:  # merged one tensor at a time, each written as it is merged
        base = model.get_base_model()
        write_hf_dir(directory, WeightStream(merged_weight_specs(model), merged_named_weights(model)),
                     base.config, getattr(base, "generation_config", None))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
