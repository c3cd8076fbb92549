"""Per-sample image inputs in the batch (`RolloutBatch.images`) and their cheap trip across Ray.

A batch with images carries one entry per sample: the prompt's `ImageInputs`
(polyrl/data/multimodal.py) or None for a text-only sample. The samples of one GRPO group share
their prompt's object, so the list holds each prompt's pixels once, however many samples answer
it. A text-only batch has `images=None` and pays nothing.

Pickled as a list, every entry would be two torch tensors pickled in band (copied into the
stream) and each shared object once more per process it reaches. `pack` instead turns the list
into a few numpy arrays, each distinct object's pixels once, which Ray moves out of band like
`Ragged`'s (polyrl/batch/ragged.py); `unpack` rebuilds the list with the sharing intact.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # polyrl.data's package import reads datasets' modules: imported where used
    from polyrl.data.multimodal import ImageInputs


def images_of(prompts: Sequence[Any] | None) -> list[ImageInputs | None] | None:
    """The images of the data rows (`PromptSample`) the samples answer, one entry per sample;
    None when no row has any (a text-only batch stays free of the field)."""
    if not prompts:
        return None
    out = [getattr(p, "images", None) for p in prompts]
    return out if any(x is not None for x in out) else None


def distinct(images: Sequence[ImageInputs | None]) -> tuple[list[ImageInputs], torch.Tensor]:
    """(the distinct objects in order of first appearance, [n] int64 index of each sample's
    object or -1): the samples of one prompt share its object, so its pixels count once."""
    seen: dict[int, int] = {}
    objects: list[ImageInputs] = []
    index = torch.full((len(images),), -1, dtype=torch.long)
    for i, x in enumerate(images):
        if x is not None:
            if id(x) not in seen:
                seen[id(x)] = len(objects)
                objects.append(x)
            index[i] = seen[id(x)]
    return objects, index


def pack(images: Sequence[ImageInputs | None]) -> tuple[np.ndarray, ...]:
    """(pixels [P, D], grids [I, 3], per distinct object its patch and image offsets, per sample
    the index of its object or -1): every distinct object's tensors once."""
    objects, index = distinct(images)
    if not objects:
        return (np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int64), np.zeros(1, np.int64),
                np.zeros(1, np.int64), index.numpy())
    patches = np.cumsum([0] + [x.pixel_values.shape[0] for x in objects])
    grids = np.cumsum([0] + [x.num_images for x in objects])
    pixels = torch.cat([x.pixel_values for x in objects]).numpy()
    thw = torch.cat([x.image_grid_thw for x in objects]).numpy()
    return pixels, thw, patches, grids, index.numpy()


def unpack(pixels: np.ndarray, thw: np.ndarray, patches: np.ndarray, grids: np.ndarray,
           index: np.ndarray) -> list[ImageInputs | None]:
    """The list `pack` was given: samples that shared an object share one again. The tensors are
    views of the received arrays (read-only when Ray hands them out; never written in place)."""
    from polyrl.data.multimodal import ImageInputs

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        pixel_t, thw_t = torch.from_numpy(pixels), torch.from_numpy(thw)
    objects = [ImageInputs(pixel_t[patches[k]:patches[k + 1]], thw_t[grids[k]:grids[k + 1]])
               for k in range(len(patches) - 1)]
    return [None if k < 0 else objects[k] for k in index.tolist()]
