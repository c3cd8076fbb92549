"""actor.strategy=fsdp2 on real gloo ranks: the same updates as DDP on one rank (summed, not
averaged, gradients; ranks with different micro-batch counts or none), a frozen sharded reference,
weights gathered one tensor at a time, DCP checkpoints read back on 1 and 2 ranks."""

from __future__ import annotations


import pytest
import torch

import engine_ranks
from gloo_world import run_world_ok
from polyrl.training.fsdp2 import decoder_layers

RTOL = 1e-5


@pytest.fixture(scope="module")
def ddp_one_rank(tiny_model):
    """The reference: the DDP engine on one rank (no process group needed), in this process."""
    return engine_ranks.train(0, 1, tiny_model, "ddp")


@pytest.fixture(scope="module")
def fsdp2_two_ranks(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2-world")
    ranks = run_world_ok(engine_ranks.fsdp2_facts, 2, tmp, args=(tiny_model, str(tmp / "ckpt")),
                         timeout_s=240, backend_timeout_s=200)
    return ranks, tmp / "ckpt"


def same_metrics(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b):
        for k in engine_ranks.SHARE_KEYS:
            assert step_a[k] == pytest.approx(step_b[k], rel=RTOL, abs=1e-9), (k, step_a, step_b)


def same_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        # Adam divides by sqrt(v): an element whose gradient is ~0 turns summation-order noise
        # (1e-9) into ~1e-6 of movement; DDP on 2 ranks differs from 1 rank by as much
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=1e-5, msg=k)


def test_two_ranks_match_ddp_on_one(ddp_one_rank, fsdp2_two_ranks):
    ranks, _ = fsdp2_two_ranks
    # the batches exercise what FSDP2 makes hard: ranks with different micro-batch counts, and
    # a rank with no sample at all (the third batch has one)
    counts = [r["micro_batches"] for r in ranks.values()]
    assert counts[0][0] != counts[1][0] and counts[1][2] == 0, counts
    for r in ranks.values():
        same_metrics(r["metrics"], ddp_one_rank["metrics"])
    same_weights(ranks[0]["weights"], ddp_one_rank["weights"])
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])
    # gradients summed, not averaged: an average would halve the norm
    assert ranks[0]["metrics"][0]["actor/grad_norm"] > 0.5  # clipped to 0.5, reported unclipped


def test_weights_moved(ddp_one_rank, tiny_model):
    from polyrl.training.model_loading import load_causal_lm

    start = dict(load_causal_lm(tiny_model).named_parameters())
    moved = max((ddp_one_rank["weights"][k] - start[k]).abs().max().item() for k in ddp_one_rank["weights"])
    assert moved > 1e-3  # the weight comparison above is not between two untrained models


def test_shards_halve_memory_and_sync_gathers_one_tensor_at_a_time(fsdp2_two_ranks, tiny_model):
    from polyrl.training.model_loading import load_causal_lm

    ranks, _ = fsdp2_two_ranks
    full = sum(p.numel() * 4 for p in load_causal_lm(tiny_model).parameters())
    for r in ranks.values():
        b = r["state_bytes"]
        # dim-0 shards: a row count that does not divide pads the smaller shard, hence the slack
        assert 0.45 * full <= b["params"] <= 0.55 * full, (b, full)
        assert b["grads"] == 0  # freed by zero_grad after the step
        assert 0.9 * full <= b["optimizer"] <= 1.1 * full  # AdamW: two moments of half the model
        assert r["sync"]["live_peak"] == 1 and r["sync"]["total"] == full
        assert r["sync"]["specs_match"]  # names, shapes, dtypes known before any gather
        assert r["sync"]["largest"] < full / 2


def test_reference_is_sharded_and_frozen(fsdp2_two_ranks, tiny_model):
    from polyrl.batch import Ragged, shard

    ranks, _ = fsdp2_two_ranks
    ddp, _ = engine_ranks.build(tiny_model, engine_ranks.actor_config("ddp"), 0, 1, horizon=None)
    for rank, r in ranks.items():
        ref = r["reference"]
        assert ref["optimizer"] is None and ref["trainable"] == 0
        assert ref["state_bytes"]["optimizer"] == 0 and ref["state_bytes"]["grads"] == 0
        mine = shard(engine_ranks.make_batch(5, 5), 2)[rank]
        expected: Ragged = ddp.logprobs(mine)
        torch.testing.assert_close(ref["logprobs"], expected.values, rtol=1e-5, atol=1e-6)


def test_checkpoint_layout(fsdp2_two_ranks):
    _, ckpt = fsdp2_two_ranks
    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")}
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "engine.pt",
            "policy/config.json", "policy/generation_config.json", "policy/model.safetensors"} <= names


@pytest.mark.slow
def test_resume_on_one_rank_and_on_two(fsdp2_two_ranks, tiny_model, tmp_path):
    """A checkpoint of 2 ranks continues on 1 (and of 1 rank on 2) as the uninterrupted run."""
    ranks, ckpt = fsdp2_two_ranks
    one = run_world_ok(engine_ranks.resume_then_train, 1, tmp_path, args=(tiny_model, str(ckpt)),
                       timeout_s=240, backend_timeout_s=200)[0]
    same_metrics(one["metrics"], ranks[0]["metrics"][1:])
    same_weights(one["weights"], ranks[0]["weights"])

    (tmp_path / "b").mkdir()
    ckpt1 = tmp_path / "ckpt1"
    uninterrupted = run_world_ok(engine_ranks.save_then_train, 1, tmp_path / "b", args=(tiny_model, str(ckpt1)),
                                 timeout_s=240, backend_timeout_s=200)[0]
    (tmp_path / "c").mkdir()
    two = run_world_ok(engine_ranks.resume_then_train, 2, tmp_path / "c", args=(tiny_model, str(ckpt1)),
                       timeout_s=240, backend_timeout_s=200)
    for r in two.values():
        same_metrics(r["metrics"], uninterrupted["metrics"])
    same_weights(two[0]["weights"], uninterrupted["weights"])


def test_model_without_decoder_layers_names_the_strategy():
    with pytest.raises(ValueError, match=r"actor.strategy=fsdp2: Sequential has no decoder layers.*actor.strategy=ddp"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_decoder_layers_of_a_transformers_model(tiny_model):
    from polyrl.training.model_loading import load_causal_lm

    layers = decoder_layers(load_causal_lm(tiny_model))
    assert [type(m).__name__ for m in layers] == ["Qwen2DecoderLayer"] * 2


@pytest.mark.slow
def test_checkpointing_offload_ddp_resume_and_mismatch(ddp_one_rank, fsdp2_two_ranks, tiny_model, tmp_path):
    """Gradient checkpointing (+ actor.offload, a no-op on CPU) trains the same, so does a critic;
    a DDP checkpoint resumes sharded; a checkpoint of another model is refused, naming model.path."""
    from tiny_models import build_tiny_model

    ddp_ckpt = tmp_path / "ddp-ckpt"
    uninterrupted = engine_ranks.save_then_train(0, 1, tiny_model, str(ddp_ckpt), strategy="ddp")
    other = build_tiny_model(tmp_path / "other", hidden=32)
    (tmp_path / "w").mkdir()
    ranks = run_world_ok(engine_ranks.fsdp2_extras, 2, tmp_path / "w",
                         args=(tiny_model, str(ddp_ckpt), other, str(fsdp2_two_ranks[1])),
                         timeout_s=400, backend_timeout_s=300)
    critic = engine_ranks.critic_updates(0, 1, tiny_model, "ddp")
    for r in ranks.values():
        for a, b in zip(r["critic"], critic):  # a value head (critic) trains the same way
            assert a == pytest.approx(b, rel=RTOL), (a, b)
        same_metrics(r["checkpointed"], ddp_one_rank["metrics"])
        same_metrics(r["from_ddp"]["metrics"], uninterrupted["metrics"])
        for message in r["mismatch"]:  # a DDP and an FSDP2 checkpoint
            assert "holds another model" in message and "model.path" in message, message
    same_weights(ranks[0]["from_ddp"]["weights"], uninterrupted["weights"])


def test_export_of_a_sharded_checkpoint(fsdp2_two_ranks, tiny_model, tmp_path, capsys):
    """policy/ of an FSDP2 checkpoint, gathered tensor by tensor, is the model at the save."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.cli.main import main

    ranks, ckpt = fsdp2_two_ranks
    # the engine alone writes no tokenizer (PolicyWorker adds it) and this one has no config.yaml
    assert main(["export", str(ckpt), "-o", str(tmp_path / "a")]) == 2
    assert "holds no tokenizer" in capsys.readouterr().err
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(str(ckpt / "policy"))
    assert main(["export", str(ckpt), "-o", str(tmp_path / "b")]) == 0
    params = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / "b")).named_parameters())
    saved = ranks[0]["weights_at_save"]
    assert sorted(saved) == sorted(params)
    assert all(torch.equal(params[k], v) for k, v in saved.items())


def test_offload_without_fsdp2_names_the_fields():
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig

    with pytest.raises((ConfigError, ValueError), match=r"actor.offload=true needs actor.strategy=fsdp2"):
        load_config(JobConfig, overrides=["actor.offload=true"])
    assert load_config(JobConfig, overrides=["actor.offload=true", "actor.strategy=fsdp2"]).actor.offload
