"""OpenAI image content parts on /v1/chat/completions, for a vision-language model.

A user message may hold `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
parts (OpenAI's chat format; a local path or `file://` URL is read too, a remote URL is refused:
the server never downloads). The conversation is rendered the way training data is
(polyrl/data/vision.py, verl's schema): each image part becomes `{"type": "image"}` for the
model's chat template, which writes one `<|image_pad|>` per image; the model directory's image
processor makes the pixel patches, and each pad is expanded to its image's token count, exactly
as Hugging Face's Qwen2-VL processor does. The engine gets the ids and the `ImageInputs`
(`images=`, polyrl/rollout/base.py). Every problem is a 400 on field "messages".
"""

from __future__ import annotations

from typing import Any, Callable

from polyrl.data.errors import DataFileError
from polyrl.data.multimodal import ImageInputs
from polyrl.data.vision import IMAGE_PARTS, ImageRowError, VisionPrompter, open_image, with_image_parts
from polyrl.rollout.base import RolloutInputError


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PARTS
               for m in messages if isinstance(m.get("content"), list) for part in m["content"])


class ChatImages:
    """Turns a chat with image parts into (expanded ids, ImageInputs) for `engine`."""

    def __init__(self, engine: Any, tokenizer: Any):
        self.engine, self.tokenizer = engine, tokenizer
        self._prompter: VisionPrompter | None = None

    def prompter(self) -> VisionPrompter:
        if self._prompter is None:
            if getattr(getattr(self.engine, "spec", None), "vision", None) is None:
                raise RolloutInputError("messages", "image content parts need a vision-language model "
                                        "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL); this server's model is text-only")
            model_dir = getattr(self.engine, "model_dir", None)
            if model_dir is None:
                raise RolloutInputError("messages", "this engine was built from an in-memory model, without "
                                        "the model directory whose image processor prepares images")
            try:
                self._prompter = VisionPrompter.from_model_dir(model_dir, self.tokenizer)
            except DataFileError as exc:
                raise RolloutInputError("messages", str(exc)) from None
        return self._prompter

    def prompt(self, messages: list[dict[str, Any]],
               render: Callable[[list[dict[str, Any]]], str]) -> tuple[list[int], ImageInputs | None]:
        """`render`: the chat template applied to the messages (image parts as {"type": "image"})."""
        prompter = self.prompter()
        try:
            parts, inline = with_image_parts(messages, placeholders=False)
            if any(x is None for x in inline):
                raise ImageRowError("an image part carries no image; send image_url with a data URL")
            images = [open_image(x) for x in inline]
            ids = self.tokenizer.encode(render(parts), add_special_tokens=False)
            inputs = prompter.process(images)
            (ids,) = prompter.expand(ids, inputs)
        except ImageRowError as exc:
            raise RolloutInputError("messages", str(exc)) from None
        return ids, inputs
