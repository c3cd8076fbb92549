"""The synthetic shapes task: deterministic, held-out scenes disjoint, answers true to the image,
scored exactly by its reward."""

from __future__ import annotations

import io

from polyrl.data.shapes import BACKGROUND, COLOURS, SIDE, make_row, split_examples
from polyrl.rewards import REWARD_FNS


def test_generator_is_deterministic_and_held_out_scenes_are_disjoint():
    a = split_examples(200, 50, seed=1, n_extra=50)
    b = split_examples(200, 50, seed=1, n_extra=50)
    assert a == b and a != split_examples(200, 50, seed=2, n_extra=50)
    train, val, extra = a
    held_out = {e.scene.key for e in val}
    assert not held_out & {e.scene.key for e in train + extra}
    assert {e.question_type for e in train} == {"count", "colour"}


def test_rendered_image_shows_what_the_answer_says():
    """Each quarter of the image holds a shape exactly where the scene says, in its colour."""
    from PIL import Image

    train, _, _ = split_examples(30, 0, seed=0)
    for e in train:
        row = make_row(e, "train", 0)
        image = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        assert image.size == (SIDE, SIDE) and row["prompt"][0]["content"].startswith("<image>")
        for cell in range(4):
            x0, y0 = (cell % 2) * SIDE // 2, (cell // 2) * SIDE // 2
            colours = {image.getpixel((x, y)) for x in range(x0, x0 + SIDE // 2) for y in range(y0, y0 + SIDE // 2)}
            shape = [s for s in e.scene.shapes if s.cell == cell]
            assert (colours - {BACKGROUND} == {COLOURS[shape[0].colour]}) if shape else colours == {BACKGROUND}
        if e.question_type == "count":
            assert e.answer == str(len(e.scene.shapes))
        else:
            kind = e.question.removeprefix("What colour is the ").removesuffix("?")
            assert [s.colour for s in e.scene.shapes if s.kind == kind] == [e.answer]


def test_shapes_reward_is_exact_and_needs_eos():
    score = REWARD_FNS.get("shapes")
    assert score(" Blue\n", "blue", None, finished_with_eos=True) == 1.0
    assert score("blue", "blue", None, finished_with_eos=False) == 0.0
    assert score("blue green", "blue", None, finished_with_eos=True) == 0.0
    assert score("3", "4", None, finished_with_eos=True) == 0.0
