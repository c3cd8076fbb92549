"""The bundled vision-language model builtin:tiny-vl and the shapes data are sound and are what
scripts/build_tiny_vl_model.py writes."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from polyrl.builtin import resolve

MODEL_DIR = Path(resolve("builtin:tiny-vl"))
RECIPE = json.loads((MODEL_DIR / "warm_start.json").read_text())
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@pytest.fixture(scope="module")
def tokenizer():
    from polyrl.training.model_loading import load_tokenizer

    return load_tokenizer("builtin:tiny-vl")


def test_asset_is_small():
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert size < 4 * 2**20, f"tiny-vl is {size / 2**20:.1f} MiB"


def test_config_matches_the_tokenizer(tokenizer):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(MODEL_DIR)
    assert cfg.model_type == "qwen2_vl" and cfg.tie_word_embeddings
    ids = [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    assert ids == [cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id]
    assert cfg.text_config.vocab_size == len(tokenizer) and cfg.text_config.eos_token_id == tokenizer.eos_token_id
    assert cfg.vision_config.hidden_size == cfg.text_config.hidden_size  # the merger's output feeds the LM


def test_chat_template_renders_image_parts(tokenizer):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "3"}]}]
    assert tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False) == \
        "<|vision_start|><|image_pad|><|vision_end|>How many shapes?"
    assert tokenizer.apply_chat_template(messages, tokenize=False).endswith("How many shapes?3<eos>")


def test_rl_rows_load_through_the_pil_image_processor(tokenizer):
    """Every bundled prompt is 4 image tokens (56x56, one per quarter) and fits the recipe."""
    from polyrl.data import DataConfig, load_dataset
    from polyrl.data.vision import VisionPrompter

    prompter = VisionPrompter.from_model_dir(MODEL_DIR, tokenizer)
    assert type(prompter.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    ds = load_dataset([resolve("builtin:shapes_val")], tokenizer, DataConfig(max_prompt_length=48,
                      drop_overlong_prompts=False), split="val", model_dir=str(MODEL_DIR))
    assert len(ds) == RECIPE["n_val"] and ds.num_bad_rows == 0
    assert {tuple(s.images.image_grid_thw.tolist()[0]) for s in ds} == {(1, 4, 4)}
    assert all(s.prompt_ids.count(prompter.image_pad_id) == 4 for s in ds)


def test_bundled_data_is_the_generators():
    """shapes_{train,val}.parquet are write_shapes_dataset's output for the recipe's seed."""
    from polyrl.data.shapes import write_shapes_dataset

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_shapes_dataset(Path(tmp), RECIPE["n_train"], RECIPE["n_val"], seed=RECIPE["seed"])
        for split in ("train", "val"):
            assert paths[split].read_bytes() == Path(resolve(f"builtin:shapes_{split}")).read_bytes(), split


def test_tokenizer_and_processor_files_are_the_scripts(tmp_path):
    """The files that do not depend on training are what scripts/build_tiny_vl_model.py writes
    (the weights are its SFT's; rebuilding them is minutes, not a test)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tiny_vl_model",
                                                  Path(__file__).parents[2] / "scripts" / "build_tiny_vl_model.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.save_tokenizer(build.build_tokenizer(), tmp_path)
    build.build_image_processor().save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        assert (tmp_path / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name
