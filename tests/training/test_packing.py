"""Packed micro-batches through the per-sample attention (polyrl/batch/packed.py,
polyrl/training/varlen.py): the same loss and gradients as the padded path (fp32, bf16 autocast,
grouped-query attention, a sample longer than the budget, gradient checkpointing), no attention
across samples, no [T, T] mask, the model otherwise unchanged, and the engines' `actor.packing`."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.batch import Ragged, RolloutBatch, collate
from polyrl.batch.packed import collate_packed, plan_packed
from polyrl.training import varlen
from polyrl.training.logprobs import response_logprobs

CPU = torch.device("cpu")
PROMPTS, RESPONSES = (3, 5, 2, 4, 9, 1, 6), (6, 1, 4, 3, 2, 7, 40)
"""The last sample (45 tokens fed) is longer than BUDGET: a pack of its own."""
BUDGET = 32


def tiny_model(seed: int = 0):
    """Qwen2 with grouped-query attention (4 query heads share 2 key/value heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg)


def make_batch(prompts=PROMPTS, responses=RESPONSES, seed: int = 5) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    p = Ragged.from_rows([torch.randint(2, 64, (k,), generator=g).tolist() for k in prompts], torch.long)
    r = Ragged.from_rows([torch.randint(2, 64, (k,), generator=g).tolist() for k in responses], torch.long)
    n = len(prompts)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(prompt_ids=p, response_ids=r, loss_mask=Ragged.full_like(r, 1.0, torch.float32),
                        group=torch.arange(n), stop_reason=zeros, finished_with_eos=zeros.bool(),
                        weight_version=zeros, min_version=zeros, max_version=zeros, continuations=zeros)


def logprobs_and_grads(model, mbs, weights, autocast=False):
    """Per-sample log-probs (a list in batch order) and parameter gradients of one pass."""
    model.zero_grad(set_to_none=True)
    per_sample = {}
    for mb in mbs:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = response_logprobs(model, mb, with_entropy=True, entropy_grad=True)
        w = weights[mb.indices][:, :lp.shape[1]]
        ((lp + 0.1 * ent) * w * mb.response_mask).sum().backward()
        for row, i in enumerate(mb.indices.tolist()):
            per_sample[i] = lp[row, :int(mb.response_lengths[row])].detach()
    return [per_sample[i] for i in sorted(per_sample)], {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True])
def test_packed_equals_padded(autocast):
    batch = make_batch()
    weights = torch.randn(len(PROMPTS), max(RESPONSES), generator=torch.Generator().manual_seed(1))
    packs = plan_packed(batch.lengths, BUDGET)
    assert [len(RESPONSES) - 1] in packs and len(packs) >= 2  # the long sample alone, the rest packed
    mbs = [collate_packed(batch, idx, CPU) for idx in packs]
    assert all(mb.attention_mask is None and mb.input_ids.shape[0] == 1 for mb in mbs)
    model = tiny_model()
    padded = logprobs_and_grads(model, [collate(batch, list(range(len(PROMPTS))), CPU)], weights, autocast)
    packed = logprobs_and_grads(model, mbs, weights, autocast)
    assert model.config._attn_implementation == varlen.VARLEN_ATTENTION
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(packed[0], padded[0]):
        torch.testing.assert_close(a, b, **tol)
    for k in padded[1]:
        torch.testing.assert_close(packed[1][k], padded[1][k], **tol, msg=k)


def test_gradient_checkpointing_recomputes_the_packed_attention():
    """With checkpointing a layer's forward runs again inside the backward: it must still attend
    per sample (why the model is switched once rather than around each forward)."""
    batch = make_batch()
    weights = torch.randn(len(PROMPTS), max(RESPONSES), generator=torch.Generator().manual_seed(1))
    model = tiny_model()
    padded = logprobs_and_grads(model, [collate(batch, list(range(len(PROMPTS))), CPU)], weights)
    model.gradient_checkpointing_enable()
    model.train()
    packed = logprobs_and_grads(model, [collate_packed(batch, idx, CPU) for idx in plan_packed(batch.lengths, BUDGET)],
                                weights)
    for k in padded[1]:
        torch.testing.assert_close(packed[1][k], padded[1][k], rtol=1e-4, atol=1e-5, msg=k)


def test_no_attention_across_samples_and_no_dense_mask(monkeypatch):
    """Other samples' tokens change, a sample's log-probs stay bit-identical; every attention call
    covers one sample, and no mask is built."""
    import transformers.masking_utils

    batch, other = make_batch(seed=5), make_batch(seed=6)
    # sample 2 of `other` differs from sample 2 of `batch`; take everything else from `batch`
    mixed = make_batch(seed=5)
    rows = lambda r: [r.row(i).tolist() for i in range(len(r.lengths))]  # noqa: E731
    mp, mr = rows(mixed.prompt_ids), rows(mixed.response_ids)
    mp[2], mr[2] = other.prompt_ids.row(2).tolist(), other.response_ids.row(2).tolist()
    mixed = mixed.replace(prompt_ids=Ragged.from_rows(mp, torch.long), response_ids=Ragged.from_rows(mr, torch.long))
    idx = [0, 1, 2, 3, 4]
    model = tiny_model().eval()

    def no_mask(*a, **k):
        raise AssertionError("a dense mask was built for a packed row")

    monkeypatch.setattr(transformers.masking_utils, "sdpa_mask", no_mask)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(varlen.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: seen.append(q.shape) or sdpa(q, *a, **k))
    with torch.no_grad():
        lp_a, _ = response_logprobs(model, collate_packed(batch, idx, CPU))
        lp_b, _ = response_logprobs(model, collate_packed(mixed, idx, CPU))
    fed = [p + r - 1 for p, r in zip(PROMPTS, RESPONSES)][:5]
    # samples batched by similar length, each padded to a multiple of 8 or by at most 25%:
    # never a call over the whole row, nor its T^2 scores
    padded = [max(-(-n // 8) * 8, 1.25 * n) for n in fed]
    assert max(shape[2] for shape in seen) <= max(padded) < sum(fed)
    scores = sum(shape[0] * shape[2] ** 2 for shape in seen) / 4  # 2 layers x 2 forwards
    assert sum(n * n for n in fed) <= scores <= sum(n * n for n in padded) < sum(fed) ** 2 / 2
    assert sum(shape[0] for shape in seen) == 4 * len(fed)  # every sample in exactly one call per layer
    assert not torch.equal(lp_a[2], lp_b[2])
    for i in (0, 1, 3, 4):
        assert torch.equal(lp_a[i], lp_b[i]), i


def test_positions_alone_still_separate_samples():
    """A caller that packs with restarting position ids but no boundaries gets the same result."""
    model = tiny_model().eval()
    mb = collate_packed(make_batch(), [0, 1, 2, 3], CPU)
    varlen.use_varlen_attention(model)
    with torch.no_grad():
        a = model.model(input_ids=mb.input_ids, **varlen.packed_forward_kwargs(mb)).last_hidden_state
        b = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids).last_hidden_state
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_model_is_otherwise_unchanged(tmp_path):
    """After the switch the padded path is bit-identical to sdpa, and a saved checkpoint records
    no custom attention (it loads in a transformers without polyrl's registration)."""
    from transformers import AutoConfig

    batch = make_batch()
    plain = tiny_model()
    plain.save_pretrained(tmp_path / "before")
    mb = collate(batch, [0, 1, 2], CPU)
    with torch.no_grad():
        before, _ = response_logprobs(plain, mb)
        response_logprobs(plain, collate_packed(batch, [0, 1, 2], CPU))  # switches the model
        after, _ = response_logprobs(plain, mb)
    assert plain.config._attn_implementation == varlen.VARLEN_ATTENTION
    assert torch.equal(before, after)
    plain.save_pretrained(tmp_path / "after")
    saved = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("before", "after")]
    assert saved[0] == saved[1] and varlen.VARLEN_ATTENTION not in json.dumps(saved[1])
    assert AutoConfig.from_pretrained(tmp_path / "after")._attn_implementation != varlen.VARLEN_ATTENTION


def test_setup_packing_resolves_per_engine():
    model = tiny_model()
    assert varlen.setup_packing(model, "off", head_reads_packed=True, compiled=False) == "off"
    assert model.config._attn_implementation == "sdpa"
    assert varlen.setup_packing(model, "auto", head_reads_packed=False, compiled=False) == "off"  # a critic
    assert varlen.setup_packing(model, "auto", head_reads_packed=True, compiled=True) == "off"
    with pytest.raises(ValueError, match="actor.packing=on: actor.compile"):
        varlen.setup_packing(model, "on", head_reads_packed=True, compiled=True)
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model()
    eager.set_attn_implementation("eager")
    assert varlen.setup_packing(eager, "auto", head_reads_packed=True, compiled=False) == "off"
    with pytest.raises(ValueError, match="not sdpa.*actor.packing=auto or off"):
        varlen.setup_packing(eager, "on", head_reads_packed=True, compiled=False)
    assert varlen.setup_packing(model, "auto", head_reads_packed=True, compiled=False) == "auto"
    assert model.config._attn_implementation == varlen.VARLEN_ATTENTION


def test_config_field():
    from polyrl.training.config import ActorConfig

    assert ActorConfig().packing == "auto"
    assert ActorConfig(packing=True).packing == "on"  # YAML reads a bare on as a boolean
    with pytest.raises(ValueError, match="actor.packing=on cannot run under actor.compile=on"):
        ActorConfig(packing="on", compile="on")


def _train(model_path: str, packing: str, strategy: str = "ddp") -> dict:
    """engine_ranks' fixed updates on one rank, with the reference log-probs of a batch before them."""
    import engine_ranks

    engine, actor = engine_ranks.build(model_path, engine_ranks.actor_config(strategy, packing=packing), 0, 1)
    scored = engine.logprobs(engine_ranks.make_batch(9, 7))
    return {"packing": engine.packing, "attention": engine.module.config._attn_implementation,
            "logprobs": scored.values, "metrics": engine_ranks._updates(actor, engine_ranks.BATCHES[:1], 0, 1),
            "weights": engine_ranks.full_weights(engine)}


def test_ddp_engine_packed_trains_and_scores_as_padded(tiny_model):
    """actor.packing=on through the real PPOActor and DDP engine: the same log-probs, losses and
    trained weights (one update, two optimizer steps) as padded micro-batches (budget 64 tokens)."""
    padded, packed = _train(tiny_model, "off"), _train(tiny_model, "on")
    assert (padded["packing"], padded["attention"]) == ("off", "sdpa")
    assert (packed["packing"], packed["attention"]) == ("on", varlen.VARLEN_ATTENTION)
    torch.testing.assert_close(packed["logprobs"], padded["logprobs"], rtol=1e-5, atol=1e-5)
    for a, b in zip(packed["metrics"], padded["metrics"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for k in padded["weights"]:
        torch.testing.assert_close(packed["weights"][k], padded["weights"][k], rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.slow
def test_fsdp2_two_ranks_packed_train_as_ddp_padded(tiny_model, tmp_path):
    """Packed micro-batches on two FSDP2 ranks (different pack counts per rank, one rank idle in
    the last update) train as padded ones on one DDP rank."""
    import engine_ranks
    from gloo_world import run_world_ok

    ranks = run_world_ok(engine_ranks.train, 2, tmp_path, args=(tiny_model, "fsdp2", engine_ranks.BATCHES,
                                                                {"packing": "on"}),
                         timeout_s=240, backend_timeout_s=200)
    reference = engine_ranks.train(0, 1, tiny_model, "ddp", overrides={"packing": "off"})
    for r in ranks.values():
        for a, b in zip(r["metrics"], reference["metrics"]):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for k in reference["weights"]:
        torch.testing.assert_close(ranks[0]["weights"][k], reference["weights"][k], rtol=1e-4, atol=1e-4, msg=k)


def test_bucket_plan_pads_similar_lengths_together():
    """Segments of 3 and 7 tokens share an 8-token bucket, an empty one is skipped, a 40-token one
    rounds up to 40 (a multiple of a quarter of 32); every row position maps to its own slot."""
    gather, scatter, shapes = varlen._bucket_plan([0, 3, 3, 10, 50], CPU)
    assert shapes == [(2, 8), (1, 40)]
    assert gather.tolist()[:8] == [0, 1, 2, 2, 2, 2, 2, 2] and len(gather) == 2 * 8 + 40
    assert torch.equal(gather[scatter], torch.arange(50))


@pytest.mark.slow
def test_training_run_packed_matches_padded(ray_session, tiny_model, arith_files, tmp_path):
    """Two GRPO steps of the real loop (colocated rollout, reward, update, weight sync) with
    actor.packing=on log the metrics of actor.packing=off."""
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    runs = {}
    for packing in ("off", "on"):
        out = tmp_path / packing
        Trainer(load_config(JobConfig, overrides=[
            f"model.path={tiny_model}", f"data.train_files=[{arith_files['train']}]", "data.val_files=[]",
            "data.train_batch_size=4", "rollout.n=4", "rollout.response_length=12", "actor.lr=0.01",
            "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.save_at_end=false",
            "actor.num_cpus_per_worker=1", f"trainer.output_dir={out}", f"actor.packing={packing}"])).fit()
        runs[packing] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["on"]) == len(runs["off"]) == 2
    for a, b in zip(runs["off"], runs["on"]):
        for key in ("reward/score_mean", "response/length_mean", "actor/loss", "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
