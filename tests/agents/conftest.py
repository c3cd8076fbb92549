"""Fixtures for the agent tests: two real tokenizers, scripted and random checkpoints, and an
engine proxy that records what the real native engine was asked and what it sampled."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from agent_models import build_random_model, build_scripted_model, byte_level_tokenizer, metaspace_tokenizer  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
ANSWER = "The answer is 5."
USER = [{"role": "user", "content": "what is 2+3?"}]
TOKENIZERS = {"byte_level": byte_level_tokenizer, "metaspace": metaspace_tokenizer}


class RecordingEngine:
    """The real engine, plus a record of every (prompt ids, output) it served."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt_ids, sampling, request_id=None):
        outs = await self.engine.generate(prompt_ids, sampling, request_id)
        self.calls.append((list(prompt_ids), outs[0]))
        return outs


@pytest.fixture(scope="session", params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]([CALL, BAD_CALL, ANSWER])


def header_token(tokenizer) -> int:
    """The last token of the assistant header (what the scripted model continues from)."""
    from polyrl.agents.chat import ChatDelta

    return ChatDelta(tokenizer).prompt_ids(USER)[-1]


@pytest.fixture(scope="session")
def scripted_dirs(tokenizer, tmp_path_factory):
    """call text -> a checkpoint that writes it, then the answer once a tool result is in view."""
    out = {}
    for name, call in (("good", CALL), ("bad", BAD_CALL)):
        out[call] = build_scripted_model(tmp_path_factory.mktemp(f"scripted-{name}"), tokenizer,
                                         header_token(tokenizer), call, ANSWER)
    return out


@pytest.fixture(scope="session")
def random_dir(tokenizer, tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("random"), tokenizer)


def native(model_dir, tokenizer, **kw):
    from polyrl.rollout.native.engine import NativeEngine

    return RecordingEngine(NativeEngine(model_dir, tokenizer=tokenizer, max_model_len=kw.pop("max_model_len", 512),
                                        max_num_seqs=16, **kw))
