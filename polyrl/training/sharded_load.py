"""Sharded loading for actor.strategy=fsdp2: build the model on the meta device (no memory), let
FSDP2 shard it, then give each rank storage for its own shards only and read just those rows
from the safetensors files. A rank's load peak is its shards, not the whole model.

`deferred_causal_lm` builds the meta model and remembers where its weights are;
`materialize` (called by the FSDP2 engine after `fully_shard`, by `build_engine` for any other
engine) fills it. A model this path cannot reproduce exactly as `from_pretrained` would (no
safetensors, a checkpoint name or shape that differs from the module's, a persistent buffer the
checkpoint lacks) is not deferred: the caller loads it whole as before.

What `from_pretrained` does besides reading tensors, done here the same way:
* tied weights (lm_head = embed_tokens): one shared Parameter, read once under its first name;
* non-persistent buffers (rotary `inv_freq`): not in the checkpoint; transformers fills them in
  `_init_weights` of their rotary module after loading, and so do we (a model with other
  computed buffers is loaded whole);
* generation_config.json and eval mode.

Mixture-of-experts (Qwen3-MoE, Qwen2-MoE): the checkpoint names each expert apart
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`) where the module holds them fused
(`gate_up_proj` [E, 2I, H]: expert e's gate rows then its up rows; `down_proj` [E, H, I]), as
transformers fuses them on load. A fused tensor is read from its experts' tensors
(`FusedExperts`): FSDP2 and expert parallelism (training/expert_parallel.py) shard it by
experts (dim 0), so a rank reads only its own experts' tensors.

Parameters the checkpoint does not hold start from values drawn on the CPU when the model is
built (`set_initial_values`): LoRA adapters (polyrl/training/lora.py `apply_lora`, which draws
them exactly as peft would on a loaded model) and a critic's value head (`deferred_value_model`).
Every rank takes the values of the trainer group's first rank, as the whole load broadcasts them:
over the whole group `materialize` is given, not a tensor's own mesh, which under tensor
parallelism misses the tp ranks of a parameter in no tp plan (an MoE layer's experts and their
adapters, a critic's value head: sharded over the data ranks alone, replicated over tp, so each
tp rank would keep its own draw). Under peft a parameter's checkpoint name is its name without
peft's `.base_layer`.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

_SOURCE = "_polyrl_deferred_weights"
"""The attribute of a deferred model: {checkpoint name: StoredTensor}."""
_INITIAL = "_polyrl_deferred_initial"
"""{parameter name: full initial value (CPU)}: the parameters that are not read from the checkpoint."""


def is_dtensor(tensor) -> bool:
    """Whether `tensor` is a DTensor (an FSDP2 shard), without importing torch.distributed.tensor
    (~1 s in every process that imports polyrl.training): nothing can be a DTensor until FSDP2
    has imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file (row-major, dim 0 outermost)."""
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Byte offset of its first element in the file."""


@dataclass(frozen=True)
class FusedExperts:
    """A fused expert tensor [E, ...] as the checkpoint stores it: expert e is its `parts[e]`
    (one or more tensors, each a block of rows) one after the other."""
    parts: tuple[tuple[StoredTensor, ...], ...]
    dtype: torch.dtype
    shape: tuple[int, ...]


_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""A fused expert tensor's per-expert checkpoint tensors, in the order transformers concatenates
them (polyrl/rollout/native/moe.py reads the same layout)."""


def fused_experts(model: torch.nn.Module, stored: dict[str, StoredTensor]) -> dict[str, FusedExperts]:
    """The fused expert tensors of `model` (Qwen3-MoE / Qwen2-MoE `...mlp.experts.gate_up_proj`,
    `...down_proj`) that the checkpoint holds per expert and not fused, each as the per-expert
    tensors it is read from; one whose parts are missing or mis-shaped is left out (the model is
    then loaded whole)."""
    out = {}
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _EXPERT_PARTS or name in stored or not prefix.endswith("experts") or p.dim() != 3:
            continue
        parts = tuple(tuple(stored.get(f"{prefix}.{e}.{part}.weight") for part in _EXPERT_PARTS[leaf])
                      for e in range(p.shape[0]))
        flat = [t for expert in parts for t in expert]
        if any(t is None for t in flat) or len({t.dtype for t in flat}) != 1 or flat[0].dtype is None:
            continue
        if any(sum(t.shape[0] for t in expert) != p.shape[1] or any(t.shape[1:] != tuple(p.shape[2:]) for t in expert)
               for expert in parts):
            continue
        out[name] = FusedExperts(parts, flat[0].dtype, tuple(p.shape))
    return out


def _header(file: Path) -> dict[str, StoredTensor]:
    """The safetensors header: an 8-byte little-endian length, then JSON name -> dtype, shape,
    data_offsets (relative to the end of the header)."""
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        entries = json.loads(f.read(size))
    entries.pop("__metadata__", None)
    return {name: StoredTensor(file, _DTYPES.get(e["dtype"], None), tuple(e["shape"]), 8 + size + e["data_offsets"][0])
            for name, e in entries.items()}


def checkpoint_files(directory: Path) -> dict[str, StoredTensor] | None:
    """Every tensor of the checkpoint (single file or sharded with an index) and where it lies;
    None without safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = set(json.loads(index.read_text())["weight_map"].values())
    elif (directory / "model.safetensors").is_file():
        files = {"model.safetensors"}
    else:
        return None
    out: dict[str, StoredTensor] = {}
    for file in sorted(files):
        out.update(_header(directory / file))
    return out


def deferred_causal_lm(directory: Path, dtype: torch.dtype, trust_remote_code: bool = False):
    """The model of `directory` on the meta device, its weights to be read by `materialize`; None
    when this model must be loaded whole (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    files = checkpoint_files(directory)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 attn_implementation="sdpa")
    files = {**files, **fused_experts(model, files)}
    if not _checkpoint_covers(model, files):
        return None
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model.eval()  # as from_pretrained leaves it
    setattr(model, _SOURCE, files)
    return model


def deferred_value_model(directory: Path, dtype: torch.dtype, trust_remote_code: bool = False):
    """The critic's model (polyrl/training/values.py `load_value_model`: the policy architecture
    with a one-label token-classification head, dropout off) on the meta device, its trunk to be
    read from `directory` and its head drawn now as transformers initialises a missing weight;
    None when it must be loaded whole."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    files = checkpoint_files(directory)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(str(directory), num_labels=1, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForTokenClassification.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                            attn_implementation="sdpa")
    trunk = model.base_model_prefix + "."
    head = {n for n, _ in model.named_parameters() if not n.startswith(trunk)}  # the new value head
    if not head or not _checkpoint_covers(model, files, skip=head):
        return None
    for m in model.modules():  # as load_value_model: dropout on a regression target only adds noise
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    initial = {}
    for owner_name in sorted({n.rpartition(".")[0] for n in head}):  # drawn by the model's own initialiser
        twin = _cpu_twin(model.get_submodule(owner_name))
        model._init_weights(twin)
        for name, value in twin.named_parameters(recurse=False):
            initial[f"{owner_name}.{name}"] = value.detach().to(dtype)
    model.eval()
    setattr(model, _SOURCE, files)
    set_initial_values(model, initial)
    return model


def _cpu_twin(module: torch.nn.Module) -> torch.nn.Module:
    """An uninitialised CPU copy of a meta module's own parameters (for its initialiser)."""
    import copy

    twin = copy.deepcopy(module)
    return twin.to_empty(device="cpu")


def set_initial_values(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Initial values (full, on the CPU, named as in `model`) of parameters a deferred model does
    not read from its checkpoint; added to those already set."""
    owner = _owner(model)
    setattr(owner, _INITIAL, {**getattr(owner, _INITIAL, {}), **values})


def is_deferred(model: torch.nn.Module) -> bool:
    return hasattr(model, _SOURCE)


def _owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module that carries the deferred state: `model`, or the model peft wraps."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if _SOURCE in vars(base) else model


def checkpoint_name(name: str) -> str:
    """A parameter's name in the checkpoint: peft's wrapped layer keeps its weight under `base_layer`
    (nested on fused experts with two adapted tensors: `experts.base_layer.base_layer.gate_up_proj`)."""
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name


def _persistent_buffers(model: torch.nn.Module):
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if name not in mod._non_persistent_buffers_set:
                yield f"{mod_name}.{name}" if mod_name else name, buf


def _checkpoint_covers(model: torch.nn.Module, stored: dict[str, StoredTensor | FusedExperts],
                       skip: set[str] = frozenset()) -> bool:
    """Every parameter (a tied one once; but those in `skip`) and persistent buffer is in the
    checkpoint under its module name with its shape and a dtype we read, and every
    non-persistent buffer is a rotary embedding's, which `materialize` computes as
    from_pretrained does."""
    wanted = dict(model.named_parameters()) | dict(_persistent_buffers(model))
    for name, tensor in wanted.items():
        if name in skip:
            continue
        entry = stored.get(name)
        if entry is None or entry.dtype is None or entry.shape != tuple(tensor.shape):
            return False
    return all(_rotary(m) for m in _modules_with_computed_buffers(model))


def _rotary(module: torch.nn.Module) -> bool:
    """A module whose non-persistent buffers transformers' `_init_weights` recomputes after
    loading (its rotary-embedding branch: inv_freq and original_inv_freq, no parameters); a model
    with any other computed buffer is loaded whole."""
    return ("RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")
            and not any(True for _ in module.parameters(recurse=False)))


def _modules_with_computed_buffers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if m._non_persistent_buffers_set & {n for n, _ in m.named_buffers(recurse=False)}]


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, root: torch.nn.Module | None = None,
                group=None) -> None:
    """Storage on `device` for what this rank holds of `model` (its shards once FSDP2 has
    sharded it, else everything) and the checkpoint's values in it (or the initial values of
    what the checkpoint does not hold, as `group`'s first rank drew them). `root`: the outermost
    module to allocate through (the FSDP2 root unit wrapping `model`); `model` names the tensors.
    `group`: every rank holding a part or a replica of `model` (FSDP2: the trainer ranks, tp
    included); None: this process alone."""
    root = root or model
    model = _owner(model)  # peft's wrapper: its base model holds every parameter
    stored: dict[str, StoredTensor] = getattr(model, _SOURCE)
    initial: dict[str, torch.Tensor] = getattr(model, _INITIAL, {})
    tied = _tied_pairs(model)
    # FSDP2's `_apply` re-points each unit's sharded parameters at the new local storage
    root.to_empty(device=device)
    for name, src in tied:  # a plain module's `_apply` may give each user of a shared weight its own
        _set_parameter(model, name, model.get_parameter(src))
    for name, tensor in list(model.named_parameters()) + list(_persistent_buffers(model)):
        if name in initial:
            _fill_initial(tensor, initial[name], group)
        else:
            _fill(tensor, stored[checkpoint_name(name)])
    for module in _modules_with_computed_buffers(model):
        model._init_weights(module)  # what from_pretrained runs for them (rotary inv_freq)
    delattr(model, _SOURCE)
    if initial:
        delattr(model, _INITIAL)


def _tied_pairs(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, name of the parameter it shares) for every parameter reachable under two names."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return pairs


def _set_parameter(model: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, value)


def _local_rows(tensor: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
    """This rank's part of `tensor`, the row of the full tensor it starts at and the column:
    for a DTensor the block torch itself assigns to this rank (FSDP2: an uneven dim-0 chunk,
    maybe empty; under tensor parallelism a chunk of a tp slice, whose columns are a slice of
    the full rows for a row-wise layer)."""
    if not is_dtensor(tensor):
        return tensor, 0, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = tensor.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if (tuple(local_shape) != tuple(local.shape) or any(o != 0 for o in offset[2:])
            or tuple(local_shape[2:]) != shape[2:]):
        raise RuntimeError(f"sharded load: {tuple(local.shape)} at {tuple(offset)} of {shape} "
                           "is not a block of rows and columns")
    return local, offset[0] if offset else 0, offset[1] if len(offset) > 1 else 0


def _fill_initial(tensor: torch.Tensor, value: torch.Tensor, group) -> None:
    """This rank's rows of `value`, as `group`'s first rank drew it (broadcast whole from that
    rank: the same values on every rank, whatever each rank's RNG). Over the whole group, not
    the tensor's mesh: a parameter in no tp plan is on the data ranks' mesh alone, and its tp
    replicas must start equal too (tests/training/test_tensor_parallel_lora.py, an MoE's experts)."""
    local, first, column = _local_rows(tensor, tuple(value.shape))
    if group is not None:
        import torch.distributed as dist

        if dist.get_world_size(group) > 1:
            value = value.to(local.device).contiguous()
            dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    if local.dim() > 1:
        value = value[:, column: column + local.shape[1]]
    local.copy_(value[first: first + local.shape[0]] if local.dim() else value)


def _fill(tensor: torch.Tensor, entry: StoredTensor | FusedExperts) -> None:
    """Copy this rank's part of `tensor` from the checkpoint, read with plain file reads (an
    mmap's touched pages would count in the rank's resident memory until it is closed)."""
    local, first, column = _local_rows(tensor, entry.shape)
    if local.numel() == 0:
        return
    if isinstance(entry, FusedExperts):
        _fill_experts(local, first, entry)
        return
    if local.dim() > 1 and local.shape[1] != entry.shape[1]:  # a column block: read its whole rows
        rows = torch.empty((local.shape[0], *entry.shape[1:]), dtype=entry.dtype)
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        _read_into(entry.file, entry.begin + first * rows[0].numel() * itemsize, rows.reshape(-1).view(torch.uint8))
        local.copy_(rows[:, column: column + local.shape[1]])
        return
    row_elems = local[0].numel() if local.dim() else 1
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    direct = local.device.type == "cpu" and local.dtype == entry.dtype and local.is_contiguous()
    # straight into the shard when it needs no conversion, else through one shard-sized buffer
    buf = local if direct else torch.empty(local.shape, dtype=entry.dtype)
    _read_into(entry.file, entry.begin + first * row_elems * itemsize, buf.reshape(-1).view(torch.uint8))
    if not direct:
        local.copy_(buf)


def _fill_experts(local: torch.Tensor, first: int, entry: FusedExperts) -> None:
    """Experts first .. first + len(local) of a fused expert tensor (whole experts: FSDP2 and
    expert parallelism shard dim 0) from their per-expert tensors, each read whole once."""
    if tuple(local.shape[1:]) != entry.shape[1:]:
        raise RuntimeError(f"sharded load: {tuple(local.shape)} of {entry.shape} is not a block of experts")
    direct = local.device.type == "cpu" and local.dtype == entry.dtype and local.is_contiguous()
    for i in range(local.shape[0]):
        # straight into the shard when it needs no conversion, else through one expert-sized buffer
        buf = local[i] if direct else torch.empty(local.shape[1:], dtype=entry.dtype)
        row = 0
        for part in entry.parts[first + i]:
            _read_into(part.file, part.begin, buf[row:row + part.shape[0]].reshape(-1).view(torch.uint8))
            row += part.shape[0]
        if not direct:
            local[i].copy_(buf)


def _read_into(file: Path, offset: int, out: torch.Tensor) -> None:
    view = memoryview(out.numpy()).cast("B")
    with open(file, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise RuntimeError(f"sharded load: {file} ends early")
            done += n
