"""Image prompts through the real vLLM (its CPU build in CI: scripts/vllm_tier.sh), issue #31.

One engine on a tiny random Qwen2-VL (tests/tiny_vl.py, head_dim 32: vLLM's CPU attention takes
no smaller head) saved to tmp, checked against Hugging Face's own model on the same weights:
greedy tokens and fp32 log-probs of image prompts, text-only prompts in the same batch, different
images giving different outputs, and full weight updates under the trainer's names reaching the
vision tower (vLLM caches vision-tower outputs per image, so a stale cache would show here).

vLLM's Qwen2-VL module imports transformers' torchvision image processor, so these tests need a
torchvision that imports next to the CPU torch; without one they skip naming it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.data.multimodal import ImageInputs, mm_token_type_ids
from polyrl.rollout.base import RolloutInputError, SamplingParams
from tiny_vl import (PATCH_DIM, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START,
                     build_tiny_vl, char_ids, random_image_prompt, tiny_vl_image_processor, vl_tokenizer)

# The engine tests are marked vllm + slow one by one; the two checks at the end need no vLLM.

_TOK = vl_tokenizer()
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)




def sharpened_tiny_vl() -> torch.nn.Module:
    """tests/tiny_vl.py's Qwen2-VL at hidden 128, weights scaled so tokens depend on the image.
    The vision tokens' (tied) embedding rows are made ~0 so neither model ever samples one: HF's
    forward would read a sampled `<|image_pad|>` as another image's placeholder."""
    model = build_tiny_vl(hidden=128)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        embed = model.get_input_embeddings().weight
        for token in (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END):
            embed[_TOK.convert_tokens_to_ids(token)] *= 1e-3
    return model.eval()




@torch.no_grad()
def hf_greedy_and_logprobs(model, ids, images, n=GREEDY.max_tokens) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by repeated full forwards (no cache), then its log-probs."""
    tokens: list[int] = []
    logprobs = []
    for _ in range(n):
        x = torch.tensor([ids + tokens])
        mm = {} if images is None else dict(pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw,
                                            mm_token_type_ids=mm_token_type_ids(x, model.config.image_token_id))
        last = torch.log_softmax(model(input_ids=x, **mm).logits[0, -1].float(), -1)
        tokens.append(int(last.argmax()))
        logprobs.append(last[tokens[-1]])
    return tokens, torch.stack(logprobs)


@pytest.fixture(scope="module")
def hf_model():
    return sharpened_tiny_vl()


@pytest.fixture(scope="module")
def engine(vllm_available, hf_model, tmp_path_factory):
    try:
        import torchvision  # noqa: F401  (vllm/model_executor/models/qwen2_vl.py needs it, via transformers)
    except Exception as exc:  # a CUDA-built wheel next to the CPU torch fails at import, not with ImportError
        pytest.skip(f"vLLM's Qwen2-VL needs torchvision, which does not import here ({exc}); "
                    "install the CPU build: pip install torchvision --index-url https://download.pytorch.org/whl/cpu")
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.factory import build_disaggregated_engine

    path = tmp_path_factory.mktemp("tiny_vl_vllm")
    hf_model.save_pretrained(str(path))
    tiny_vl_image_processor().save_pretrained(str(path))
    _TOK.save_pretrained(str(path))
    cfg = RolloutConfig(backend="vllm", placement="standalone", dtype="float32", max_model_len=128,
                        max_num_seqs=16, enforce_eager=True)
    eng = build_disaggregated_engine(cfg, str(path), torch.device("cpu"))
    yield eng
    eng.shutdown()


def assert_matches_hf(model, ids, images, out, atol=1e-4) -> None:
    tokens, logprobs = hf_greedy_and_logprobs(model, ids, images)
    assert out.token_ids == tokens
    print(f"vLLM vs HF log-prob max abs diff (fp32, {0 if images is None else images.num_images} images): "
          f"{(torch.tensor(out.logprobs) - logprobs).abs().max().item():.2e}")
    torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, atol=atol, rtol=0)


@pytest.mark.vllm
@pytest.mark.slow
def test_image_and_text_prompts_in_one_batch_equal_hf(hf_model, engine):
    one, one_images = random_image_prompt(hf_model.config, [(1, 4, 4)], seed=1)
    two, two_images = random_image_prompt(hf_model.config, [(1, 4, 6), (1, 2, 2)], seed=2)
    plain = char_ids("no image here")
    outs = engine.generate_batch([one, two, plain], GREEDY, images=[one_images, two_images, None])
    assert_matches_hf(hf_model, one, one_images, outs[0][0])
    assert_matches_hf(hf_model, two, two_images, outs[1][0])
    assert_matches_hf(hf_model, plain, None, outs[2][0])
    assert all(len(g[0].token_ids) == GREEDY.max_tokens for g in outs)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_same_ids_with_other_images_give_other_outputs(hf_model, engine):
    ids, images = random_image_prompt(hf_model.config, [(1, 4, 4)], seed=3)
    _, other = random_image_prompt(hf_model.config, [(1, 4, 4)], seed=4)
    [[a], [b]] = engine.generate_batch([ids, ids], GREEDY, images=[images, other])
    assert a.logprobs != b.logprobs
    assert_matches_hf(hf_model, ids, other, b)


@pytest.mark.vllm
@pytest.mark.slow
def test_full_weight_updates_reach_the_vision_tower(hf_model, engine):
    """The trainer's names (`model.visual.*`, `model.language_model.*`, tied weights once); the
    same image before and after, so an encoder output cached under the old weights would show."""
    ids, images = random_image_prompt(hf_model.config, [(1, 4, 6)], seed=8)
    [[before]] = engine.generate_batch([ids], GREEDY, images=[images])
    changed = copy.deepcopy(hf_model)
    with torch.no_grad():
        changed.model.visual.merger.mlp[2].weight.mul_(-2.0)
        changed.model.visual.blocks[0].attn.qkv.weight.add_(0.1)
    version = engine.weight_version + 1
    engine.update_weights(dict(changed.named_parameters()), version)
    [[after]] = engine.generate_batch([ids], GREEDY, images=[images])
    assert after.weight_version == version and after.logprobs != before.logprobs
    assert_matches_hf(changed, ids, images, after)

    engine.update_weights(dict(hf_model.named_parameters()), version + 1)
    [[back]] = engine.generate_batch([ids], GREEDY, images=[images])
    assert back.token_ids == before.token_ids
    torch.testing.assert_close(torch.tensor(back.logprobs), torch.tensor(before.logprobs), atol=1e-5, rtol=0)


@pytest.mark.vllm
@pytest.mark.slow
def test_bad_image_input_is_refused_naming_images(hf_model, engine):
    ids, images = random_image_prompt(hf_model.config, [(1, 4, 4)], seed=5)
    _, wrong = random_image_prompt(hf_model.config, [(1, 4, 6)], seed=5)
    with pytest.raises(RolloutInputError, match="images"):  # the grid needs 6 pads, the ids hold 4
        engine.generate_batch([ids], GREEDY, images=[wrong])
    with pytest.raises(RolloutInputError, match="no images"):
        engine.generate_batch([ids], GREEDY)
    with pytest.raises(RolloutInputError, match="one entry per prompt"):
        engine.generate_batch([ids], GREEDY, images=images)


def test_placeholder_ranges_follow_the_grids_or_name_images():
    """Pure: where each image's pads are, and the one-line refusals (no vLLM needed)."""
    from polyrl.rollout.engines.vllm import image_placeholder_ranges

    from tiny_vl import tiny_vl_config

    cfg = tiny_vl_config(_TOK, hidden=128)
    ids, images = random_image_prompt(cfg, [(1, 4, 6), (1, 2, 2)], seed=0)
    first = ids.index(cfg.image_token_id)
    ranges = image_placeholder_ranges(ids, images, cfg.image_token_id, 2)
    assert ranges[0] == (first, 6) and ranges[1][1] == 1 and ranges[1][0] > first + 6
    with pytest.raises(RolloutInputError, match="runs of \\[6, 1\\]"):
        image_placeholder_ranges(ids[:first] + ids[first + 1:], images, cfg.image_token_id, 2)
    with pytest.raises(RolloutInputError, match="spatial_merge_size"):
        image_placeholder_ranges(ids, ImageInputs(torch.zeros(27, PATCH_DIM), torch.tensor([[1, 3, 9]])),
                                 cfg.image_token_id, 2)


def test_vlm_launch_turns_off_device_normalization_only_where_vllm_has_it():
    import dataclasses

    from polyrl.rollout.engines.vllm import image_launch_args

    @dataclasses.dataclass
    class New:  # vLLM >= 0.32's AsyncEngineArgs has the field
        mm_device_do_normalize: bool | None = None

    @dataclasses.dataclass
    class Old:
        model: str = ""

    assert image_launch_args({}, New) == {"mm_device_do_normalize": False}
    assert image_launch_args({}, Old) == {}
    with pytest.raises(ValueError, match="mm_device_do_normalize"):
        image_launch_args({"mm_device_do_normalize": True}, New)
