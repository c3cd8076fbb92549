"""The multimodal seam's one type: `ImageInputs` checks its shapes, batches in order, counts tokens."""

from __future__ import annotations

import pytest
import torch

from polyrl.data.multimodal import ImageInputs, mm_token_type_ids


def image(h: int, w: int, fill: float) -> ImageInputs:
    return ImageInputs(torch.full((h * w, 6), fill), torch.tensor([[1, h, w]]))


def test_concat_keeps_order_and_skips_text_only_prompts():
    a, b = image(2, 2, 1.0), image(4, 2, 2.0)
    both = ImageInputs.concat([None, a, None, b])
    assert both.num_images == 2 and both.image_grid_thw.tolist() == [[1, 2, 2], [1, 4, 2]]
    assert both.pixel_values[:4].eq(1).all() and both.pixel_values[4:].eq(2).all()
    assert ImageInputs.concat([None, None]) is None and ImageInputs.concat([a]) is a
    assert both.num_placeholder_tokens(merge_size=2) == [1, 2]
    assert both.nbytes == 12 * 6 * 4 + 2 * 3 * 8


def test_shapes_that_disagree_are_refused():
    with pytest.raises(ValueError, match="describes 4 patches but pixel_values has 3"):
        ImageInputs(torch.zeros(3, 6), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match=r"image_grid_thw must be \(images, 3\)"):
        ImageInputs(torch.zeros(4, 6), torch.tensor([1, 2, 2]))


def test_mm_token_type_ids_mark_the_placeholders():
    ids = torch.tensor([[5, 9, 9, 7]])
    assert mm_token_type_ids(ids, 9).tolist() == [[0, 1, 1, 0]]
