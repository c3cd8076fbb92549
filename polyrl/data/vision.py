"""Image rows -> expanded prompt ids + `ImageInputs` (polyrl/data/multimodal.py), as verl reads them.

The schema is verl's multimodal one, unchanged: an `images` column holding, per row, a list of
images, each `{"bytes": ..., "path": ...}` (how Hugging Face `datasets` writes an Image feature
to parquet) or a path string; the chat prompt marks where each goes with an `<image>`
placeholder inside a message's text (verl's Geometry3K preprocessing writes exactly that), or
with a `{"type": "image"}` / `{"type": "image_url"}` content part (OpenAI / HF chat style).

A row is rendered the way verl renders it: each `<image>` becomes an image content part, the
model's chat template turns every image part into `<|vision_start|><|image_pad|><|vision_end|>`,
and the single `<|image_pad|>` of image i is expanded to t*h*w / merge_size**2 copies, with
(t, h, w) the image's patch grid from the model's image processor. That is what
`Qwen2VLProcessor.__call__` does (tests/data/test_vision.py checks the ids are equal). It is
done here rather than by `AutoProcessor` because transformers' Qwen2-VL processor refuses to be
built without its video processor, which needs torchvision; the image processor itself is the
model directory's own (`AutoImageProcessor`), which without torchvision is the PIL / numpy one
(`Qwen2VLImageProcessorPil`; its class is logged once per load).
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrl.data.errors import DataFileError
from polyrl.data.multimodal import ImageInputs

logger = logging.getLogger(__name__)

IMAGES_KEY = "images"
"""verl's column of a row's images."""
IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes inside a message's text (verl's schema)."""
IMAGE_PARTS = ("image", "image_url")
"""Content-part types that hold one image (HF chat templates / OpenAI chat)."""
IMAGE_PAD = "<|image_pad|>"
"""The Qwen2-VL token the chat template writes once per image and the processor expands."""
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
"""A vision-language model directory's processor settings (beside its tokenizer's files): every
model directory polyrl writes (checkpoint policy/, `polyrl export`) carries the ones it had."""


def copy_processor_files(source: str | Path, target: str | Path) -> list[str]:
    """Copy the PROCESSOR_FILES `source` has into `target`; the names copied (none for a text model)."""
    import shutil

    copied = []
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(target) / name)
            copied.append(name)
    return copied


class ImageRowError(ValueError):
    """Why one row's images cannot be used (a bad row: data.on_bad_row decides)."""


@dataclass
class VisionPrompter:
    """The model's tokenizer and image processor, turning (messages, images) into expanded ids."""

    tokenizer: Any
    image_processor: Any
    image_pad_id: int
    merge_size: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None, tokenizer: Any) -> "VisionPrompter":
        """The prompter of a Qwen2-VL-style model directory; a text-only model, or a VLM without
        its image processor, is a DataFileError naming the fix (the caller runs before Ray)."""
        where = str(model_dir) if model_dir else "the tokenizer's model"
        config = _read_config(model_dir)
        if config is None or config.get("vision_config") is None:
            raise DataFileError(
                f"the data has image rows ('{IMAGES_KEY}' column) but the model {where} is a "
                "text-only model (no vision_config in its config.json); set model.path to a "
                "vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, e.g. builtin:tiny-vl) or remove "
                f"the '{IMAGES_KEY}' column")
        if not (Path(str(model_dir)) / "preprocessor_config.json").is_file():
            raise DataFileError(
                f"the vision-language model {where} has no image processor (preprocessor_config.json); "
                "copy preprocessor_config.json from the model's original repository into that directory")
        from transformers import AutoImageProcessor
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its "falling back to the PIL processor" notice, logged below
        try:
            image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
        finally:
            hf_logging.set_verbosity(verbosity)
        pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if pad_id is None or pad_id == tokenizer.unk_token_id or pad_id != config.get("image_token_id", pad_id):
            raise DataFileError(
                f"the tokenizer of {where} has no {IMAGE_PAD} token matching the model's "
                f"image_token_id={config.get('image_token_id')}; use the model's own tokenizer "
                "(unset model.tokenizer_path)")
        logger.info("image rows: %s's image processor is %s", where, type(image_processor).__name__)
        return cls(tokenizer, image_processor, pad_id, int(image_processor.merge_size))

    def encode(self, text: str, images: list[Any]) -> tuple[list[int], ImageInputs | None]:
        """Ids of the rendered `text` (one IMAGE_PAD per image, in order) with each pad expanded
        to its image's token count, and the images' processor outputs."""
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        inputs = self.process(images)
        return self.expand(ids, inputs)[0], inputs

    def process(self, images: list[Any]) -> ImageInputs | None:
        """The image processor's pixel patches and grids of `images` (PIL), None for none."""
        if not images:
            return None
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except (ValueError, TypeError) as exc:  # e.g. Qwen2-VL: "absolute aspect ratio must be smaller than 200"
            sizes = ", ".join(f"{getattr(x, 'width', '?')}x{getattr(x, 'height', '?')}" for x in images)
            raise ImageRowError(f"the image processor refuses the image(s) ({sizes}): {exc}") from None
        return ImageInputs(out["pixel_values"].float(), out["image_grid_thw"].long())

    def expand(self, ids: list[int], inputs: ImageInputs | None,
               *aligned: list[int]) -> tuple[list[int], ...]:
        """`ids` with image i's single IMAGE_PAD repeated t*h*w / merge**2 times, and each list
        of `aligned` (one value per id, e.g. a loss mask) with 0 at the added positions.

        The same ids `Qwen2VLProcessor` gets by expanding the text before tokenising: the pad is
        a special token, so the tokenizer cuts the text at it and the text between pads
        tokenises the same either way."""
        pads = sum(1 for t in ids if t == self.image_pad_id)
        images = 0 if inputs is None else inputs.num_images
        if pads != images:
            raise ImageRowError(f"the chat template wrote {pads} image placeholders for {images} images")
        if inputs is None:
            return (ids, *aligned)
        counts = iter(inputs.num_placeholder_tokens(self.merge_size))
        out: list[list[int]] = [[] for _ in range(1 + len(aligned))]
        for k, t in enumerate(ids):
            n = next(counts) if t == self.image_pad_id else 1
            out[0].extend([t] * n)
            for column, values in zip(out[1:], aligned):
                column.extend([values[k]] + [0] * (n - 1))
        return tuple(out)


def flatten_text_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content parts are all text, with that text as its one string content:
    what it means to any chat template, including text-only ones that would print the list."""
    content = message.get("content")
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" for p in content):
        return {**message, "content": "".join(p.get("text") or "" for p in content)}
    return message


def has_images(row: dict[str, Any], prompt_key: str) -> bool:
    """The row takes the image path: an images column (even empty: its prompt's `<image>`
    count is then checked), or image content parts in its prompt."""
    if row.get(IMAGES_KEY) is not None:
        return True
    prompt = row.get(prompt_key)
    if not isinstance(prompt, list):
        return False
    return any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS
               for m in prompt if isinstance(m.get("content"), list) for p in m["content"])


def row_images(row: dict[str, Any]) -> list[Any] | None:
    """The row's image entries (a list, maybe empty), or None when the row has no images column."""
    images = row.get(IMAGES_KEY)
    if images is None:
        return None
    if isinstance(images, (str, dict)):
        return [images]
    if not isinstance(images, list):
        raise ImageRowError(f"'{IMAGES_KEY}' must be a list of images ({{'bytes', 'path'}} or "
                            f"paths), got {type(images).__name__}")
    return images


def open_image(entry: Any):
    """One image entry as an RGB PIL image: {"bytes": ..., "path": ...} (verl also writes
    {"image": path}), a path string, or a PIL image (rows built in Python)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(entry, Image.Image):
        return _eight_bit(entry).convert("RGB")
    if isinstance(entry, dict):
        data, path = entry.get("bytes"), entry.get("path") or entry.get("image")
    elif isinstance(entry, str):
        data, path = None, entry
    else:
        raise ImageRowError(f"an image must be {{'bytes', 'path'}} or a path, got {type(entry).__name__}")
    if data is None and isinstance(path, str):
        path = _local_path(path)
    name = f" {path}" if path else ""
    try:
        if data is not None:
            image = Image.open(io.BytesIO(data))
        elif path:
            image = Image.open(Path(path).expanduser())
        else:
            raise ImageRowError("an image has neither bytes nor a path")
        # Image.open read the header only: refuse a decompression bomb before decoding it (PIL
        # raises past 2x MAX_IMAGE_PIXELS and only warns between 1x and 2x; with warnings as
        # errors the warning is raised instead, caught below like the error)
        if image.width * image.height > (Image.MAX_IMAGE_PIXELS or float("inf")):
            raise Image.DecompressionBombError(
                f"{image.width}x{image.height} pixels is over PIL's limit of {Image.MAX_IMAGE_PIXELS}")
        return _eight_bit(image).convert("RGB")  # also forces the decode: a truncated file fails here
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRowError(f"image{name} is too large to decode (a decompression bomb?): {exc}") from None
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise ImageRowError(f"image{name} cannot be read: {type(exc).__name__}: {exc}") from None


def _eight_bit(image: Any) -> Any:
    """`image` with 16-bit (and 32-bit integer or float) grey levels scaled to 8 bits: PIL's own
    convert("RGB") clips them at 255, which turns most of a 16-bit image white."""
    mode = image.mode
    if not (mode.startswith("I") or mode == "F"):
        return image
    import numpy as np
    from PIL import Image

    values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if mode.startswith("I;16"):
        top = 65535.0
    else:  # "I" or "F": the range the values use (a 0..1 float image, an 8- or 16-bit one)
        peak = float(values.max()) if values.size else 0.0
        top = 1.0 if mode == "F" and peak <= 1.0 else 255.0 if peak <= 255 else 65535.0 if peak <= 65535 else peak
    scaled = np.clip(values, 0.0, top) * (255.0 / top)
    return Image.fromarray(np.rint(scaled).astype(np.uint8))  # 2-D uint8: mode "L"


def anchor_image_paths(row: dict[str, Any], base_dir: str | Path) -> dict[str, Any]:
    """`row` with each relative image path that names a file under `base_dir` (the data file's
    directory) made absolute, as a dataset moved with its images expects; a relative path found
    only from the working directory is left as it is (the way older polyrl read it). Covers the
    images column and image content parts in any message list of the row."""
    base = Path(base_dir)

    def anchored(value: Any) -> Any:
        if (isinstance(value, str) and value and "://" not in value and not value.startswith(("data:", "~"))
                and not Path(value).is_absolute() and (base / value).is_file()):
            return str(base / value)
        return value

    def entry(value: Any) -> Any:
        if isinstance(value, dict) and value.get("bytes") is None:
            return {k: anchored(v) if k in ("path", "image") else v for k, v in value.items()}
        return anchored(value)

    def part(value: Any) -> Any:
        if not (isinstance(value, dict) and value.get("type") in IMAGE_PARTS):
            return value
        out = {k: entry(v) if k in ("image", "path", "url") else v for k, v in value.items()}
        url = value.get("image_url")
        if url is not None:
            out["image_url"] = {**url, "url": anchored(url.get("url"))} if isinstance(url, dict) else anchored(url)
        return out

    out = dict(row)
    images = row.get(IMAGES_KEY)
    if isinstance(images, list):
        out[IMAGES_KEY] = [entry(x) for x in images]
    elif images is not None:
        out[IMAGES_KEY] = entry(images)
    for key, value in row.items():
        if isinstance(value, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                           for m in value):
            out[key] = [{**m, "content": [part(p) for p in m["content"]]}
                        if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in value]
    return out


def with_image_parts(messages: list[dict[str, Any]],
                     placeholders: bool = True) -> tuple[list[dict[str, Any]], list[Any]]:
    """`messages` with every `<image>` in a text split into an image content part (as verl
    does) and every image part reduced to `{"type": "image"}` (what chat templates expect), plus
    one entry per image part, in order: the image the part carries inline (an `image_url` data
    URL or path, an `image` / `path` field), or None where the row's images column supplies it.
    `placeholders=False` leaves `<image>` in text alone (a row without an images column)."""
    out, inline = [], []
    for message in messages:
        content = message.get("content")
        if placeholders and isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts = []
            for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if i:
                    parts.append({"type": "image"})
                    inline.append(None)
                if piece:
                    parts.append({"type": "text", "text": piece})
            message = {**message, "content": parts}
        elif isinstance(content, list):
            parts = []
            for part in content:
                # parquet structs give every part every field: drop the unset ones
                part = {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                    inline.append(_inline_image(part))
                    part = {"type": "image"}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, inline


def images_for(row: dict[str, Any], inline: list[Any]) -> list[Any]:
    """The images of a row whose prompt holds `len(inline)` image parts: the images column's,
    else the parts' own; a count that does not match is the row's problem."""
    column = row_images(row)
    if column is not None and any(x is not None for x in inline):
        raise ImageRowError(f"images both inline in the prompt and in the '{IMAGES_KEY}' column; keep one")
    if column is None:
        if any(x is None for x in inline):
            raise ImageRowError(f"the prompt has {len(inline)} image placeholders but the row has "
                                f"no '{IMAGES_KEY}' column")
        return inline
    if len(column) != len(inline):
        raise ImageRowError(f"the prompt has {len(inline)} image placeholders ({IMAGE_PLACEHOLDER} or "
                            f"image parts) but '{IMAGES_KEY}' holds {len(column)} images")
    return column


def _inline_image(part: dict[str, Any]) -> Any:
    """The image an image part carries itself (a path, {"bytes", "path"} or data URL), or None."""
    value = part.get("image_url") or part.get("image") or part.get("path") or part.get("url")
    if isinstance(value, dict) and "url" in value:
        value = value["url"]
    if isinstance(value, str) and value.startswith("data:"):
        return {"bytes": _data_url_bytes(value), "path": None}
    if isinstance(value, str):
        return _local_path(value)
    return value


def _local_path(value: str) -> str:
    """A path string or file:// URL as a path; any other URL is refused (nothing is downloaded)."""
    if value.startswith("file://"):
        return value[len("file://"):]
    if "://" in value:
        raise ImageRowError(f"image {value[:60]} is a remote URL; polyrl reads images from bytes, "
                            "data URLs or local paths only (download it into the data first)")
    return value


def _data_url_bytes(url: str) -> bytes:
    import base64
    import binascii

    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ImageRowError("an image data URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ImageRowError(f"an image data URL is not valid base64: {exc}") from None


def _read_config(model_dir: str | Path | None) -> dict[str, Any] | None:
    if not model_dir:
        return None
    try:
        return json.loads((Path(str(model_dir)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
