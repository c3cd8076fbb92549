"""`polyrl serve` as a user runs it: a subprocess on a free port, one OpenAI request, Ctrl-C."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import openai


def _read_url(proc: subprocess.Popen, timeout_s: float) -> str:
    """The URL from the server's first line; a deadline so a broken start cannot hang the test."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    match = re.search(r"(http://\S+/v1)", line[0] if line else "")
    assert match, f"no URL printed within {timeout_s}s: {line!r}; stderr: {_stderr(proc)}"
    return match.group(1)


def _stderr(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        return "(still running)"
    return proc.stderr.read()[-2000:]


def test_polyrl_serve_answers_an_openai_request_and_stops_on_ctrl_c(tiny_model):
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyrl", "serve", "--model", tiny_model, "--port", "0",
         "--max-model-len", "64", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = _read_url(proc, timeout_s=120)
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt="1+2=", max_tokens=4)
        assert r.model == "tiny" and r.usage.prompt_tokens == 4
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
        assert "server stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
