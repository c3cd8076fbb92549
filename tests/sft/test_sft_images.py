"""`polyrl sft` on image chats: messages with image parts are encoded with their images exactly as
Hugging Face's Qwen2-VL processor does, and the SFT loss is the model's NLL *given the images*."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from polyrl.data import DataFileError
from polyrl.data.multimodal import mm_token_type_ids
from polyrl.data.shapes import make_chat, split_examples, write_parquet
from polyrl.sft.config import SFTDataConfig
from polyrl.sft.data import load_sft_dataset
from polyrl.sft.step import evaluate

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_vl import IMAGE_PAD, bomb_png, build_tiny_vl, png_bytes, tiny_vl_processor  # noqa: E402


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("tiny_vl") / "model")


@pytest.fixture(scope="module")
def vl_tokenizer(vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    train, _, _ = split_examples(6, 0, seed=3)
    rows = [make_chat(e) for e in train]
    return rows, write_parquet(rows, tmp_path_factory.mktemp("chats") / "chats.parquet")


def load(path, tokenizer, vl_dir, **data):
    cfg = SFTDataConfig(train_files=[str(path)], val_files=[], **data)
    return load_sft_dataset([str(path)], tokenizer, cfg, max_length=256, model_dir=vl_dir)


def hf_reference(tokenizer, row) -> dict:
    """What HF's Qwen2VLProcessor makes of the whole conversation."""
    from PIL import Image

    text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    images = [Image.open(io.BytesIO(e["bytes"])).convert("RGB") for e in row["images"]]
    return tiny_vl_processor(tokenizer)(text=[text], images=images, return_tensors="pt")


def test_image_chats_encode_as_the_processor_does(chats, vl_dir, vl_tokenizer):
    rows, path = chats
    ds = load(path, vl_tokenizer, vl_dir)
    b = ds.batch
    assert len(ds) == len(rows) and b.images is not None
    pad = vl_tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for i, row in enumerate(rows):
        ref = hf_reference(vl_tokenizer, row)
        prompt, response = b.prompt_ids.row(i).tolist(), b.response_ids.row(i).tolist()
        assert prompt + response == ref["input_ids"][0].tolist()
        assert prompt[-1] == pad and pad not in response  # every placeholder sits in the prompt part
        assert torch.equal(b.images[i].image_grid_thw, ref["image_grid_thw"])
        assert torch.allclose(b.images[i].pixel_values, ref["pixel_values"].float())
        answer = row["messages"][1]["content"][0]["text"]
        trained = [t for t, m in zip(response, b.loss_mask.row(i).tolist()) if m]
        assert vl_tokenizer.decode(trained).strip() == answer


@torch.no_grad()
def reference_nll(model, tokenizer, rows) -> float:
    """Mean NLL per assistant token over `rows`, from the HF model's own forward with the images."""
    from polyrl.sft.template import ChatEncoder

    encoder = ChatEncoder(tokenizer)
    nll = tokens = 0.0
    for row in rows:
        ref = hf_reference(tokenizer, row)
        ids = ref["input_ids"]
        # the assistant mask from the text-only encoding, shifted past the expanded placeholders
        from polyrl.data.vision import with_image_parts

        mask = encoder.encode(with_image_parts(row["messages"])[0]).loss_mask
        mask = [0] * (ids.shape[1] - len(mask)) + mask  # the answer is at the end, after the images
        logits = model(input_ids=ids, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                       mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id)).logits
        logp = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None]).squeeze(1)
        m = torch.tensor(mask[1:], dtype=torch.float32)
        nll -= float((logp * m).sum())
        tokens += float(m.sum())
    return nll / tokens


def test_the_sft_loss_is_the_nll_given_the_images(chats, vl_dir, vl_tokenizer):
    from polyrl.platform import get_platform
    from polyrl.training import build_engine, vlm
    from polyrl.training.config import ActorConfig

    rows, path = chats
    ds = load(path, vl_tokenizer, vl_dir)
    platform = get_platform("cpu")
    device = platform.torch_device(0)
    model = vlm.load_vlm(vl_dir)
    engine = build_engine(model, ActorConfig(lr=1e-3, micro_batch_tokens=64, grad_clip=None), platform,
                          device, rank=0, world_size=1, horizon=1)
    got = evaluate(engine, ds.batch, device, token_budget=64)["val/loss"]
    assert got == pytest.approx(reference_nll(vlm.load_vlm(vl_dir).eval(), vl_tokenizer, rows), rel=1e-4)
    # the images matter: the same conversations with each other's images score differently
    swapped = ds.batch.replace(images=ds.batch.images[1:] + ds.batch.images[:1])
    assert abs(evaluate(engine, swapped, device, token_budget=64)["val/loss"] - got) > 1e-4


def test_bad_image_chats_are_bad_rows(tmp_path, chats, vl_dir, vl_tokenizer):
    rows, _ = chats
    good = rows[0]
    late_image = {"messages": [*good["messages"],
                               {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and?"}]},
                               {"role": "assistant", "content": [{"type": "text", "text": "1"}]}],
                  "images": good["images"] * 2}
    two_images = {**good, "images": good["images"] * 2}
    path = tmp_path / "bad.parquet"
    write_parquet([good, late_image, two_images], path)
    with pytest.raises(DataFileError, match=rf"{path} row 1: an assistant turn comes before the last image"):
        load(path, vl_tokenizer, vl_dir, on_bad_row="error")
    ds = load(path, vl_tokenizer, vl_dir, on_bad_row="skip")
    assert len(ds) == 1 and ds.bad_rows == 2
    write_parquet([good, two_images], path)
    with pytest.raises(DataFileError, match=rf"{path} row 1: the prompt has 1 image placeholders .* holds 2"):
        load(path, vl_tokenizer, vl_dir, on_bad_row="error")


def test_a_bomb_a_strip_and_a_remote_image_are_each_one_skipped_chat(tmp_path, chats, vl_dir, vl_tokenizer,
                                                                      caplog):
    """One decompression bomb (400M pixels), one 20000x1 image (the processor refuses its aspect
    ratio) and one remote URL among good chats: three bad rows, each named, and the run goes on."""
    import logging

    from PIL import Image

    rows, _ = chats
    good = rows[0]
    bomb = {**good, "images": [{"bytes": bomb_png(), "path": None}]}
    strip = {**good, "images": [{"bytes": png_bytes(Image.new("RGB", (20000, 1))), "path": None}]}
    remote = {**good, "images": [{"bytes": None, "path": "http://example.com/a.png"}]}
    path = tmp_path / "odd.parquet"
    write_parquet([*rows, bomb, strip, remote], path)
    with caplog.at_level(logging.WARNING, logger="polyrl"):
        ds = load(path, vl_tokenizer, vl_dir, on_bad_row="skip")
    n = len(rows)
    assert len(ds) == n and ds.bad_rows == 3
    assert f"{path} row {n}: image is too large to decode" in caplog.text
    assert f"{path} row {n + 1}: the image processor refuses the image(s) (20000x1)" in caplog.text
    assert f"{path} row {n + 2}: image http://example.com/a.png is a remote URL" in caplog.text
    with pytest.raises(DataFileError, match=rf"{path} row {n}: image is too large"):
        load(path, vl_tokenizer, vl_dir, on_bad_row="error")


def test_relative_image_paths_are_the_data_files(tmp_path, chats, vl_dir, vl_tokenizer, monkeypatch):
    """An image chat whose images column names "img/x.png" beside the data file loads from any
    working directory, with the same pixels as the inline bytes."""
    rows, _ = chats
    good = rows[0]
    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "x.png").write_bytes(good["images"][0]["bytes"])
    path = tmp_path / "data" / "rel.parquet"
    write_parquet([good, {**good, "images": [{"bytes": None, "path": "img/x.png"}]}], path)
    monkeypatch.chdir(tmp_path)
    ds = load(path, vl_tokenizer, vl_dir, on_bad_row="error")
    assert len(ds) == 2
    first, second = ds.batch.images
    assert torch.equal(first.pixel_values, second.pixel_values)


def test_a_text_only_model_given_image_chats_names_the_fix(tmp_path, chats):
    from transformers import AutoTokenizer

    from tiny_models import build_tiny_model

    _, path = chats
    model = build_tiny_model(tmp_path / "text_model")
    with pytest.raises(DataFileError, match="text-only model .* set model.path to a vision-language model"):
        load(path, AutoTokenizer.from_pretrained(model), model)
