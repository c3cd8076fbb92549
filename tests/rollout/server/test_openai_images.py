"""OpenAI image content parts on a vision-language model, over a real uvicorn and the `openai`
client: the server's ids and images are those of Hugging Face's Qwen2-VL processor (the answer
equals the engine's on the processor's output), and bad image input is a 400 on "messages"."""

from __future__ import annotations

import asyncio
import base64

import openai
import pytest

from polyrl.rollout.base import RolloutInputError, SamplingParams
from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.server import HTTPServer, build_app
from polyrl.rollout.server.openai_service import OpenAIService
from polyrl.rollout.server.protocol import ChatCompletionRequest
from tiny_vl import build_tiny_vl, image_inputs_for, png_bytes, shape_image, tiny_vl_processor

MODEL = "tiny-vl"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return NativeEngine(build_tiny_vl(tmp_path_factory.mktemp("tiny-vl")), max_model_len=128)


@pytest.fixture(scope="module")
def client(engine):
    server = HTTPServer(build_app(engine, MODEL), "127.0.0.1", 0).start_in_thread()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    server.stop()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def test_image_url_parts_are_the_processors_ids_and_pixels(client, engine):
    red, blue = shape_image("red", seed=1), shape_image("blue", seed=2, side=84)
    content = [{"type": "text", "text": "which "}, {"type": "image_url", "image_url": {"url": data_url(red)}},
               {"type": "text", "text": " or "}, {"type": "image_url", "image_url": {"url": data_url(blue)}}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                       max_tokens=5, temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True})
    # the reference: HF's processor on the rendered conversation, straight into the engine
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "which "}, {"type": "image"},
                                      {"type": "text", "text": " or "}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    ids, images = image_inputs_for(tiny_vl_processor(engine.tokenizer), text, [red, blue])
    [[want]] = engine.generate_batch([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                     images=[images])
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == want.text
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(want.logprobs, abs=1e-6)


def test_bad_image_parts_are_a_400_on_messages(client):
    for part, match in [({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "base64"),
                        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "remote URL"),
                        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                         "cannot be read")]:
        with pytest.raises(openai.BadRequestError, match=match) as info:
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": [part]}])
        assert info.value.status_code == 400 and "messages" in str(info.value)


def test_a_text_only_model_refuses_image_parts(tiny_model):
    service = OpenAIService(NativeEngine(tiny_model, max_model_len=64), "tiny")
    image = {"type": "image_url", "image_url": {"url": data_url(shape_image())}}
    req = ChatCompletionRequest(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(RolloutInputError, match="text-only") as info:
        asyncio.run(service.chat(req))
    assert info.value.field == "messages"
