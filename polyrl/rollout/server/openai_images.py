"""OpenAI image content parts on /v1/chat/completions, for a vision-language model.

A user message may hold `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
parts (OpenAI's chat format). A remote URL is refused: the server never downloads. A local path
or `file://` URL is refused too unless the operator opted in with a media directory
(`polyrl serve --allowed-local-media-path DIR`, `LocalMedia`): then only files whose real path
(symlinks and `..` resolved) lies under DIR are read, and every refusal is the same 400, whether
or not the file exists, so a client cannot probe the server's file system. The conversation is rendered the way training data is
(polyrl/data/vision.py, verl's schema): each image part becomes `{"type": "image"}` for the
model's chat template, which writes one `<|image_pad|>` per image; the model directory's image
processor makes the pixel patches, and each pad is expanded to its image's token count, exactly
as Hugging Face's Qwen2-VL processor does. The engine gets the ids and the `ImageInputs`
(`images=`, polyrl/rollout/base.py). Every problem is a 400 on field "messages".
"""

from __future__ import annotations

import os
from typing import Any, Callable

from polyrl.data.errors import DataFileError
from polyrl.data.multimodal import ImageInputs
from polyrl.data.vision import IMAGE_PARTS, ImageRowError, VisionPrompter, open_image, with_image_parts
from polyrl.rollout.base import RolloutInputError


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PARTS
               for m in messages if isinstance(m.get("content"), list) for part in m["content"])


LOCAL_MEDIA_REFUSED = ("local image paths and file:// URLs are refused: this server reads a local image only "
                       "inside the directory its operator allows (polyrl serve --allowed-local-media-path "
                       "DIR); send the image inline as a data:image/...;base64 URL")
"""The one message of every refused local path: it never depends on whether the file exists."""


class LocalMedia:
    """Which local image files a server may read: none (`directory=None`, the default), or the
    regular files whose real path lies under `directory`."""

    def __init__(self, directory: str | os.PathLike | None = None):
        if directory is None:
            self.root = None
            return
        root = os.path.realpath(os.fspath(directory))
        if not os.path.isdir(root):
            raise ValueError(f"--allowed-local-media-path {directory}: not a directory")
        self.root = root

    def entry(self, value: Any) -> Any:
        """An image entry with any local path replaced by its checked real path; bytes pass."""
        if isinstance(value, dict):
            if value.get("bytes") is not None:  # inline bytes: a path beside them is never opened
                if not isinstance(value["bytes"], (bytes, bytearray)):
                    raise ImageRowError("an image part's bytes must come as a data:image/...;base64 URL")
                return {"bytes": value["bytes"], "path": None}
            value = value.get("path") or value.get("image")
        if value is None:
            return None
        if not isinstance(value, str):
            raise ImageRowError(f"an image part must hold a data URL, got {type(value).__name__}")
        return self.path(value)

    def path(self, name: str) -> str:
        """The real path of `name` under the allowed directory (a relative name is relative to
        it), or the one refusal, LOCAL_MEDIA_REFUSED. The file is opened by this real path, so a
        symlink swapped in after the check is not followed out of the directory either."""
        if self.root is None or "\0" in name:
            raise ImageRowError(LOCAL_MEDIA_REFUSED)
        real = os.path.realpath(os.path.join(self.root, name))
        if os.path.commonpath([real, self.root]) != self.root or not os.path.isfile(real):
            raise ImageRowError(LOCAL_MEDIA_REFUSED)
        return real


class ChatImages:
    """Turns a chat with image parts into (expanded ids, ImageInputs) for `engine`; local files
    are read only as `local_media` allows (by default none)."""

    def __init__(self, engine: Any, tokenizer: Any, local_media: LocalMedia | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.local_media = local_media or LocalMedia()
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
            images = [open_image(self.local_media.entry(x)) for x in inline]
            ids = self.tokenizer.encode(render(parts), add_special_tokens=False)
            inputs = prompter.process(images)
            (ids,) = prompter.expand(ids, inputs)
        except ImageRowError as exc:
            raise RolloutInputError("messages", str(exc)) from None
        return ids, inputs
