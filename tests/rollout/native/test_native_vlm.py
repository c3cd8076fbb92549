"""The native engine serves Qwen2-VL: vision tower at prefill, M-RoPE, rope delta in decode.

Every check is against Hugging Face's own model on the same weights (tests/tiny_vl.py's random
Qwen2-VL, sharpened so greedy tokens depend on the image and its positions): `generate` for
greedy tokens, one forward over prompt + response for log-probs (fp32, within 1e-5).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from polyrl.data.multimodal import ImageInputs, mm_token_type_ids
from polyrl.rollout.base import RolloutInputError, SamplingParams, WeightUpdateError
from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.native.vision import mrope_positions
from polyrl.weights.base import as_stream
from tiny_vl import (IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, build_tiny_vl,
                     char_ids, random_image_prompt, vl_tokenizer)

_TOK = vl_tokenizer()
# A random model samples `<|image_pad|>` too, which HF's forward then reads as an image's
# placeholder: the vision tokens are banned here (bias -100) and in HF's generate (suppressed).
VISION_TOKENS = [_TOK.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)]
NO_VISION = {t: -100.0 for t in VISION_TOKENS}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=NO_VISION)


@pytest.fixture(scope="module")
def hf_model():
    model = build_tiny_vl()
    # the 0.02 init gives near-uniform logits (every prompt greedily repeats one token)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model


@pytest.fixture(scope="module")
def engine(hf_model, tmp_path_factory):
    """Loaded from a saved directory: the checkpoint's names (`model.layers.*`, `visual.*`)."""
    path = tmp_path_factory.mktemp("tiny_vl")
    hf_model.save_pretrained(str(path))
    return NativeEngine(path, tokenizer=False, max_model_len=256)






def _mm(model, ids: torch.Tensor, images: ImageInputs | None) -> dict:
    if images is None:
        return {}
    return dict(pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw,
                mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id))


def hf_greedy(model, ids, images, n=GREEDY.max_tokens) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, suppress_tokens=VISION_TOKENS, **_mm(model, x, images))
    return out[0, len(ids):].tolist()


@torch.no_grad()
def hf_logprobs(model, ids, images, tokens) -> torch.Tensor:
    full = torch.tensor([ids + tokens])
    logits = model(input_ids=full, **_mm(model, full, images)).logits[0, len(ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_matches_hf(model, ids, images, out) -> None:
    assert out.token_ids == hf_greedy(model, ids, images)
    torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs(model, ids, images, out.token_ids),
                               atol=1e-5, rtol=0)


def test_mrope_positions_equal_transformers_get_rope_index(hf_model):
    # non-square grids and text between and after the images: every branch of the rope index
    ids, images = random_image_prompt(hf_model.config, [(1, 4, 6), (1, 6, 2)])
    x = torch.tensor([ids])
    want, want_delta = hf_model.model.get_rope_index(x, mm_token_type_ids(x, hf_model.config.image_token_id),
                                                     image_grid_thw=images.image_grid_thw)
    got, delta = mrope_positions(ids, images.image_grid_thw, hf_model.config.image_token_id, 2)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta) and delta < 0


def test_image_prompts_in_one_batch_equal_hf(hf_model, engine):
    """Two prompts with other images (other grids, lengths: padded prefill) and a text-only
    prompt, in one batch: each is HF's greedy generation, its log-probs HF's forward."""
    a = random_image_prompt(hf_model.config, [(1, 4, 6), (1, 2, 4)], seed=1)
    b = random_image_prompt(hf_model.config, [(1, 2, 2)], seed=2)
    plain = char_ids("no image here")
    outs = engine.generate_batch([a[0], b[0], plain], GREEDY, images=[a[1], b[1], None])
    for (ids, images), [out] in zip([a, b, (plain, None)], outs):
        assert_matches_hf(hf_model, ids, images, out)
    # the image is what the model reads: the same ids with other pixels generate otherwise
    [[other]] = engine.generate_batch([a[0]], GREEDY, images=[random_image_prompt(hf_model.config, [(1, 4, 6), (1, 2, 4)],
                                                                            seed=3)[1]])
    assert other.logprobs != outs[0][0].logprobs


def test_streaming_an_image_prompt_ends_with_what_generate_batch_returns(hf_model, engine):
    ids, images = random_image_prompt(hf_model.config, [(1, 2, 4)], seed=4)
    sampling = SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=7, ignore_eos=True, logit_bias=NO_VISION)

    async def stream():
        async with engine.generate_stream(ids, sampling, images=images) as updates:
            return [u async for u in updates][-1].outputs

    streamed = asyncio.run(stream())
    [batch] = engine.generate_batch([ids], sampling, images=[images])
    assert [o.token_ids for o in streamed] == [o.token_ids for o in batch]
    for out in streamed:  # sampled, not greedy: the log-probs of what was sampled are HF's
        torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs(hf_model, ids, images, out.token_ids),
                                   atol=1e-5, rtol=0)


def test_the_prefix_cache_keys_on_the_images(hf_model):
    """A next turn with the same ids but other pixels must not reuse the first turn's K/V; with
    the same pixels it does, and its new tokens (a second image among them) are computed with
    their M-RoPE ids and features: both equal HF on the whole prompt."""
    engine = NativeEngine.from_model(hf_model, prefix_cache_tokens=4096, max_model_len=256)
    cfg = hf_model.config
    ids, red = random_image_prompt(cfg, [(1, 4, 4)], seed=5)
    _, blue = random_image_prompt(cfg, [(1, 4, 4)], seed=6)
    _, green = random_image_prompt(cfg, [(1, 2, 4)], seed=7)
    [[first]] = engine.generate_batch([ids], GREEDY, images=[red])
    second_image, _ = random_image_prompt(cfg, [(1, 2, 4)], words=(" then ", " end"))
    turn2 = ids + first.token_ids + second_image

    both_blue = ImageInputs.concat([blue, green])
    [[other]] = engine.generate_batch([turn2], GREEDY, images=[both_blue])
    assert engine.stats["prefix_reused_tokens"] == 0
    assert_matches_hf(hf_model, turn2, both_blue, other)

    both_red = ImageInputs.concat([red, green])
    [[same]] = engine.generate_batch([turn2], GREEDY, images=[both_red])
    assert engine.stats["prefix_reused_tokens"] == len(ids) + len(first.token_ids) - 1
    assert_matches_hf(hf_model, turn2, both_red, same)


def test_weight_updates_reach_the_vision_tower(hf_model):
    """In place, under the names a trainer sends (`model.visual.*`, `model.language_model.*`)
    and the saved ones (`visual.*`); a changed tower changes what is generated, as in HF."""
    engine = NativeEngine.from_model(hf_model, max_model_len=256)
    ids, images = random_image_prompt(hf_model.config, [(1, 4, 6)], seed=8)
    [[before]] = engine.generate_batch([ids], GREEDY, images=[images])
    changed = copy.deepcopy(hf_model)
    with torch.no_grad():
        changed.model.visual.merger.mlp[2].weight.mul_(-2.0)
        changed.model.visual.blocks[0].attn.qkv.weight.add_(0.1)
    tower = engine._weights.visual
    address = tower.merger.mlp[2].weight.data_ptr()

    engine.update_weights({"model.visual.merger.mlp.2.weight": changed.model.visual.merger.mlp[2].weight,
                           "visual.blocks.0.attn.qkv.weight": changed.model.visual.blocks[0].attn.qkv.weight}, 1)
    [[after]] = engine.generate_batch([ids], GREEDY, images=[images])
    assert tower.merger.mlp[2].weight.data_ptr() == address
    assert after.logprobs != before.logprobs and after.weight_version == 1
    assert_matches_hf(changed, ids, images, after)

    # a whole sync as a trainer's in-place transport sends it (a WeightStream, loaded tensor by
    # tensor) under its names: named_parameters, tied weights once (a LoRA merge names the same)
    engine.update_weights(as_stream(dict(hf_model.named_parameters())), 2)
    [[back]] = engine.generate_batch([ids], GREEDY, images=[images])
    assert back.token_ids == before.token_ids and back.logprobs == before.logprobs

    with pytest.raises(WeightUpdateError, match="model.visual.nope"):
        engine.update_weights({"model.visual.nope": torch.zeros(2)}, 3)
    assert engine.weight_version == 2


def test_bad_image_input_is_refused_naming_images(hf_model, engine, model_dirs):
    cfg = hf_model.config
    ids, images = random_image_prompt(cfg, [(1, 4, 4)])
    with pytest.raises(RolloutInputError, match="image placeholder run") as err:
        engine.generate_batch([ids], GREEDY)  # placeholders without images
    assert err.value.field == "images"
    with pytest.raises(RolloutInputError, match=r"runs of \[4\] tokens, the images need \[4, 2\]"):
        engine.generate_batch([ids], GREEDY, images=[ImageInputs.concat([images, random_image_prompt(cfg, [(1, 2, 4)])[1]])])
    narrow = ImageInputs(images.pixel_values[:, :100], images.image_grid_thw)
    with pytest.raises(RolloutInputError, match=r"shape \(16, 100\); the grids and the vision tower need \(16, 1176\)"):
        engine.generate_batch([ids], GREEDY, images=[narrow])
    with pytest.raises(RolloutInputError, match="1 entries for 2 prompts"):
        engine.generate_batch([ids, ids], GREEDY, images=[images])
    with pytest.raises(RolloutInputError, match="one entry per prompt"):
        engine.generate_batch([ids], GREEDY, images=images)
    text_only = NativeEngine(model_dirs["qwen2"], tokenizer=False, max_model_len=64)
    with pytest.raises(RolloutInputError, match="text-only"):
        text_only.generate_batch([[3, 4]], GREEDY, images=[images])
    with pytest.raises(ValueError, match="batch_invariant=True is not supported"):
        NativeEngine.from_model(hf_model, batch_invariant=True)


def _other_vl(config_cls, model_cls, vision_config: dict, **text_overrides):
    """A random model of another VL family with the tiny Qwen2-VL's text shape and token ids."""
    base = build_tiny_vl().config
    text_config = {k: v for k, v in base.text_config.to_dict().items() if k != "model_type"}
    config = config_cls(text_config={**text_config, **text_overrides}, tie_word_embeddings=True,
                        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                           temporal_patch_size=2, **vision_config),
                        **{k: getattr(base, k) for k in ("image_token_id", "video_token_id",
                                                         "vision_start_token_id", "vision_end_token_id")})
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model


def test_qwen2_5_vl_windowed_vision_tower_equals_hf():
    """Qwen2.5-VL: another vision tower (window attention, gated MLP, RMSNorm), the same decoder
    and M-RoPE; a 4 x 12 grid spans two attention windows."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    model = _other_vl(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                      dict(window_size=56, fullatt_block_indexes=[1]))
    ids, images = random_image_prompt(model.config, [(1, 4, 12)], seed=9)
    [[out]] = NativeEngine.from_model(model, max_model_len=128).generate_batch([ids], GREEDY, images=[images])
    assert_matches_hf(model, ids, images, out)


def test_qwen3_vl_deep_stack_and_interleaved_mrope_equal_hf():
    """Qwen3-VL: a Qwen3 decoder (q/k-norm), M-RoPE rows interleaved over the frequencies, and the
    tower's deep-stack features added to the image tokens after the first two decoder layers;
    also on a prefix-cached next turn that adds an image (deep-stack in the extend path)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    model = _other_vl(Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                      dict(deepstack_visual_indexes=[0, 1], num_position_embeddings=64),
                      head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [4, 2, 2], "mrope_interleaved": True})
    engine = NativeEngine.from_model(model, max_model_len=128, prefix_cache_tokens=1024)
    ids, images = random_image_prompt(model.config, [(1, 4, 6), (1, 2, 4)], seed=10)
    [[out]] = engine.generate_batch([ids], GREEDY, images=[images])
    assert_matches_hf(model, ids, images, out)
    more, added = random_image_prompt(model.config, [(1, 4, 4)], seed=11, words=(" then ", " end"))
    turn2, both = ids + out.token_ids + more, ImageInputs.concat([images, added])
    [[second]] = engine.generate_batch([turn2], GREEDY, images=[both])
    assert engine.stats["prefix_reused_tokens"] == len(ids) + len(out.token_ids) - 1
    assert_matches_hf(model, turn2, both, second)
