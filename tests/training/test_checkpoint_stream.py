"""Hugging Face directories written from a weight stream (training/checkpoint_io.py): headers
from the specs, every tensor to disk as it arrives, read back by safetensors and transformers."""

from __future__ import annotations

import json
import weakref

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
