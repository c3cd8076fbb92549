"""Sample images: validation prompts' own images with the model's answers, as samples/step_N.png."""

from __future__ import annotations

import dataclasses
import io
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from polyrl.builtin import resolve
from polyrl.data import DataConfig, load_dataset
from polyrl.data.shapes import write_parquet
from polyrl.trainer.sample_images import ImageSample, RowImages, SampleImages, caption, draw_grid, grid_size
from polyrl.training.model_loading import load_tokenizer

MAGENTA, CYAN = (250, 10, 200), (10, 240, 230)  # colours no caption or frame uses


def png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buf, format="PNG")
    return buf.getvalue()


def image_row(question: str, colour, truth: str) -> dict:
    return {"data_source": "shapes", "prompt": [{"role": "user", "content": f"<image>{question}"}],
            "images": [{"bytes": png(colour), "path": None}],
            "reward_model": {"style": "rule", "ground_truth": truth}}


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    """A validation file of two image rows (real PNG bytes in verl's schema) after a text row."""
    text_row = {"data_source": "shapes", "prompt": [{"role": "user", "content": "How many?"}],
                "images": [], "reward_model": {"style": "rule", "ground_truth": "0"}}
    rows = [text_row, image_row("What colour is the square?", MAGENTA, "magenta"),
            image_row("How many shapes?", CYAN, "1")]
    return str(write_parquet(rows, tmp_path_factory.mktemp("data") / "val.parquet"))


@pytest.fixture(scope="module")
def val_prompts(val_file):
    """The file's prompts as the trainer loads them (tiny-vl's tokenizer and image processor)."""
    model = resolve("builtin:tiny-vl")
    cfg = DataConfig(train_files=[val_file], val_files=[val_file], max_prompt_length=64)
    dataset = load_dataset([val_file], load_tokenizer(model), cfg, split="val", model_dir=model)
    return list(dataset)


def scored_batch(prompts, answers, accs):
    """A scored validation batch: one sample per prompt (rollout.val_n=1)."""
    return SimpleNamespace(prompts=list(prompts), group=torch.arange(len(prompts)), texts=list(answers),
                           rewards=torch.tensor(accs, dtype=torch.float32),
                           acc=torch.tensor(accs, dtype=torch.float32))


def test_grid_of_two_image_rows(tmp_path, val_file, val_prompts):
    assert [p.images is not None for p in val_prompts] == [False, True, True]
    log = SampleImages(tmp_path, None, RowImages([val_file]))
    batch = scored_batch(val_prompts, ["-", "red", "1"], [0.0, 0.0, 1.0])

    assert [caption(s) for s in log.samples(batch)] == [  # the text-only prompt is left out
        "Q: What colour is the square?\nA: red\ntruth: magenta\nreward 0: wrong",
        "Q: How many shapes?\nA: 1\ntruth: 1\nreward 1: right",
    ]
    out = log.write(40, batch)
    assert out == tmp_path / "samples" / "step_000040.png"
    grid = Image.open(out).convert("RGB")
    assert grid.size == grid_size(2) == (520, 350)  # two cells side by side under a title line
    colours = {c for _, c in grid.getcolors(maxcolors=1 << 20)}
    # the rows' own pixels, decoded from the file (the processor's patches are normalised)
    assert MAGENTA in colours and CYAN in colours


def test_answers_with_dollar_signs_are_drawn_as_text(tmp_path):
    """Math answers are not matplotlib mathtext: an unbalanced one used to fail the drawing."""
    sample = ImageSample([Image.new("RGB", (8, 8), CYAN)], "Solve $x^2 = 4$", "so $\\frac{1}{2 and $",
                         "2", 0.0, False)
    out = draw_grid([sample], tmp_path / "math.png", "step 1: $")
    assert Image.open(out).size == grid_size(1)


def test_text_only_batch_writes_nothing(tmp_path, val_prompts):
    def no_images(prompts):
        raise AssertionError("a text-only batch must not read images")

    written = SampleImages(tmp_path, None, no_images).write(10, scored_batch(val_prompts[:1], ["0"], [1.0]))
    assert written is None and not (tmp_path / "samples").exists()


def test_a_changed_row_gives_no_image(val_file, val_prompts):
    """A row whose prompt is no longer the sample's (the file changed) is not taken for its image."""
    changed = dataclasses.replace(val_prompts[1], raw_prompt=[{"role": "user", "content": "<image>other"}])
    images = RowImages([val_file])([changed, val_prompts[2]])
    assert images[0] == [] and images[1][0].getpixel((0, 0)) == CYAN


def test_grids_are_bounded_and_follow_resume(tmp_path, val_file, val_prompts):
    source = RowImages([val_file])
    batch = scored_batch(val_prompts[2:], ["1"], [1.0])
    log = SampleImages(tmp_path, None, source, max_files=3)
    for step in range(0, 60, 10):
        log.write(step, batch)

    def steps():
        return sorted(p.name for p in (tmp_path / "samples").iterdir())

    assert steps() == ["step_000000.png", "step_000040.png", "step_000050.png"]  # first and latest
    SampleImages(tmp_path, 40, source)  # resumed from step 40's checkpoint: step 50 is redone
    assert steps() == ["step_000000.png", "step_000040.png"]
    SampleImages(tmp_path, None, source)  # a fresh run in the same directory
    assert steps() == []
