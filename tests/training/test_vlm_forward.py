"""Image batches through the trainer (polyrl/batch, polyrl/training/vlm.py, logprobs.py): each
sample's images stay with it through selection, concatenation, pickling, micro-batching and
packing, and the log-probs of a micro-batched or packed image batch equal one plain Hugging Face
forward per sample (tests/tiny_vl.py's random Qwen2-VL, Qwen2.5-VL and Qwen3-VL, fp32)."""

from __future__ import annotations

import pickle

import pytest
import torch

from polyrl.batch import Ragged, RolloutBatch, collate
from polyrl.batch.packed import collate_packed
from polyrl.training.logprobs import response_logprobs
from tests.tiny_vl import FAMILIES, build_tiny_vl, image_inputs_for, shape_image, tiny_vl_processor

CPU = torch.device("cpu")
PROMPTS = (
    ("user: <|vision_start|><|image_pad|><|vision_end|>what colour?\nassistant: ", ("red",)),
    ("user: how many sides has a square?\nassistant: ", ()),
    ("user: <|vision_start|><|image_pad|><|vision_end|> and "
     "<|vision_start|><|image_pad|><|vision_end|>same?\nassistant: ", ("blue", "green")),
    ("user: <|vision_start|><|image_pad|><|vision_end|>shape?\nassistant: ", ("yellow",)),
)
"""One image, none, two images, one image: a text-only sample between image samples."""
RESPONSE_LENGTHS = (5, 9, 3, 12)


@pytest.fixture(scope="module")
def tiny():
    """(model, processor, batch): the random tiny Qwen2-VL and an image batch, built once."""
    model = build_tiny_vl()
    processor = tiny_vl_processor()
    return model, processor, image_batch(processor)


@pytest.fixture(scope="module")
def family_model(tiny):
    """family -> its random tiny model (tests/tiny_vl.py), each built once for the module."""
    built = {"qwen2_vl": tiny[0]}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny_vl(family=family)
        return built[family]
    return get


def image_batch(processor, samples_per_prompt: int = 1, seed: int = 3) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    rows, images, responses = [], [], []
    for i, (text, colours) in enumerate(PROMPTS):
        ids, inputs = image_inputs_for(processor, text, [shape_image(c, seed=i) for c in colours])
        for _ in range(samples_per_prompt):
            rows.append(ids)
            images.append(inputs)  # the samples of one prompt share its object
            # ordinary characters (ids 2..99): no response token is an image placeholder
            responses.append(torch.randint(2, 100, (RESPONSE_LENGTHS[i],), generator=g).tolist())
    n = len(rows)
    response_ids = Ragged.from_rows(responses, torch.long)
    zeros = torch.zeros(n, dtype=torch.long)
    return RolloutBatch(prompt_ids=Ragged.from_rows(rows, torch.long), response_ids=response_ids,
                        loss_mask=Ragged.full_like(response_ids, 1.0, torch.float32),
                        group=torch.arange(n) // samples_per_prompt, stop_reason=zeros,
                        finished_with_eos=zeros.bool(), weight_version=zeros, min_version=zeros,
                        max_version=zeros, continuations=zeros, advantages=torch.linspace(-1, 1, n),
                        images=images)


def hf_logprobs(model, batch: RolloutBatch, i: int) -> torch.Tensor:
    """Sample i's response log-probs from one plain Hugging Face forward of prompt + response."""
    prompt, response = batch.prompt_ids.row(i), batch.response_ids.row(i)
    ids = torch.cat([prompt, response]).unsqueeze(0)
    image = batch.images[i]
    kwargs = {} if image is None else dict(pixel_values=image.pixel_values, image_grid_thw=image.image_grid_thw,
                                           mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].float()
    P = len(prompt)
    return torch.log_softmax(logits[P - 1:-1], -1).gather(1, response.unsqueeze(1)).squeeze(1)


def per_sample(model, batch, plan, packed: bool) -> dict[int, torch.Tensor]:
    out = {}
    for idx in plan:
        mb = collate_packed(batch, idx, CPU) if packed else collate(batch, idx, CPU)
        with torch.no_grad():
            lp, _ = response_logprobs(model, mb)
        for row, i in enumerate(mb.indices.tolist()):
            out[i] = lp[row, :int(mb.response_lengths[row])]
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_micro_batched_logprobs_equal_one_hf_forward_per_sample(tiny, family_model, packed, family):
    """Micro-batches of two and of all four samples (images of several prompts in one vision
    call, a text-only sample among them), padded or packed, give each sample the log-probs of
    its own Hugging Face forward with its own images and M-RoPE positions (Qwen3-VL: also its
    deep-stack features, added to the image tokens after the first decoder layers)."""
    from polyrl.training import varlen

    _, _, batch = tiny
    model = family_model(family)
    if packed:
        varlen.use_varlen_attention(model)
    try:
        expected = [hf_logprobs(model, batch, i) for i in range(len(batch))]
        for plan in ([[2, 0], [1, 3]], [[3, 1, 0, 2]]):
            got = per_sample(model, batch, plan, packed)
            for i, want in enumerate(expected):
                torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5, msg=f"sample {i}, plan {plan}")
    finally:
        model.set_attn_implementation("sdpa")


def test_images_change_the_logprobs(tiny):
    """The forward reads the pixels: the same ids with another image's pixels score differently
    (a forward that ignored the images would pass the equality test above on text alone)."""
    model, _, batch = tiny
    other = batch.replace(images=[batch.images[3], None, batch.images[2], batch.images[0]])
    a = per_sample(model, batch, [[0, 3]], packed=False)
    b = per_sample(model, other, [[0, 3]], packed=False)
    assert not torch.allclose(a[0], b[0], atol=1e-4)


def test_a_text_only_model_given_images_fails_in_one_line(tiny):
    from polyrl.training.vlm import VLMError
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, _, batch = tiny
    text_model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(VLMError, match="prompts have images but Qwen2ForCausalLM has no vision tower"):
        per_sample(text_model, batch, [[0]], packed=False)


def test_each_sample_keeps_its_images_through_select_cat_and_shards(tiny):
    _, _, batch = tiny
    picked = batch.select([3, 1, 0])
    assert picked.images == [batch.images[3], None, batch.images[0]]
    text_only = batch.select([1]).replace(images=None)
    joined = RolloutBatch.cat([picked, text_only])
    assert joined.images == [batch.images[3], None, batch.images[0], None]
    assert RolloutBatch.cat([text_only, text_only]).images is None  # text-only batches stay free


def test_for_training_takes_the_images_of_the_prompts(tiny):
    """The driver attaches data rows (`prompts`); the policy ranks get their images."""
    from types import SimpleNamespace

    _, _, batch = tiny
    rows = [SimpleNamespace(images=x) for x in batch.images]
    driver = batch.replace(images=None, prompts=rows, texts=["t"] * len(batch))
    trained = driver.for_training()
    assert trained.prompts is None and trained.texts is None
    assert trained.images == batch.images
    assert batch.replace(images=None, prompts=[SimpleNamespace(images=None)] * len(batch)).for_training().images is None


def test_micro_batch_gets_its_rows_images(tiny):
    _, _, batch = tiny
    for packed in (False, True):
        mb = (collate_packed if packed else collate)(batch, [3, 1, 2], CPU)
        assert mb.image_index.tolist() == [0, -1, 1] and mb.image_objects.tolist() == [1, 2]
        want = [batch.images[3], batch.images[2]]
        torch.testing.assert_close(mb.images.pixel_values, torch.cat([x.pixel_values for x in want]))
        torch.testing.assert_close(mb.images.image_grid_thw, torch.cat([x.image_grid_thw for x in want]))
        assert mb.prompt_lengths.tolist() == batch.prompt_ids.lengths[[3, 1, 2]].tolist()
    assert collate(batch, [1], CPU).images is None  # a text-only micro-batch has none


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_group_s_shared_images_are_encoded_once(tiny, packed):
    """Two samples of each of two prompts (one image; two images) in one micro-batch: the vision
    tower reads each prompt's pixels once, and every sample scores as its own HF forward."""
    from polyrl.training import varlen

    model, processor, _ = tiny
    batch = image_batch(processor, samples_per_prompt=2)
    rows = [0, 4, 1, 5]
    mb = (collate_packed if packed else collate)(batch, rows, CPU)
    once = batch.images[0].pixel_values.shape[0] + batch.images[4].pixel_values.shape[0]
    assert mb.images.pixel_values.shape[0] == once
    assert mb.image_index.tolist() == [0, 1, 0, 1]
    if packed:
        varlen.use_varlen_attention(model)
    try:
        got = per_sample(model, batch, [rows], packed)
        for i in rows:
            torch.testing.assert_close(got[i], hf_logprobs(model, batch, i), rtol=1e-5, atol=1e-5, msg=f"sample {i}")
    finally:
        model.set_attn_implementation("sdpa")


def test_pickled_batch_holds_each_prompts_pixels_once(tiny):
    """Eight samples of each prompt (a GRPO group) pickle about one copy of the pixels, through
    numpy arrays (out of band under Ray), and come back equal, sharing again."""
    _, processor, _ = tiny
    batch = image_batch(processor, samples_per_prompt=8)
    pixel_bytes = sum(x.pixel_values.numel() * 4 for x in {id(x): x for x in batch.images if x is not None}.values())
    data = pickle.dumps(batch, protocol=5)
    assert len(data) < 1.5 * pixel_bytes + 20_000
    buffers = []  # what Ray's serializer does: numpy arrays out of band, the rest in the stream
    in_band = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(in_band) < 20_000 and sum(b.raw().nbytes for b in buffers) >= pixel_bytes
    back = pickle.loads(in_band, buffers=buffers)
    assert [x is None for x in back.images] == [x is None for x in batch.images]
    for a, b in zip(back.images, batch.images):
        if a is not None:
            torch.testing.assert_close(a.pixel_values, b.pixel_values)
            torch.testing.assert_close(a.image_grid_thw, b.image_grid_thw)
    assert back.images[0] is back.images[7] and back.images[0] is not back.images[8]
    assert pickle.loads(pickle.dumps(batch.replace(images=None))).images is None


def test_gradient_checkpointing_replays_images_and_positions(tiny):
    """Checkpointed layers (vision blocks and decoder layers) recompute in the backward with the
    same image embeddings and M-RoPE positions: the same log-probs and gradients, packed."""
    from polyrl.training import varlen

    _, _, batch = tiny
    results = []
    for checkpointing in (False, True):
        model = build_tiny_vl().train()
        model.model.visual.requires_grad_(True)
        if checkpointing:
            model.gradient_checkpointing_enable()
        varlen.use_varlen_attention(model)
        mb = collate_packed(batch, [0, 1, 2, 3], CPU)
        lp, _ = response_logprobs(model, mb)
        (lp * mb.response_mask).sum().backward()
        results.append((lp.detach(), {k: p.grad for k, p in model.named_parameters()}))
    (lp_a, grads_a), (lp_b, grads_b) = results
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-6)
    assert any(k.startswith("model.visual.") and g.abs().sum() > 0 for k, g in grads_a.items())
    for k, g in grads_a.items():
        torch.testing.assert_close(grads_b[k], g, rtol=1e-4, atol=1e-6, msg=k)
