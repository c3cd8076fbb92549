"""A tiny random Qwen2-VL-shaped model, its tokenizer and processor, built in-process (no downloads).

Shared by the #31 tests (data, trainer, native engine). Sizes are the smallest that keep every
Qwen2-VL code path alive: M-RoPE (head_dim 16 -> mrope_section [2, 3, 3]), a 1-block vision tower,
patch 14 and spatial merge 2, so a 56x56 image is 4x4 patches -> 4 image-pad tokens.
`family="qwen2_5_vl"` / `"qwen3_vl"` give the same language model shape and tokens with those
families' towers (Qwen3-VL: its Qwen3 decoder, interleaved M-RoPE and deep-stack features).

    from tests.tiny_vl import build_tiny_vl, tiny_vl_processor, image_inputs_for
    model = build_tiny_vl()                      # in memory
    model = build_tiny_vl(family="qwen3_vl")     # a tiny Qwen3-VL
    path = build_tiny_vl(tmp_path / "vl")        # saved: model + tokenizer + image processor
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

# Qwen2-VL's own special-token spellings: the chat template and the processor look for these.
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"

# Renders {"type": "image"} content parts as Qwen2-VL does (one pad token the processor expands).
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

IMAGE_SIDE = 56
"""Pixels per side of the test images: 56 = 4 patches of 14, one 2x2 merge -> 4 tokens."""


def vl_tokenizer():
    """The char-level test tokenizer plus Qwen2-VL's four vision special tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for c in string.printable:
        if c not in "\t\r\x0b\x0c":
            vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    out.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    out.chat_template = VL_CHAT_TEMPLATE
    return out


PATCH_DIM = 3 * 2 * 14 * 14
"""One flattened patch: channels x temporal patch x patch x patch (the tiny configs' patch 14)."""


def char_ids(s: str, tokenizer: Any | None = None) -> list[int]:
    """`s` as the character-level tokenizer's ids, one per character."""
    tok = tokenizer if tokenizer is not None else vl_tokenizer()
    return [tok.convert_tokens_to_ids(c) for c in s]


def random_image_prompt(config, grids, seed=0, words=("look ", " and ", " ok")) -> tuple[list[int], Any]:
    """Ids with each image expanded as the processor does (2 x 2 merge), and random pixels for the
    grids: the engines' tests' image prompt."""
    import torch

    from polyrl.data.multimodal import ImageInputs

    tok = vl_tokenizer()
    ids = char_ids(words[0], tok)
    for i, (t, h, w) in enumerate(grids):
        pads = [config.image_token_id] * (t * h * w // 4)
        ids += [config.vision_start_token_id] + pads + [config.vision_end_token_id]
        ids += char_ids(words[min(i + 1, len(words) - 1)], tok)
    g = torch.Generator().manual_seed(seed)
    return ids, ImageInputs(torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g),
                            torch.tensor(grids))


def tiny_vl_config(tokenizer: Any | None = None, hidden: int = 64, layers: int = 2,
                   vision_depth: int = 1, embed_dim: int = 32, vocab_size: int = 128):
    """A Qwen2VLConfig of ~0.2 M parameters whose special-token ids match `vl_tokenizer()`."""
    from transformers import Qwen2VLConfig

    tok = tokenizer if tokenizer is not None else vl_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    assert max(ids.values()) < vocab_size, (ids, vocab_size)
    heads = 4
    half_head = hidden // heads // 2
    # M-RoPE splits each head's rotary half into (temporal, height, width) sections.
    mrope = [half_head - 2 * (half_head // 3), half_head // 3, half_head // 3]
    return Qwen2VLConfig(
        text_config=dict(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=vocab_size,
            max_position_embeddings=512, eos_token_id=tok.eos_token_id, bos_token_id=None,
            pad_token_id=tok.pad_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        ),
        vision_config=dict(
            depth=vision_depth, embed_dim=embed_dim, hidden_size=hidden, num_heads=2,
            mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        ),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""The vision-language families `build_tiny_vl(family=...)` builds."""

_OTHER_TOWER = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2)
"""Qwen2.5-VL's and Qwen3-VL's vision tower (both gated / RMS-normed, 2 blocks of width 32)."""


def tiny_family_config(family: str = "qwen2_vl", tokenizer: Any | None = None, **config_kwargs):
    """`tiny_vl_config`'s language model and token ids with `family`'s vision tower:
    Qwen2.5-VL with window attention in block 0 and full attention in block 1; Qwen3-VL with
    deep-stack features from both blocks (added after decoder layers 0 and 1), a Qwen3 decoder
    (head_dim 16, q/k norms) and M-RoPE rows interleaved over the frequencies ([4, 2, 2]), and
    three decoder layers: what is added after the last layer reaches no response token (the
    image tokens are not attended after it), so with two its deep-stack merger 1 would get a
    zero gradient."""
    if family == "qwen3_vl":
        config_kwargs.setdefault("layers", 3)
    base = tiny_vl_config(tokenizer, **config_kwargs)
    if family == "qwen2_vl":
        return base
    text = {k: v for k, v in base.text_config.to_dict().items() if k != "model_type"}
    tokens = {k: getattr(base, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                            "vision_end_token_id")}
    vision = dict(_OTHER_TOWER, out_hidden_size=text["hidden_size"])
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, window_size=56, fullatt_block_indexes=[1]),
                                tie_word_embeddings=True, **tokens)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        half_head = 8  # head_dim 16: the rotary half split into (temporal, height, width) sections
        text.update(head_dim=2 * half_head,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [half_head // 2, half_head // 4, half_head // 4],
                                     "mrope_interleaved": True})
        vision.update(deepstack_visual_indexes=[0, 1], num_position_embeddings=64)
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **tokens)
    raise ValueError(f"family: {family!r}; one of {FAMILIES}")


def tiny_vl_image_processor():
    """The slow (PIL / numpy) Qwen2-VL image processor: there is no torchvision here, and the
    fast one needs it. Fixed 56x56 pixel budget so every test image is 4 tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side2 = IMAGE_SIDE * IMAGE_SIDE
    return Qwen2VLImageProcessorPil(size={"shortest_edge": side2, "longest_edge": side2},
                                    patch_size=14, temporal_patch_size=2, merge_size=2)


def tiny_vl_processor(tokenizer: Any | None = None):
    """Hugging Face's own `Qwen2VLProcessor` (it expands each image-pad token to t*h*w /
    merge**2): the reference the seam's ids must equal. Its constructor insists on a video
    processor, which needs torchvision (absent here), so this subclass lets video be None;
    images go through the unchanged `__call__`."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = tokenizer if tokenizer is not None else vl_tokenizer()
    return ImageOnlyQwen2VLProcessor(image_processor=tiny_vl_image_processor(), tokenizer=tok,
                                     video_processor=None, chat_template=VL_CHAT_TEMPLATE)


def build_tiny_vl(path: Path | None = None, seed: int = 0, family: str = "qwen2_vl", **config_kwargs):
    """A random tiny Qwen2-VL (or `family`'s model, `tiny_family_config`): the model itself when
    `path` is None, else saved (model, tokenizer, image processor config) under `path` and the
    path returned as a string."""
    from transformers import AutoModelForImageTextToText

    tok = vl_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_family_config(family, tok, **config_kwargs))
    if path is None:
        return model.eval()
    model.save_pretrained(str(path))
    tiny_vl_image_processor().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def write_tiny_vl_processor_dir(path: Path) -> str:
    """A model directory with everything the data layer reads (config.json, tokenizer, image
    processor) and no weights: cheap, for tests that never run the model."""
    tok = vl_tokenizer()
    tiny_vl_config(tok).save_pretrained(str(path))
    tiny_vl_image_processor().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def png_bytes(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def shape_image(colour: str = "red", seed: int = 0, side: int = IMAGE_SIDE):
    """A small PIL image with one filled rectangle (content varies with seed)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (side, side), "white")
    x = 4 + (seed * 7) % (side // 2)
    ImageDraw.Draw(img).rectangle([x, 8, x + side // 3, 8 + side // 3], fill=colour)
    return img


def image_inputs_for(processor, text: str, images: list) -> tuple[list[int], Any]:
    """(input_ids, ImageInputs) for one prompt text with `<|image_pad|>` per image, via the
    real processor: the expanded ids the seam contract (polyrl/data/multimodal.py) describes."""
    from polyrl.data.multimodal import ImageInputs

    enc = processor(text=[text], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    if not images:
        return ids, None
    return ids, ImageInputs(enc["pixel_values"].float(), enc["image_grid_thw"].long())


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A valid, all-black 1-bit PNG of width x height (20000x20000: 400M pixels in 50 kB), built
    with zlib directly because PIL takes seconds to encode it."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte 0, then the packed 1-bit pixels
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(row * height, 9)) + chunk(b"IEND", b""))
