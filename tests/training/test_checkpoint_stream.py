"""Hugging Face directories written from a weight stream (training/checkpoint_io.py): headers
from the specs, every tensor to disk as it arrives, read back by safetensors and transformers."""

from __future__ import annotations

import json
import weakref

import pytest
import torch

from polyrl.training.checkpoint_io import write_hf_dir
from polyrl.weights.base import WeightStream


def produced(model: torch.nn.Module, live: list[int]) -> WeightStream:
    """The model's parameters as fresh tensors (a gather makes new ones), recording at each
    production the bytes of produced tensors still alive."""
    refs: list = []

    def tensors():
        for name, p in model.named_parameters():
            fresh = p.detach().clone()
            refs.append(weakref.ref(fresh))
            live.append(sum(r().nbytes for r in refs if r() is not None))
            yield name, fresh
            del fresh
    specs = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    return WeightStream(specs, tensors())


def test_streamed_directory_loads_in_transformers_holding_one_tensor(tiny_model, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(tiny_model)
    params = dict(src.named_parameters())
    largest = max(p.nbytes for p in params.values())
    live: list[int] = []
    out = tmp_path / "streamed"
    write_hf_dir(out, produced(src, live), src.config, src.generation_config, shard_bytes=100_000)
    assert max(live) == largest  # one tensor at a time, not a file's worth (100 kB)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(params)
    for file in set(index["weight_map"].values()):
        with safe_open(str(out / file), framework="pt") as f:
            for name in f.keys():
                assert torch.equal(f.get_tensor(name), params[name]), name
    loaded = dict(AutoModelForCausalLM.from_pretrained(str(out)).named_parameters())
    assert all(torch.equal(loaded[k], v) for k, v in params.items())

    cast = tmp_path / "bf16"
    write_hf_dir(cast, produced(src, []), src.config, dtype=torch.bfloat16)
    with safe_open(str(cast / "model.safetensors"), framework="pt") as f:
        name = "model.embed_tokens.weight"
        assert torch.equal(f.get_tensor(name), params[name].to(torch.bfloat16))


def test_a_tensor_announced_in_row_slices_is_written_slice_by_slice(tiny_model, tmp_path):
    """What FSDP2's weight stream yields for a tensor bigger than a bucket (its dim-0 slices,
    polyrl/weights/base.py `TensorSpec.pieces`) goes to disk as it comes: the writer holds one
    slice, never the tensor."""
    from transformers import AutoModelForCausalLM

    from polyrl.weights import base

    if "pieces" not in base.TensorSpec.__dataclass_fields__:
        pytest.skip("this weight stream announces no row slices")
    src = AutoModelForCausalLM.from_pretrained(tiny_model)
    params = dict(src.named_parameters())
    budget = 8192  # bytes of a slice: the embedding and the MLP matrices come in several
    specs = [base.TensorSpec(n, tuple(p.shape), p.dtype, base.row_pieces(p.shape, p.dtype, budget))
             for n, p in params.items()]
    assert sum(len(s.pieces) > 0 for s in specs) > 3
    refs, live = [], []

    def slices():
        for spec in specs:
            bounds = spec.pieces or (0, spec.shape[0])
            for a, b in zip(bounds, bounds[1:]):
                fresh = params[spec.name].detach()[a:b].clone()
                refs.append(weakref.ref(fresh))
                live.append(sum(r().nbytes for r in refs if r() is not None))
                yield spec.name, fresh if spec.pieces else fresh.reshape(spec.shape)
                del fresh
    class Tracked(WeightStream):
        def __iter__(self):  # whole tensors, assembled from the slices: tracked too
            for name, t in super().__iter__():
                refs.append(weakref.ref(t))
                live.append(sum(r().nbytes for r in refs if r() is not None))
                yield name, t
                del t
    out = tmp_path / "sliced"
    write_hf_dir(out, Tracked(specs, slices()), src.config, shard_bytes=100_000)
    whole = max(params[s.name].nbytes for s in specs if not s.pieces)  # the largest tensor not sliced
    assert max(live) == max(whole, max(params[s.name][a:b].nbytes for s in specs
                                       for a, b in zip(s.pieces, s.pieces[1:])))
    assert max(live) < max(p.nbytes for p in params.values())  # never the largest tensor whole
    loaded = dict(AutoModelForCausalLM.from_pretrained(str(out)).named_parameters())
    assert all(torch.equal(loaded[k], v) for k, v in params.items())
