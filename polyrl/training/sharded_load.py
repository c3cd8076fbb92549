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
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

_SOURCE = "_polyrl_deferred_weights"
"""The attribute of a deferred model: {checkpoint name: StoredTensor}."""


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
    if not _checkpoint_covers(model, files):
        return None
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model.eval()  # as from_pretrained leaves it
    setattr(model, _SOURCE, files)
    return model


def is_deferred(model: torch.nn.Module) -> bool:
    return hasattr(model, _SOURCE)


def _persistent_buffers(model: torch.nn.Module):
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if name not in mod._non_persistent_buffers_set:
                yield f"{mod_name}.{name}" if mod_name else name, buf


def _checkpoint_covers(model: torch.nn.Module, stored: dict[str, StoredTensor]) -> bool:
    """Every parameter (a tied one once) and persistent buffer is in the checkpoint under its
    module name with its shape and a dtype we read, and every non-persistent buffer is a rotary
    embedding's, which `materialize` computes as from_pretrained does."""
    wanted = dict(model.named_parameters()) | dict(_persistent_buffers(model))
    for name, tensor in wanted.items():
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
def materialize(model: torch.nn.Module, device: torch.device, root: torch.nn.Module | None = None) -> None:
    """Storage on `device` for what this rank holds of `model` (its shards once FSDP2 has
    sharded it, else everything) and the checkpoint's values in it. `root`: the outermost module
    to allocate through (the FSDP2 root unit wrapping `model`); `model` names the tensors."""
    stored: dict[str, StoredTensor] = getattr(model, _SOURCE)
    tied = _tied_pairs(model)
    # FSDP2's `_apply` re-points each unit's sharded parameters at the new local storage
    (root or model).to_empty(device=device)
    for name, src in tied:  # a plain module's `_apply` may give each user of a shared weight its own
        _set_parameter(model, name, model.get_parameter(src))
    for name, tensor in list(model.named_parameters()) + list(_persistent_buffers(model)):
        _fill(tensor, stored[name])
    for module in _modules_with_computed_buffers(model):
        model._init_weights(module)  # what from_pretrained runs for them (rotary inv_freq)
    delattr(model, _SOURCE)


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


def _fill(tensor: torch.Tensor, entry: StoredTensor) -> None:
    """Copy this rank's part of `tensor` from the checkpoint: for a DTensor the rows torch itself
    assigns to this rank (FSDP2: an uneven dim-0 chunk, maybe empty), read with plain file reads
    (an mmap's touched pages would count in the rank's resident memory until it is closed)."""
    local, first = tensor, 0
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = tensor.to_local()
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        if tuple(shape) != tuple(local.shape) or any(o != 0 for o in offset[1:]) or tuple(shape[1:]) != entry.shape[1:]:
            raise RuntimeError(f"sharded load: {tuple(local.shape)} at {tuple(offset)} of {entry.shape} "
                               "is not a dim-0 shard")
        first = offset[0] if offset else 0
    if local.numel() == 0:
        return
    row_elems = local[0].numel() if local.dim() else 1
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    direct = local.device.type == "cpu" and local.dtype == entry.dtype and local.is_contiguous()
    # straight into the shard when it needs no conversion, else through one shard-sized buffer
    buf = local if direct else torch.empty(local.shape, dtype=entry.dtype)
    _read_into(entry.file, entry.begin + first * row_elems * itemsize, buf.reshape(-1).view(torch.uint8))
    if not direct:
        local.copy_(buf)


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
