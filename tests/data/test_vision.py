"""Image rows in verl's multimodal schema: read, expanded by the model's image processor, checked.

The reference for the expanded ids is Hugging Face's own Qwen2VLProcessor (tests/tiny_vl.py).
"""

from __future__ import annotations

import base64
import json
import logging

import pytest
import torch

from polyrl.data import DataConfig, DataFileError, load_dataset
from polyrl.data.multimodal import ImageInputs
from cli_runs import train_here  # noqa: F401  (a fixture)
from tiny_vl import IMAGE_PAD, bomb_png, png_bytes, shape_image, tiny_vl_processor, write_tiny_vl_processor_dir

GEO3K_SUFFIX = (" You FIRST think about the reasoning process as an internal monologue and then provide "
                "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
                "The final answer MUST BE put in \\boxed{}.")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return write_tiny_vl_processor_dir(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def vl_tokenizer(vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


def geo3k_row(i: int, image_entries: list, prompt: str | None = None) -> dict:
    """One row as verl's examples/data_preprocess/geo3k.py writes it."""
    problem = prompt if prompt is not None else f"<image>Find x in triangle {i}."
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": problem + GEO3K_SUFFIX}],
        "images": image_entries,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(3 + i)},
        "extra_info": {"split": "train", "index": i, "answer": str(3 + i), "question": problem},
    }


def image_entry(colour: str, seed: int = 0) -> dict:
    """An image as datasets' Image feature writes it to parquet."""
    return {"bytes": png_bytes(shape_image(colour, seed)), "path": None}


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def reference_ids(vl_tokenizer, row) -> tuple[list[int], ImageInputs]:
    """What HF's Qwen2VLProcessor makes of the row verl's way: `<image>` -> image parts."""
    from PIL import Image
    import io

    processor = tiny_vl_processor(vl_tokenizer)
    content = row["prompt"][0]["content"]
    parts = []
    for j, piece in enumerate(content.split("<image>")):
        if j:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    text = vl_tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                            add_generation_prompt=True, tokenize=False)
    images = [Image.open(io.BytesIO(e["bytes"])).convert("RGB") for e in row["images"]]
    enc = processor(text=[text], images=images, return_tensors="pt")
    return enc["input_ids"][0].tolist(), ImageInputs(enc["pixel_values"], enc["image_grid_thw"])


def test_geometry3k_rows_load_with_the_processors_ids_and_images(tmp_path, vl_dir, vl_tokenizer):
    rows = [geo3k_row(0, [image_entry("red")]),
            geo3k_row(1, [image_entry("blue", 1)]),
            geo3k_row(2, [image_entry("green", 2), image_entry("red", 3)],
                      prompt="<image>Compare with <image>: find x.")]
    path = write_parquet(tmp_path / "geo3k_train.parquet", rows)
    ds = load_dataset([str(path)], vl_tokenizer, DataConfig(max_prompt_length=1024), model_dir=vl_dir)
    assert len(ds) == 3 and ds.data_sources == {"hiyouga/geometry3k"}
    pad = vl_tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for sample, row in zip(ds, rows):
        ids, images = reference_ids(vl_tokenizer, row)
        assert sample.prompt_ids == ids
        assert torch.equal(sample.images.image_grid_thw, images.image_grid_thw)
        assert torch.allclose(sample.images.pixel_values, images.pixel_values.float())
        assert sample.prompt_ids.count(pad) == sum(images.num_placeholder_tokens(2))
        assert sample.images.num_images == len(row["images"])
    assert ds[2].images.num_images == 2


def test_geometry3k_is_scored_by_its_boxed_answer():
    from polyrl.rewards import REWARD_FNS

    score = REWARD_FNS.get("hiyouga/geometry3k")
    assert score("<think>...</think> so \\boxed{3}", "3", None) == 1.0
    assert score("<think>...</think> so \\boxed{4}", "3", None) == 0.0


def test_text_rows_through_a_vlm_tokenizer_carry_no_images(tmp_path, vl_dir, vl_tokenizer):
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+1="}],
             "reward_model": {"ground_truth": "2"}}]
    path = write_parquet(tmp_path / "t.parquet", rows)
    ds = load_dataset([str(path)], vl_tokenizer, DataConfig(), model_dir=vl_dir)
    assert ds[0].images is None


def test_inline_image_url_parts_and_paths(tmp_path, vl_dir, vl_tokenizer):
    """OpenAI-style image_url data URLs and local paths in content parts, no images column."""
    img = shape_image("red")
    img.save(tmp_path / "a.png")
    url = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()
    rows = [{"data_source": "shapes", "reward_model": {"ground_truth": "1"},
             "prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "how many?"}]}]},
            {"data_source": "shapes", "reward_model": {"ground_truth": "1"},
             "prompt": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")},
                                                     {"type": "text", "text": "how many?"}]}]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_dataset([str(path)], vl_tokenizer, DataConfig(), model_dir=vl_dir)
    assert len(ds) == 2
    assert ds[0].prompt_ids == ds[1].prompt_ids
    assert torch.equal(ds[0].images.pixel_values, ds[1].images.pixel_values)


def bad_rows_file(tmp_path):
    rows = [geo3k_row(0, [image_entry("red")]),
            geo3k_row(1, [{"bytes": b"not a png", "path": None}]),           # unreadable image
            geo3k_row(2, [image_entry("red"), image_entry("blue")]),         # 1 <image>, 2 images
            geo3k_row(3, [image_entry("red")], prompt="no placeholder here"),  # 0 <image>, 1 image
            geo3k_row(4, [image_entry("green")])]
    return write_parquet(tmp_path / "bad.parquet", rows)


def test_bad_image_rows_are_skipped_and_named(tmp_path, vl_dir, vl_tokenizer, caplog):
    path = bad_rows_file(tmp_path)
    with caplog.at_level(logging.WARNING, logger="polyrl.data"):
        ds = load_dataset([str(path)], vl_tokenizer, DataConfig(on_bad_row="skip"), model_dir=vl_dir)
    assert [s.index for s in ds] == [0, 4] and ds.num_bad_rows == 3
    assert f"{path} row 1: image cannot be read" in caplog.text
    assert f"{path} row 2: the prompt has 1 image placeholders" in caplog.text and "holds 2 images" in caplog.text
    assert f"{path} row 3: the prompt has 0 image placeholders" in caplog.text


def test_huge_odd_and_remote_images_are_bad_rows_named_as_such(tmp_path, vl_dir, vl_tokenizer, caplog):
    """A decompression bomb, a 20000x1 strip the image processor refuses and a remote URL in the
    images column: each is one skipped row, named with its file and row and its own reason."""
    from PIL import Image

    rows = [geo3k_row(0, [image_entry("red")]),
            geo3k_row(1, [{"bytes": bomb_png(), "path": None}]),
            geo3k_row(2, [{"bytes": png_bytes(Image.new("RGB", (20000, 1))), "path": None}]),
            geo3k_row(3, [{"bytes": None, "path": "https://example.com/a.png"}]),
            geo3k_row(4, [{"bytes": bomb_png(10000, 10000), "path": None}]),  # PIL only warns here
            geo3k_row(5, [image_entry("green")])]
    path = write_parquet(tmp_path / "odd.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="polyrl.data"):
        ds = load_dataset([str(path)], vl_tokenizer, DataConfig(on_bad_row="skip"), model_dir=vl_dir)
    assert [s.index for s in ds] == [0, 5] and ds.num_bad_rows == 4
    assert f"{path} row 1: image is too large to decode" in caplog.text
    assert f"{path} row 2: the image processor refuses the image(s) (20000x1)" in caplog.text
    assert f"{path} row 3: image https://example.com/a.png is a remote URL" in caplog.text
    assert "chat template fails" not in caplog.text
    # with warnings as errors, PIL's warning between 1x and 2x its limit is the same bad row
    import warnings

    from polyrl.data.vision import ImageRowError, open_image

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ImageRowError, match="too large to decode"):
            open_image({"bytes": bomb_png(10000, 10000), "path": None})


def test_relative_image_paths_are_the_data_files_then_the_working_directorys(tmp_path, vl_dir, vl_tokenizer,
                                                                              monkeypatch):
    """A dataset directory moved with its images loads from anywhere; a path found only from the
    working directory still loads, as before."""
    data, elsewhere = tmp_path / "dataset", tmp_path / "elsewhere"
    (data / "img").mkdir(parents=True)
    elsewhere.mkdir()
    shape_image("red").save(data / "img" / "red.png")
    shape_image("blue", 1).save(elsewhere / "blue.png")
    rows = [geo3k_row(0, ["img/red.png"]),
            {"data_source": "shapes", "reward_model": {"ground_truth": "1"},
             "prompt": [{"role": "user", "content": [{"type": "image", "image": "img/red.png"},
                                                     {"type": "text", "text": "how many?"}]}]},
            geo3k_row(2, [{"bytes": None, "path": "blue.png"}]),  # only the working directory has it
            geo3k_row(3, [str(data / "img" / "red.png")])]
    path = data / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(elsewhere)
    ds = load_dataset([str(path)], vl_tokenizer, DataConfig(on_bad_row="error"), model_dir=vl_dir)
    assert len(ds) == 4
    assert torch.equal(ds[0].images.pixel_values, ds[3].images.pixel_values)
    assert torch.equal(ds[1].images.pixel_values, ds[3].images.pixel_values)
    assert not torch.equal(ds[2].images.pixel_values, ds[3].images.pixel_values)


def test_16_bit_images_are_scaled_to_8_bits(tmp_path):
    """PIL's own convert("RGB") clips 16-bit grey at 255; open_image scales it (and 32-bit / float grey)."""
    import numpy as np
    from PIL import Image

    from polyrl.data.vision import open_image

    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    want = np.rint(ramp / 257.0).astype(np.uint8)
    for entry in [str(tmp_path / "g16.png"), {"bytes": (tmp_path / "g16.png").read_bytes(), "path": None},
                  Image.fromarray(ramp.astype(np.int32)), Image.fromarray(ramp.astype(np.float32) / 65535)]:
        pixels = np.asarray(open_image(entry))
        assert pixels.shape == (64, 64, 3)
        assert np.abs(pixels[..., 0].astype(int) - want).max() <= 1, entry
    # 8-bit content in a 32-bit image keeps its values
    small = np.arange(256, dtype=np.int32).reshape(16, 16)
    assert np.array_equal(np.asarray(open_image(Image.fromarray(small)))[..., 0], small)


def test_bad_image_row_is_an_error_naming_file_and_row(tmp_path, vl_dir, vl_tokenizer):
    path = bad_rows_file(tmp_path)
    with pytest.raises(DataFileError, match=rf"{path} row 1: image cannot be read"):
        load_dataset([str(path)], vl_tokenizer, DataConfig(on_bad_row="error"), model_dir=vl_dir)


def test_prompt_too_long_after_image_expansion(tmp_path, vl_dir, vl_tokenizer):
    """Each 56x56 image is 4 tokens once expanded: the limit counts them."""
    rows = [geo3k_row(0, [image_entry("red")], prompt="<image>x"),
            geo3k_row(1, [image_entry("red")] * 3, prompt="<image><image><image>x")]
    path = write_parquet(tmp_path / "long.parquet", rows)
    full = load_dataset([str(path)], vl_tokenizer, DataConfig(), model_dir=vl_dir)
    limit = len(full[1].prompt_ids) - 1  # the one-pad-per-image text would fit, the expanded does not
    assert len(full[0].prompt_ids) <= limit
    ds = load_dataset([str(path)], vl_tokenizer, DataConfig(max_prompt_length=limit), model_dir=vl_dir)
    assert [s.index for s in ds] == [0] and ds.num_dropped_overlong == 1
    with pytest.raises(DataFileError, match=rf"{path} row 1: prompt has \d+ tokens \(12 of them image tokens\)"):
        load_dataset([str(path)], vl_tokenizer,
                     DataConfig(max_prompt_length=limit, drop_overlong_prompts=False), model_dir=vl_dir)


def test_a_text_only_model_given_image_rows_names_the_fix(tmp_path, tiny_tokenizer):
    from tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "text_model")
    path = write_parquet(tmp_path / "geo.parquet", [geo3k_row(0, [image_entry("red")])])
    with pytest.raises(DataFileError, match="text-only model .* set model.path to a vision-language model"):
        load_dataset([str(path)], tiny_tokenizer, DataConfig(), model_dir=model)


def test_a_vlm_without_its_image_processor_names_the_fix(tmp_path, vl_dir, vl_tokenizer):
    import shutil

    bare = tmp_path / "no_processor"
    shutil.copytree(vl_dir, bare)
    (bare / "preprocessor_config.json").unlink()
    path = write_parquet(tmp_path / "geo.parquet", [geo3k_row(0, [image_entry("red")])])
    with pytest.raises(DataFileError, match="no image processor .*copy preprocessor_config.json"):
        load_dataset([str(path)], vl_tokenizer, DataConfig(), model_dir=str(bare))


def test_polyrl_train_refuses_image_rows_on_a_text_model_before_ray(train_here, tmp_path):
    """`polyrl train` with image rows and the bundled text-only model: exit 2, one line, no Ray."""
    import ray

    path = write_parquet(tmp_path / "geo.parquet", [geo3k_row(0, [image_entry("red")])])
    ray_before = ray.is_initialized()  # another test's session in this worker may hold one
    out = train_here("model.path=builtin:tiny-arith", f"data.train_files=[{path}]", "data.val_files=[]")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "is a text-only model (no vision_config in its config.json); set model.path to a " \
           "vision-language model" in out.stderr
    assert ray.is_initialized() == ray_before  # refused before the run starts Ray


def test_every_image_entry_form_opens_to_the_same_pixels(tmp_path):
    from polyrl.data.vision import ImageRowError, open_image

    img = shape_image("blue", 2)
    img.save(tmp_path / "a.png")
    forms = [img, {"bytes": png_bytes(img), "path": None}, {"bytes": None, "path": str(tmp_path / "a.png")},
             {"image": str(tmp_path / "a.png")}, str(tmp_path / "a.png")]
    assert len({open_image(f).tobytes() for f in forms}) == 1
    with pytest.raises(ImageRowError, match="cannot be read"):
        open_image(str(tmp_path / "missing.png"))


def test_text_only_content_parts_render_as_their_text(tmp_path, tiny_tokenizer):
    """A text model's template would print a list of parts; text parts are their text."""
    rows = [{"data_source": "arithmetic", "reward_model": {"ground_truth": "2"},
             "prompt": [{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]}]},
            {"data_source": "arithmetic", "reward_model": {"ground_truth": "2"},
             "prompt": [{"role": "user", "content": "1+1="}]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_dataset([str(path)], tiny_tokenizer, DataConfig())
    assert ds[0].prompt_text == ds[1].prompt_text and ds[0].prompt_ids == ds[1].prompt_ids
