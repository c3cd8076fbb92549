"""Local image files on `polyrl serve` (builtin:tiny-vl, a real uvicorn, the `openai` client): none
is read unless the operator allows a directory, nothing outside that directory is read however
the path is spelled (`..`, a symlink, file://), and every refusal is the same 400 whether or not
the file exists, so a client cannot probe the server's file system."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys

import openai
import pytest

from polyrl.builtin import resolve
from polyrl.rollout.native.engine import NativeEngine
from polyrl.rollout.server import HTTPServer, build_app
from polyrl.rollout.server.openai_images import LOCAL_MEDIA_REFUSED
from test_serve_cli import _read_url
from tiny_vl import bomb_png, png_bytes, shape_image

MODEL = "tiny-vl"
REFUSED = f"messages: {LOCAL_MEDIA_REFUSED}"  # the field, then the one message


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """An allowed directory with an image and a symlink leading out of it, a readable PNG
    outside it, and a name inside it that does not exist."""
    root = tmp_path_factory.mktemp("media")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    shape_image("red").save(allowed / "red.png")
    shape_image("blue", seed=1).save(outside / "secret.png")
    os.symlink(outside / "secret.png", allowed / "link.png")
    return allowed, outside


@pytest.fixture(scope="module")
def engine():
    return NativeEngine(resolve("builtin:tiny-vl"), max_model_len=128)


def _client(app):
    server = HTTPServer(app, "127.0.0.1", 0).start_in_thread()
    return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def _ask(client, url: str):
    return client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what?"},
                                               {"type": "image_url", "image_url": {"url": url}}]}])


def _refusal(client, url: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, url)
    assert info.value.status_code == 400
    return info.value.body["message"]


def test_no_local_file_is_read_by_default_and_every_refusal_is_the_same(engine, media):
    allowed, outside = media
    server, client = _client(build_app(engine, MODEL))
    try:
        urls = ["/etc/shadow", "/etc/hostname", "file:///etc/hostname", "/nonexistent.png",
                str(allowed / "red.png"), f"file://{allowed / 'red.png'}", str(allowed / "missing.png"),
                f"{allowed}/../outside/secret.png", "red.png"]
        messages = {url: _refusal(client, url) for url in urls}
        assert set(messages.values()) == {REFUSED}, messages
        # the same image as a data URL is served
        data = "data:image/png;base64," + base64.b64encode(png_bytes(shape_image("red"))).decode()
        assert _ask(client, data).usage.prompt_tokens > 4
    finally:
        server.stop()


def test_an_allowed_directory_serves_its_files_and_nothing_outside(engine, media):
    allowed, outside = media
    server, client = _client(build_app(engine, MODEL, allowed_local_media_path=str(allowed)))
    try:
        inline = "data:image/png;base64," + base64.b64encode((allowed / "red.png").read_bytes()).decode()
        want = _ask(client, inline)
        for url in [str(allowed / "red.png"), f"file://{allowed / 'red.png'}", "red.png",
                    f"{allowed}/./sub/../red.png"]:
            got = _ask(client, url)
            assert (got.usage.prompt_tokens, got.choices[0].message.content) == \
                (want.usage.prompt_tokens, want.choices[0].message.content), url
        escapes = [f"{allowed}/../outside/secret.png", "../outside/secret.png", str(outside / "secret.png"),
                   "link.png", f"file://{allowed}/link.png", "/etc/shadow", "/etc/hostname",
                   "/nonexistent.png", "missing.png", str(allowed), "", "red.png\0.txt"]
        messages = {url: _refusal(client, url) for url in escapes}
        assert set(messages.values()) == {REFUSED}, messages
        # a path beside inline bytes is never opened
        image = {"type": "image", "image": {"bytes": None, "path": "/etc/hostname"}}
        with pytest.raises(openai.BadRequestError, match="refused"):
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": [image]}])
    finally:
        server.stop()


def test_a_decompression_bomb_is_a_400_and_the_server_goes_on(engine):
    from PIL import Image

    data = "data:image/png;base64," + base64.b64encode(bomb_png()).decode()  # 400M pixels in 50 kB
    server, client = _client(build_app(engine, MODEL))
    try:
        assert "too large to decode" in _refusal(client, data)
        wide = "data:image/png;base64," + base64.b64encode(png_bytes(Image.new("RGB", (20000, 1)))).decode()
        assert "image processor refuses" in _refusal(client, wide)
        red = "data:image/png;base64," + base64.b64encode(png_bytes(shape_image("red"))).decode()
        assert _ask(client, red).choices[0].message.content is not None
    finally:
        server.stop()


@pytest.mark.slow
def test_polyrl_serve_opts_in_to_a_directory_and_warns_beyond_loopback(media):
    allowed, _ = media
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyrl", "serve", "--model", "builtin:tiny-vl", "--port", "0",
         "--host", "0.0.0.0", "--served-model-name", MODEL, "--max-model-len", "128",
         "--allowed-local-media-path", str(allowed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _read_url(proc, timeout_s=120).replace("0.0.0.0", "127.0.0.1")
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        assert _ask(client, "red.png").usage.prompt_tokens > 4
        assert _refusal(client, "../outside/secret.png") == REFUSED
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
        warning = [line for line in err.splitlines() if line.startswith("warning: --host 0.0.0.0")]
        assert warning and "no authentication" in warning[0] and str(allowed) in warning[0], err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_polyrl_serve_refuses_a_media_directory_that_is_not_one(tmp_path, capsys):
    from polyrl.cli.main import main

    assert main(["serve", "--model", "builtin:tiny-vl", "--allowed-local-media-path", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"--allowed-local-media-path {tmp_path / 'nope'}: not a directory" in err
