"""Vision-language models in the native engine: Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

The language model is the engine's own decoder (model.py) with two additions, both here:

- **M-RoPE.** Each token has three position ids (temporal, height, width). Text tokens carry the
  same id in all three, so a text-only prompt rotates exactly as plain RoPE; an image's tokens
  carry their grid coordinates, and the text after an image continues from the largest of them,
  so a prompt's last position is its length plus a (negative) *rope delta*. Decode positions are
  the cache index plus that delta in all three rows, as in Hugging Face's `generate`. The head
  dimension's frequencies are split into three sections (`mrope_section`); section i rotates by
  row i (Qwen3-VL interleaves the rows instead). `mrope_positions` computes a prompt's ids from
  (ids, image_grid_thw) exactly as transformers' `Qwen2VLModel.get_rope_index` does
  (tests/rollout/native/test_native_vlm.py checks it).
- **The vision tower** is transformers' own module (`model.visual` of the Hugging Face model),
  run once per image at prefill; its merged patch features replace the embeddings of the
  prompt's `<|image_pad|>` tokens. Qwen3-VL's tower also gives *deep-stack* features, added to
  the image tokens' hidden states after each of the first decoder layers. Its parameters are
  registered in the engine's name map (weights.py), so loading and `update_weights` write them in
  place like the decoder's.

A prompt's images travel as `polyrl.data.multimodal.ImageInputs`; `PromptImages` is what the
scheduler keeps per request: the images, the M-RoPE ids, the rope delta, and a digest per image
(the prefix cache keys on it, so equal ids with other images never share cached K/V).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.rollout.base import RolloutInputError

VISION_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration":
        "transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel",
    "Qwen2_5_VLForConditionalGeneration":
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
    "Qwen3VLForConditionalGeneration": "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
}
"""Vision-language architectures -> the transformers class of their vision tower."""

_DEFAULT_MROPE_SECTION = {"Qwen3VLForConditionalGeneration": (24, 20, 20)}
"""transformers' rotary default where a config names no mrope_section (Qwen2-VL's: 16, 24, 24)."""

# Checkpoints name the same tensors two ways: transformers 5 modules say `model.language_model.*`
# and `model.visual.*` (what a trainer's `named_parameters` and a LoRA merge send), while
# `save_pretrained` writes the older `model.layers.*` / `visual.*` (transformers' key mapping).
# The engine's own names are the saved ones; the others are renamed on the way in.
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def canonical_name(name: str) -> str:
    """A vision-language checkpoint's tensor name in the engine's naming (the saved one)."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs from a vision-language config beyond the decoder's shapes."""

    architecture: str
    vision_config: Any
    """transformers' vision config (builds the tower)."""
    image_token_id: int
    spatial_merge_size: int
    mrope_section: tuple[int, ...]
    """How many of the head_dim // 2 frequencies the temporal, height and width ids rotate."""
    interleaved: bool
    """Qwen3-VL: the three rows take frequencies in turn (t h w t h w ...); Qwen2-VL /
    Qwen2.5-VL: in three consecutive sections."""
    patch_dim: int
    """Values per pixel patch the tower reads: channels x temporal patch x patch x patch."""


def vision_spec(config: Any, architecture: str, head_dim: int, rope_parameters: dict) -> VisionSpec:
    """`rope_parameters`: the text config's, in transformers 5's form (loader._rope_parameters)."""
    params = rope_parameters
    default = _DEFAULT_MROPE_SECTION.get(architecture, (16, 24, 24))
    section = tuple(int(n) for n in (params.get("mrope_section") or default))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"native engine: mrope_section={list(section)} must be three sizes summing to "
                         f"head_dim // 2 = {head_dim // 2}")
    vc = config.vision_config
    channels = getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3)
    return VisionSpec(architecture, vc, int(config.image_token_id), int(vc.spatial_merge_size), section,
                      architecture == "Qwen3VLForConditionalGeneration",
                      int(channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2)


def build_vision_tower(spec: VisionSpec, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """transformers' vision tower of the architecture, zero-filled (the checkpoint fills it)."""
    import importlib

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    module_name, _, cls_name = VISION_ARCHITECTURES[spec.architecture].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    with no_init_weights():  # every parameter is overwritten by the checkpoint: skip the random init
        tower = cls._from_config(spec.vision_config)
    tower = tower.to(dtype=dtype, device=device).eval().requires_grad_(False)
    return tower


def tower_targets(tower: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tower's parameters under the engine's names (`visual.*`), as tensors to copy into."""
    return {f"visual.{name}": p.data for name, p in tower.named_parameters()}


def encode_images(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merged patch features [image tokens, hidden] of every image, in order (HF's
    `get_image_features`: pixels in the tower's dtype, features in the embeddings' dtype), and
    Qwen3-VL's deep-stack features (one such tensor per early decoder layer; [] otherwise)."""
    device = next(tower.parameters()).device
    out = tower(pixel_values.to(device=device, dtype=next(tower.parameters()).dtype),
                grid_thw=grid_thw.to(device))
    if isinstance(out, torch.Tensor):  # transformers 4 returns the merged features themselves
        return out.to(dtype), []
    if isinstance(out, tuple):  # transformers 4's Qwen3-VL: (merged features, deep-stack features)
        return out[0].to(dtype), [f.to(dtype) for f in (out[1] if len(out) > 1 else [])]
    return out.pooler_output.to(dtype), [f.to(dtype) for f in getattr(out, "deepstack_features", None) or []]


# -- M-RoPE --------------------------------------------------------------------------------------


def mrope_positions(ids: list[int], grid_thw: torch.Tensor | None, image_token_id: int,
                    merge: int) -> tuple[torch.Tensor, int]:
    """(positions [3, T] int64, rope delta) of one prompt: transformers' `get_rope_index` for
    images. Each run of image-pad tokens is the next image of `grid_thw`."""
    pieces, current, image = [], 0, 0
    for is_image, run in itertools.groupby(ids, key=lambda t: t == image_token_id):
        n = sum(1 for _ in run)
        if not is_image:
            pieces.append(torch.arange(n).expand(3, n) + current)
            current += n
            continue
        t, h, w = (int(v) for v in grid_thw[image])
        gt, gh, gw = t, h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw),
                                          indexing="ij")).reshape(3, -1)
        pieces.append(grid + current)
        current += max(h, w) // merge
        image += 1
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - len(ids)


def section_rows(spec: VisionSpec, head_dim: int, device) -> torch.Tensor:
    """[head_dim]: which position row (0 temporal, 1 height, 2 width) rotates each column."""
    if spec.interleaved:  # transformers' Qwen3-VL: frequency j < 3 * section[r] with j % 3 == r is row r
        j = torch.arange(head_dim // 2)
        half = torch.zeros(head_dim // 2, dtype=torch.long)
        for row in (1, 2):
            half[(j % 3 == row) & (j < 3 * spec.mrope_section[row])] = row
    else:
        half = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(spec.mrope_section)])
    return torch.cat((half, half)).to(device)


def mrope_tables(cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / signed-sin [..., head_dim] for M-RoPE ids `positions` [3, ...], read from the 1-D
    tables (loader.rope_tables): column c takes the entry of the position in row rows[c]. Bitwise
    what transformers computes, since its per-row frequencies are these tables' entries."""
    def pick(table):
        per_row = table[positions]  # [3, ..., hd]
        index = rows.view((1,) * (per_row.dim() - 1) + (-1,)).expand((1,) + per_row.shape[1:])
        return per_row.gather(0, index)[0]
    return pick(cos), pick(sin)


# -- one request's images ------------------------------------------------------------------------


@dataclass(eq=False)
class PromptImages:
    """A request's images with what the scheduler derives from them once, at submission."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    positions: torch.Tensor
    """M-RoPE ids of the prompt [3, T]."""
    rope_delta: int
    """Decode position = cache index + rope_delta (all three rows)."""
    keys: tuple[str, ...]
    """A digest of each image (grid and pixels), in order: the prefix cache keys on them (empty
    when the engine keeps no prefix cache)."""
    spans: tuple[tuple[int, int], ...]
    """[start, end) of each image's pad tokens in the prompt."""
    patch_offsets: tuple[int, ...]
    """Where each image's patches start in pixel_values (len = images + 1)."""

    def subset(self, which: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, grid_thw) of the chosen images (all: the stored tensors)."""
        if len(which) == len(self.spans):
            return self.pixel_values, self.grid_thw
        pixels = torch.cat([self.pixel_values[self.patch_offsets[i]:self.patch_offsets[i + 1]] for i in which])
        return pixels, self.grid_thw[which]


def image_digest(pixels: torch.Tensor, grid: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(int(v) for v in grid)).encode())
    h.update(str(pixels.dtype).encode())
    h.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_images(images: Any, prompt: list[int], spec: VisionSpec | None, *,
                 digests: bool = True) -> PromptImages | None:
    """Validate a request's images against its ids; None for a text-only prompt.

    The ids must hold one run of `<|image_pad|>` per image, of t*h*w / merge**2 tokens each, as
    the processor expands them (a run per image is also what `get_rope_index` assumes).
    `digests=False` (no prefix cache to key) skips hashing the pixels: `keys` is then empty."""
    if spec is None:
        if images is not None:
            raise RolloutInputError("images", "this model is text-only; serve a vision-language model "
                                    "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL) for image prompts")
        return None
    runs = list(_runs(prompt, spec.image_token_id))
    if images is None:
        if runs:
            raise RolloutInputError("images", f"prompt_ids hold {len(runs)} image placeholder run(s) "
                                    "but no images were given")
        return None
    pixel_values, grid = getattr(images, "pixel_values", None), getattr(images, "image_grid_thw", None)
    if not isinstance(pixel_values, torch.Tensor) or not isinstance(grid, torch.Tensor):
        raise RolloutInputError("images", f"expected ImageInputs (pixel_values, image_grid_thw), got "
                                f"{type(images).__name__}")
    merge = spec.spatial_merge_size
    if grid.dim() != 2 or grid.shape[1] != 3 or bool((grid[:, 1:] % merge != 0).any()):
        raise RolloutInputError("images", f"image_grid_thw must be (images, 3) with height and width "
                                f"multiples of spatial_merge_size={merge}")
    counts = [int(n) // merge**2 for n in grid.prod(dim=1)]
    if [n for _, n in runs] != counts:
        raise RolloutInputError("images", f"prompt_ids hold image placeholder runs of {[n for _, n in runs]} "
                                f"tokens, the images need {counts} (expand each image as the processor does)")
    patches = [0] + list(itertools.accumulate(int(n) for n in grid.prod(dim=1)))
    if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (patches[-1], spec.patch_dim):
        raise RolloutInputError("images", f"pixel_values has shape {tuple(pixel_values.shape)}; the grids and "
                                f"the vision tower need ({patches[-1]}, {spec.patch_dim})")
    positions, delta = mrope_positions(prompt, grid, spec.image_token_id, merge)
    keys = tuple(image_digest(pixel_values[patches[i]:patches[i + 1]], grid[i])
                 for i in range(len(counts))) if digests else ()
    spans = tuple((start, start + n) for start, n in runs)
    return PromptImages(pixel_values, grid, positions, delta, keys, spans, tuple(patches))


def _runs(ids: list[int], token: int):
    """(start, length) of every run of `token` in `ids`."""
    index = 0
    for is_token, run in itertools.groupby(ids, key=lambda t: t == token):
        n = sum(1 for _ in run)
        if is_token:
            yield index, n
        index += n
