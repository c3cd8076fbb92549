"""`polyrl export` of a model larger than one process's memory: it holds one tensor of the
checkpoint at a time, from reading it to writing it (polyrl/cli/export.py `_tensors` into
polyrl/training/checkpoint_io.py `write_hf_dir`), never a file's worth or the model."""

from __future__ import annotations

import weakref

import torch

from polyrl.cli import export as export_cli
from polyrl.weights.base import WeightStream


def test_export_holds_one_tensor_at_a_time(tiny_model, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(tiny_model)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    src.save_pretrained(str(ckpt / "policy"), safe_serialization=True, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(str(ckpt / "policy"))
    (ckpt / "driver.pt").write_bytes(b"")  # a complete checkpoint (export.check_complete)
    saved = {}
    for f in (ckpt / "policy").glob("*.safetensors"):
        saved.update(load_file(str(f)))
    assert len(list((ckpt / "policy").glob("*.safetensors"))) > 1

    live: list[int] = []
    read = export_cli._tensors

    def tracked(policy):
        """export's own stream, recording at each tensor it reads the bytes of those still alive
        (referenced by the reader, the writer or anything else)."""
        stream = read(policy)
        refs: list = []

        def tensors():
            for name, t in stream:
                refs.append(weakref.ref(t))
                live.append(sum(r().nbytes for r in refs if r() is not None))
                yield name, t
                del t
        return WeightStream(stream.specs, tensors())

    monkeypatch.setattr(export_cli, "_tensors", tracked)
    out = export_cli.export(ckpt, tmp_path / "exported", "bfloat16")
    assert len(live) == len(saved)
    assert max(live) == max(t.nbytes for t in saved.values())  # the largest tensor alone
    loaded = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in saved.items())
