"""The multimodal seam: one prompt's images as the model's processor made them.

A prompt with images carries two things: its token ids, in which the processor has already
expanded every image into `<|vision_start|><|image_pad|>*n<|vision_end|>` (n = t*h*w /
merge_size**2, exactly as Hugging Face's Qwen2-VL processor returns `input_ids`), and an
`ImageInputs` holding the pixel patches and per-image grid sizes that the vision tower turns into
those n embeddings. M-RoPE position ids are never stored here: every consumer recomputes them
from (ids, image_grid_thw) with the model's own rope-index function, so there is one source of
truth. Text-only prompts carry `images=None` and pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ImageInputs:
    """One prompt's images as the model's processor made them (Qwen2-VL / Qwen2.5-VL layout)."""

    pixel_values: torch.Tensor
    """(patches, patch_dim) float32, every image of the prompt, in order."""
    image_grid_thw: torch.Tensor
    """(images, 3) int64: temporal, height, width patch counts per image."""

    def __post_init__(self) -> None:
        # A mismatch here would surface much later as a shape error inside the vision tower.
        if self.pixel_values.dim() != 2:
            raise ValueError(f"pixel_values must be (patches, patch_dim), got {tuple(self.pixel_values.shape)}")
        if self.image_grid_thw.dim() != 2 or self.image_grid_thw.shape[1] != 3:
            raise ValueError(f"image_grid_thw must be (images, 3), got {tuple(self.image_grid_thw.shape)}")
        patches = int(self.image_grid_thw.prod(dim=1).sum())
        if patches != self.pixel_values.shape[0]:
            raise ValueError(
                f"image_grid_thw describes {patches} patches but pixel_values has "
                f"{self.pixel_values.shape[0]}"
            )

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what shipping this prompt across Ray costs on top of its ids)."""
        return sum(t.element_size() * t.nelement() for t in (self.pixel_values, self.image_grid_thw))

    def num_placeholder_tokens(self, merge_size: int) -> list[int]:
        """Image-pad tokens each image expands to in the prompt ids: t*h*w / merge_size**2."""
        return [int(n) // merge_size**2 for n in self.image_grid_thw.prod(dim=1)]

    def to(self, device: torch.device | str) -> "ImageInputs":
        return ImageInputs(self.pixel_values.to(device), self.image_grid_thw.to(device))

    @staticmethod
    def concat(items: Sequence["ImageInputs | None"]) -> "ImageInputs | None":
        """A batch of prompts' images as one model call's inputs (None entries, text-only
        prompts, skipped; None when no prompt has images). Order is kept, which is what the
        model needs: it assigns image embeddings to image-pad tokens in batch order."""
        present = [x for x in items if x is not None]
        if not present:
            return None
        if len(present) == 1:
            return present[0]
        return ImageInputs(
            torch.cat([x.pixel_values for x in present]),
            torch.cat([x.image_grid_thw for x in present]),
        )


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """1 where a token is an image placeholder, else 0 (same shape as `input_ids`): what
    transformers >= 5 asks of Qwen2-VL's forward / `get_rope_index` next to `image_grid_thw`.
    Derived from the ids, like the M-RoPE positions, so it is never stored or shipped."""
    return (input_ids == image_token_id).to(torch.int32)
