"""Training a vision-language model (polyrl/training/vlm.py): a GRPO update on an image batch
through the real DDP engine and PPO actor moves what it should (the language model; the vision
tower only with model.train_vision_tower), the reference path scores images exactly, FSDP2 ranks
with and without images stay in step, LoRA's all-linear skips a frozen tower, loading by config;
Qwen2-VL, and Qwen3-VL (deep-stack features) where the family matters."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.training import vlm
from tests.tiny_vl import FAMILIES, build_tiny_vl, tiny_vl_processor
from tests.training.test_vlm_forward import hf_logprobs, image_batch


@pytest.fixture(scope="module")
def batch():
    return image_batch(tiny_vl_processor())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("train_vision_tower", [False, True], ids=["frozen-tower", "trained-tower"])
def test_grpo_update_on_images_moves_what_it_should(batch, train_vision_tower, family):
    """Qwen3-VL's trained tower includes its deep-stack mergers, which only the deep-stack
    features added inside the language model connect to the loss."""
    import vlm_ranks

    engine, actor = vlm_ranks.build("ddp", 0, 1, train_vision_tower, family=family)
    before = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    metrics = actor.update(batch, 1, False)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/nonfinite_skipped"] == 0
    moved = {k for k, v in engine.model.named_parameters() if not torch.equal(v, before[k])}
    tower = {k for k in before if k.startswith("model.visual.")}
    language = set(before) - tower
    assert language <= moved  # every language-model parameter takes a step (embeddings tied to the head)
    assert (tower <= moved) if train_vision_tower else not (tower & moved), sorted(tower - moved)[:4]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_reference_engine_scores_images_as_hf(batch, family):
    """A frozen engine (the reference / the proximal pass) over the whole batch, packed: each
    sample's log-probs are its Hugging Face forward's."""
    import vlm_ranks

    engine, _ = vlm_ranks.build("ddp", 0, 1, False, horizon=None, family=family)
    scored = engine.logprobs(batch)
    for i in range(len(batch)):
        torch.testing.assert_close(scored.row(i), hf_logprobs(engine.model, batch, i), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fsdp2_ranks_with_and_without_images_train_as_one_ddp_rank(tmp_path):
    """Two FSDP2 ranks, the vision blocks units of their own: rank 0's micro-batches have
    images, rank 1's none, yet every all-gather lines up (rank 1 runs the tower on a blank
    image whose output counts zero) and the update equals one DDP rank's on the whole batch.
    Qwen2-VL only: for Qwen3-VL what differs (the blank image's reach into the deep-stack
    mergers) is test_blank_image_reaches_every_tower_parameter's, at a fraction of the time."""
    import vlm_ranks
    from gloo_world import run_world_ok

    ranks = run_world_ok(vlm_ranks.train, 2, tmp_path, args=("fsdp2",), timeout_s=240, backend_timeout_s=200)
    reference = vlm_ranks.train(0, 1, "ddp")
    for k, want in reference["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][k], want, rtol=1e-4, atol=1e-4, msg=k)
    assert ranks[0]["metrics"]["actor/loss"] == pytest.approx(reference["metrics"]["actor/loss"], rel=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_blank_image_reaches_every_tower_parameter(family):
    """FSDP2's text-only micro-batches run the tower on a blank image (`image_forward`): its
    output must depend on every tower parameter a real image reaches (Qwen3-VL: the deep-stack
    mergers too), or such a rank brings fewer gradients to the unit's reduce-scatter."""
    model = build_tiny_vl(family=family)
    model.model.visual.requires_grad_(True)
    vlm._blank_image_features(model.model).sum().backward()
    missing = [n for n, p in model.model.visual.named_parameters() if p.grad is None]
    assert not missing


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_lora_all_linear_leaves_a_frozen_tower_out(family):
    model = build_tiny_vl(family=family)
    excluded = vlm.lora_excluded(model, train_vision_tower=False)
    tower = {n for n, m in model.model.visual.named_modules() if isinstance(m, torch.nn.Linear)}
    assert excluded == {f"model.visual.{n}" for n in tower} and excluded
    if family == "qwen3_vl":
        assert any(".deepstack_merger_list." in n for n in excluded)
    assert vlm.lora_excluded(model, train_vision_tower=True) == set()


@pytest.mark.parametrize("family,cls", [("qwen2_vl", "Qwen2VLForConditionalGeneration"),
                                        ("qwen3_vl", "Qwen3VLForConditionalGeneration")])
def test_loads_by_config_with_the_tower_frozen(tmp_path, family, cls):
    path = build_tiny_vl(tmp_path / "vl", family=family)
    assert vlm.is_vlm_dir(path) and not vlm.is_vlm_dir(tmp_path)
    model = vlm.load_vlm(path)
    assert type(model).__name__ == cls
    assert model.config._attn_implementation == "sdpa"
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    assert vlm.model_class(model.config).__name__ == "AutoModelForImageTextToText"
    config = json.loads((tmp_path / "vl" / "config.json").read_text())
    with pytest.raises(vlm.VLMError, match=r"model.path: a llava vision-language model; polyrl trains qwen2_vl"):
        vlm.check_supported({**config, "model_type": "llava"})
