"""`polyrl export`: a DDP checkpoint (the policy worker's layout) to a Hugging Face directory that
transformers and the serving engine load; --dtype casts; several safetensors files get an index;
bad input is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine_ranks
from polyrl.cli.main import main
from polyrl.training.checkpoint_io import write_hf_dir


@pytest.fixture(scope="module")
def ddp_checkpoint(tiny_model, tmp_path_factory):
    """A trained DDP engine's checkpoint, with the tokenizer PolicyWorker.save_checkpoint adds."""
    from transformers import AutoTokenizer

    ckpt = tmp_path_factory.mktemp("ckpt") / "step_000001"
    ckpt.mkdir()
    engine, actor = engine_ranks.build(tiny_model, engine_ranks.actor_config("ddp"), 0, 1)
    actor.update(engine_ranks.make_batch(1), 1, False)
    engine.save(ckpt)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(str(ckpt / "policy"))
    return ckpt, {k: v.detach().clone() for k, v in engine.named_weights()}


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


def test_export_loads_in_transformers_and_serves(ddp_checkpoint, tmp_path, capsys):
    from transformers import AutoTokenizer, GenerationConfig

    from polyrl.rollout.base import ROLLOUT_ENGINES, SamplingParams

    ckpt, weights = ddp_checkpoint
    out = tmp_path / "exported"
    assert main(["export", str(ckpt), "--output", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    model = load(out)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in weights.items())
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("1+2") == AutoTokenizer.from_pretrained(str(ckpt / "policy")).encode("1+2")
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == model.config.eos_token_id
    # what `polyrl serve --model DIR` builds
    engine = ROLLOUT_ENGINES.get("native")(str(out), dtype="float32", device=torch.device("cpu"),
                                           max_model_len=32)
    [[result]] = engine.generate_batch([tok.encode("1+2=")], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(result.token_ids) >= 1


def test_export_casts_to_bfloat16(ddp_checkpoint, tmp_path):
    ckpt, weights = ddp_checkpoint
    out = tmp_path / "bf16"
    assert main(["export", str(ckpt), "-o", str(out), "--dtype", "bfloat16"]) == 0
    model = load(out)
    assert model.config.dtype == torch.bfloat16
    params = dict(model.named_parameters())
    assert all(params[k].dtype == torch.bfloat16 and torch.equal(params[k], v.to(torch.bfloat16))
               for k, v in weights.items())


def test_several_files_get_an_index(ddp_checkpoint, tmp_path):
    from polyrl.rollout.native.loader import read_state_dict

    ckpt, weights = ddp_checkpoint
    src = load(ckpt / "policy")
    out = tmp_path / "sharded"
    write_hf_dir(out, src.named_parameters(), src.config, src.generation_config, shard_bytes=40_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert (out / "model.safetensors.index.json").is_file()
    params = dict(load(out).named_parameters())
    assert all(torch.equal(params[k], v) for k, v in weights.items())
    assert set(read_state_dict(out)) == set(weights)  # the serving engine's reader too


def test_bad_input_is_one_line(ddp_checkpoint, tmp_path, capsys):
    ckpt, _ = ddp_checkpoint
    assert main(["export", str(tmp_path / "nope"), "-o", str(tmp_path / "x")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "-o", str(tmp_path / "x")]) == 2
    assert "no policy/ directory" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "f").write_text("x")
    assert main(["export", str(ckpt), "-o", str(taken)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
