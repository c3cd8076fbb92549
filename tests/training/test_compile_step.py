"""actor.compile (polyrl/training/compiled.py): when `auto` compiles, the config error, and that a
compiled DDP engine really compiles and trains like the eager one (loss, log-probs, gradients,
updated weights) under bf16 autocast, over two micro-batches of different shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.training.compiled import AUTO_MIN_STEPS, should_compile


def _auto(**over):
    kw = dict(device=torch.device("cpu"), compute_dtype=torch.bfloat16, horizon=AUTO_MIN_STEPS,
              lora=False, gradient_checkpointing=False)
    kw.update(over)
    return should_compile("auto", **kw)


def test_auto_compiles_only_the_measured_case():
    assert _auto()
    assert not _auto(compute_dtype=torch.float32)
    assert not _auto(horizon=AUTO_MIN_STEPS - 1)
    assert not _auto(horizon=None)  # a frozen reference engine
    assert not _auto(lora=True)
    assert not _auto(gradient_checkpointing=True)
    assert not _auto(device=torch.device("meta"))
    assert should_compile("on", device=torch.device("cpu"), compute_dtype=torch.float32, horizon=None,
                          lora=True, gradient_checkpointing=True)
    assert not should_compile("off", device=torch.device("cpu"), compute_dtype=torch.bfloat16,
                              horizon=10 * AUTO_MIN_STEPS, lora=False, gradient_checkpointing=False)


def test_compile_on_with_fsdp2_names_the_fields():
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig

    with pytest.raises((ConfigError, ValueError), match=r"actor.compile=on needs actor.strategy=ddp"):
        load_config(JobConfig, overrides=["actor.compile=on", "actor.strategy=fsdp2"])
    assert load_config(JobConfig, overrides=["actor.compile=auto", "actor.strategy=fsdp2"]).actor.compile == "auto"
    # YAML reads a bare on / off as a boolean: both still mean the switch's values
    assert load_config(JobConfig, overrides=["actor.compile=off"]).actor.compile == "off"
    assert load_config(JobConfig, overrides=["actor.compile=on"]).actor.compile == "on"


def _micro_batches():
    """Two micro-batches of different (rows, length): the compiled graph must cover both."""
    from polyrl.batch import Ragged, RolloutBatch, collate

    g = torch.Generator().manual_seed(0)
    n = 6
    prompts = [torch.randint(2, 100, (3 + i % 3,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(2, 100, (4 + 2 * i,), generator=g).tolist() for i in range(n)]
    resp = Ragged.from_rows(responses, torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=Ragged.from_rows(prompts, torch.long), response_ids=resp,
                         loss_mask=Ragged.full_like(resp, 1.0, torch.float32), group=torch.arange(n) // 2,
                         stop_reason=zeros, finished_with_eos=zeros.bool(), weight_version=zeros,
                         min_version=zeros, max_version=zeros, continuations=zeros)
    return [collate(batch, idx, torch.device("cpu")) for idx in ([0, 1, 2, 3], [4, 5])]


def _train_step(engine, mbs):
    losses, logprobs = [], []
    for mb in mbs:
        lp, _ = engine.forward(mb, with_entropy=True)
        adv = torch.linspace(-1, 1, mb.target_ids.numel()).view_as(mb.target_ids)
        loss = (lp * adv * mb.response_mask).sum() / 20.0
        engine.backward(loss)
        losses.append(float(loss.detach()))
        logprobs.append(lp.detach())
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    result = engine.optimizer_step(sum(losses))
    return losses, logprobs, grads, result


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    """The tiny model with one decoder layer: a second identical layer adds nothing this test
    checks, but inductor compiles it too (forward and backward, for two shapes)."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("one-layer"), layers=1)


@pytest.mark.slow  # compiling even a 1-layer model takes tens of seconds on a CPU
def test_compiled_engine_trains_like_eager(one_layer_model):
    from polyrl.platform import get_platform
    from polyrl.training.ddp import DDPEngine
    from polyrl.training.config import ActorConfig
    from polyrl.training.model_loading import load_causal_lm

    torch._dynamo.reset()
    model = load_causal_lm(one_layer_model, "float32", False)
    engines = {}
    for mode in ("off", "on"):
        cfg = ActorConfig(compute_dtype="bfloat16", lr=1e-3, compile=mode)
        engines[mode] = DDPEngine(copy.deepcopy(model), cfg, get_platform("cpu"), torch.device("cpu"), horizon=10)
    assert engines["on"].compiled and not engines["off"].compiled
    mbs = _micro_batches()
    eager, compiled = _train_step(engines["off"], mbs), _train_step(engines["on"], mbs)
    # the switch took effect: the compiled engine compiled (and says how long it took)
    assert eager[3].compile_s is None and compiled[3].compile_s is not None and compiled[3].compile_s > 0
    # the same numerics within bf16 rounding (the tolerance of tests/training/test_logprobs.py's
    # bf16 equivalence tests): inductor fuses element-wise ops and rounds intermediates differently
    tol = dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), **tol)
    for name, g in eager[2].items():
        torch.testing.assert_close(compiled[2][name], g, **tol, msg=name)
    assert compiled[3].grad_norm == pytest.approx(eager[3].grad_norm, rel=2e-2)
    # AdamW's first step moves every weight by ~lr in the sign of its gradient, so a near-zero
    # gradient that rounds to the other sign moves the other way (k_proj's bias has an exactly-zero
    # gradient in exact arithmetic: softmax ignores it): compare the whole model's update
    start = dict(model.named_parameters())
    eager_w = dict(engines["off"].model.named_parameters())
    diff = moved = 0.0
    for name, p in engines["on"].model.named_parameters():
        ours, theirs = p.detach() - start[name].detach(), eager_w[name].detach() - start[name].detach()
        diff, moved = diff + float((ours - theirs).abs().sum()), moved + float(theirs.abs().sum())
    assert moved > 0 and diff <= 0.02 * moved
    # a second step with the same shapes runs the compiled graphs without compiling again
    assert _train_step(engines["on"], mbs)[3].compile_s is None
