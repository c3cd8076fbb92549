"""Checkpoint files of a sharded engine (fsdp2.py), and Hugging Face directories written from a
stream of tensors.

A checkpoint directory (trainer/checkpoint.py writes it under a temporary name and renames it
when complete, so nothing here needs to be atomic) holds, for actor.strategy=fsdp2:

    dcp/        model + optimizer, sharded (torch.distributed.checkpoint): any world size reads it
    engine.pt   LR schedule and non-finite counter (identical on every rank; rank 0 writes it)
    policy/     the model in Hugging Face format, gathered tensor by tensor: usable as model.path

and for actor.strategy=ddp (ddp.py) `policy/` plus `engine_rank{r}.pt` (full optimizer per rank),
which the sharded engine also reads, so a DDP run can resume sharded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from polyrl.training.sharded_load import is_dtensor
from polyrl.weights.base import TensorSpec, WeightStream, as_stream

DCP_DIR = "dcp"
ENGINE_FILE = "engine.pt"
SHARD_BYTES = 2 * 2**30
"""Largest safetensors file of a written Hugging Face directory (written tensor by tensor)."""


# --- sharded state (torch.distributed.checkpoint) ------------------------------------------------
def save_sharded(directory: Path, model: torch.nn.Module, optimizer, group) -> None:
    """Every rank writes its shards of the model (and optimizer) under `directory/dcp`."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(directory / DCP_DIR), process_group=group)


def load_sharded(directory: Path, model: torch.nn.Module, optimizer, group) -> None:
    """Load `directory`'s model (and optimizer) into this rank's shards, whatever world size wrote
    it; a checkpoint of another model is an error naming what differs."""
    if not (directory / DCP_DIR).is_dir():
        return _load_replicated(directory, model, optimizer)
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    _check_same_model(directory, state["model"], optimizer is not None)
    dcp.load(state, checkpoint_id=str(directory / DCP_DIR), process_group=group)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def engine_state(directory: Path) -> dict:
    """Schedule and counters: this engine's `engine.pt`, or a DDP checkpoint's rank-0 file."""
    path = directory / ENGINE_FILE
    if not path.is_file():
        path = directory / "engine_rank0.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {ENGINE_FILE} or engine_rank0.pt "
                                "(written by a frozen engine or truncated); give a training checkpoint")
    saved = torch.load(path, weights_only=False)
    return {"scheduler": saved["scheduler"], "nonfinite_in_a_row": saved["nonfinite_in_a_row"]}


def _check_same_model(directory: Path, model_state: dict, with_optimizer: bool) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(directory / DCP_DIR)).read_metadata().state_dict_metadata
    saved_shapes = {k[len("model."):]: tuple(v.size) for k, v in saved.items()
                    if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    current = {k: tuple(v.shape) for k, v in model_state.items()}
    missing = sorted(set(current) - set(saved_shapes))
    unexpected = sorted(set(saved_shapes) - set(current))
    reshaped = [f"{k}: {saved_shapes[k]} vs {current[k]}" for k in sorted(set(current) & set(saved_shapes))
                if saved_shapes[k] != current[k]]
    if missing or unexpected or reshaped:
        raise ValueError(f"checkpoint {directory} holds another model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, shapes differ {reshaped[:5]} "
                         "(resume with the model.path it was written for)")
    if with_optimizer and not any(k.startswith("optimizer.") for k in saved):
        raise ValueError(f"checkpoint {directory} has no optimizer state (written by a frozen engine)")


def _load_replicated(directory: Path, model: torch.nn.Module, optimizer) -> None:
    """A DDP checkpoint: full tensors from `policy/`, the full optimizer of `engine_rank0.pt`
    (identical on every DDP rank); each rank keeps its shards."""
    from safetensors.torch import load_file

    files = sorted((directory / "policy").glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {directory} has neither {DCP_DIR}/ nor policy/*.safetensors")
    full: dict[str, torch.Tensor] = {}
    for f in files:
        full.update(load_file(str(f)))
    current = get_model_state_dict(model)
    tied = set(current) - set(full)
    for name in tied:  # tied weights are saved once by transformers: take the tensor they share
        source = _tied_source(model, name)
        if source is None or source not in full:
            raise ValueError(f"checkpoint {directory} holds another model: missing {sorted(tied)[:5]} "
                             "(resume with the model.path it was written for)")
        full[name] = full[source]
    unexpected = sorted(set(full) - set(current))
    reshaped = [k for k in current if tuple(full[k].shape) != tuple(current[k].shape)]
    if unexpected or reshaped:
        raise ValueError(f"checkpoint {directory} holds another model: unexpected {unexpected[:5]}, "
                         f"shapes differ {reshaped[:5]} (resume with the model.path it was written for)")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full, options=options)
    if optimizer is not None:
        saved = torch.load(directory / "engine_rank0.pt", weights_only=False)["optimizer"]
        # torch.optim numbers parameters in the order it was given them (ddp.py: trainable
        # model.parameters()); the state-dict API names them
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        by_id = dict(enumerate(names))
        osd = {"state": {by_id[i]: s for i, s in saved["state"].items()},
               "param_groups": [{**g, "params": [by_id[i] for i in g["params"]]} for g in saved["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, osd, options=options)


def _tied_source(model: torch.nn.Module, name: str) -> str | None:
    """The name under which the parameter `name` is stored when it is shared with another."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    if target is None:
        return None
    return next((n for n, p in model.named_parameters() if p is target), None)


# --- Hugging Face directories ------------------------------------------------------------------
def write_hf_dir(out: Path, named: Iterable[tuple[str, torch.Tensor]] | WeightStream, config,
                 generation_config=None, *, write: bool = True, dtype: torch.dtype | None = None,
                 shard_bytes: int = SHARD_BYTES) -> None:
    """A Hugging Face model directory from `named`: safetensors files of at most `shard_bytes`
    (with an index when there are several), config and generation config; `dtype` casts
    floating-point tensors. Given a WeightStream (specs up front, tensors gathered or merged one
    at a time), each file's header is written from the specs and every tensor goes to disk as
    it arrives, so the writer holds one tensor, never a file's worth; a tensor the stream
    announces in row slices (`TensorSpec.pieces`) is written slice by slice (a dim-0 slice is a
    contiguous byte range of the file), so the writer holds one slice, never that tensor.
    `write=False` only consumes the stream (the other ranks of a gather)."""
    stream = as_stream(named)
    items = _items(stream)
    if not write:
        for _ in items:
            pass
        return
    out.mkdir(parents=True, exist_ok=True)
    specs = [replace(s, dtype=dtype) if dtype is not None and s.dtype.is_floating_point else s
             for s in stream.specs]
    files: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if files[-1] and size + spec.nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    n = len(files)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    tensors = items
    parts = []
    for i, file_specs in enumerate(files):
        part = out / f".part-{i:05d}.safetensors"
        write_safetensors(part, file_specs, tensors)
        parts.append(part)
    for part, final in zip(parts, names):
        part.rename(out / final)
    if n > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: final for file_specs, final in zip(files, names) for s in file_specs}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    if dtype is not None:
        config = type(config).from_dict(config.to_dict())
        config.dtype = dtype
    config.save_pretrained(str(out))
    if generation_config is not None:
        generation_config.save_pretrained(str(out))


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(path: Path, specs: list[TensorSpec], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """One safetensors file of `specs`, its tensors taken from `tensors` one at a time (cast to
    the spec's dtype) and written as they come. The `safetensors` package writes only from a
    dict of every tensor of the file, so the header (8-byte little-endian length, then JSON:
    dtype, shape and byte range of each tensor, padded to 8 bytes) is laid out here from the
    specs, as its format documents; what it writes is read back by `safetensors.safe_open` and
    transformers (tests/training/test_checkpoint_stream.py)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"'{spec.name}': safetensors has no {spec.dtype}")
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec in specs:
            for _ in range(max(len(getattr(spec, "pieces", ())) - 1, 1)):  # its row slices, in order
                item = next(tensors, None)
                if item is None or item[0] != spec.name:
                    raise ValueError(f"{path.name}: expected '{spec.name}', the stream gave "
                                     f"{'nothing' if item is None else repr(item[0])}")
                t = item[1].detach().to("cpu", spec.dtype).contiguous().reshape(-1)
                del item
                f.write(t.view(torch.uint8).numpy().data)
                del t


def _items(stream: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's items as produced: row slices of a tensor announced in pieces, else whole."""
    return stream.pieces() if getattr(stream, "sliced", False) else iter(stream)


def model_tensors(model: torch.nn.Module, stream: WeightStream) -> WeightStream:
    """`stream` (the gathered parameters, row slices kept as such) followed by the model's
    persistent buffers."""
    buffers = _persistent_buffers(model)

    def tensors():
        yield from _items(stream)
        yield from buffers
    specs = list(stream.specs) + [TensorSpec(n, tuple(b.shape), b.dtype) for n, b in buffers]
    return WeightStream(specs, tensors(), device=stream.device)


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong in a state dict (FSDP2 does not shard buffers)."""
    out = []
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out


# --- memory ----------------------------------------------------------------------------------------
def local_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (DTensors: its shard)."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if is_dtensor(t) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    out = {"params": sum(local(p) for p in params),
           "grads": sum(local(p.grad) for p in params if p.grad is not None),
           "optimizer": 0}
    if optimizer is not None:
        out["optimizer"] = sum(local(v) for s in optimizer.state.values() for v in s.values()
                               if isinstance(v, torch.Tensor))
    return out
