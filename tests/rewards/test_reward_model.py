"""reward.model: a tiny Qwen2ForSequenceClassification built in tmp_path scores chats rendered
with its own template, batched; in process and in a Ray reward worker."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.platform import SIMULATED_PROBES, get_platform
from polyrl.rewards import RewardConfig, RewardManager, RewardRequest
from polyrl.rewards.reward_model import (
    RewardModelError,
    RewardModelRunner,
    conversation,
    reward_worker_options,
)


def build_reward_model(path, num_labels=1, chat_template=True, seed=0) -> str:
    from tiny_models import char_tokenizer
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, vocab_size=128,
                         max_position_embeddings=256, eos_token_id=1, pad_token_id=0,
                         num_labels=num_labels)
    Qwen2ForSequenceClassification(config).save_pretrained(str(path))
    tok = char_tokenizer()
    if not chat_template:
        tok.chat_template = None
    tok.save_pretrained(str(path))
    if not chat_template:  # save_pretrained may keep a template file; drop every trace
        for f in path.glob("chat_template*"):
            f.unlink()
        cfg_file = path / "tokenizer_config.json"
        data = json.loads(cfg_file.read_text())
        data.pop("chat_template", None)
        cfg_file.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return build_reward_model(tmp_path_factory.mktemp("rm"))


def by_hand(path, text, last_tokens=None) -> float:
    """The score head on one unpadded sequence (its last `last_tokens` tokens), straight from
    transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = tok(text, add_special_tokens=False)["input_ids"][-(last_tokens or 0):]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


PAIRS = [
    ([{"role": "user", "content": "2+3="}], "5"),
    ("what is 12*12?", "144, since 12*12 = 144"),
    (None, "a"),
    ([{"role": "system", "content": "be brief", "name": None}, {"role": "user", "content": "hi"}],
     "hello there, how can I help you today?"),
    ("x", "y" * 40),
]


def test_chat_rendered_with_the_reward_models_template(rm_path):
    runner = RewardModelRunner(load_config(RewardConfig, overrides=[f"model.path={rm_path}"]).model)
    assert conversation("q", "a") == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert conversation(PAIRS[3][0], "r")[0] == {"role": "system", "content": "be brief"}  # None fields dropped
    assert runner.render("2+3=", "5") == "2+3=5"  # the test template joins the contents


def test_batched_scores_equal_one_by_one_forward(rm_path):
    cfg = load_config(RewardConfig, overrides=[f"model.path={rm_path}", "model.batch_size=2"]).model
    runner = RewardModelRunner(cfg)
    scores = runner.score(PAIRS)
    expected = [by_hand(rm_path, runner.render(p, r)) for p, r in PAIRS]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == len(PAIRS)  # a real head, not a constant


def test_long_chats_keep_their_end(rm_path):
    cfg = load_config(RewardConfig, overrides=[f"model.path={rm_path}", "model.max_length=16"]).model
    runner = RewardModelRunner(cfg)
    text = runner.render("p" * 50, "the answer is 42")
    assert runner.score([("p" * 50, "the answer is 42")]) == pytest.approx([by_hand(rm_path, text, last_tokens=16)], abs=1e-5)


def test_manager_in_process(rm_path):
    cfg = load_config(RewardConfig, overrides=[f"model.path={rm_path}", "model.in_process=true"])
    m = RewardManager(cfg)
    try:
        out = m.score([RewardRequest("chat", r, None, True, None, prompt=p) for p, r in PAIRS])
        runner = RewardModelRunner(cfg.model)
        assert out.scores == pytest.approx(runner.score(PAIRS), abs=1e-6)
        assert out.accs == [float(s > 0) for s in out.scores]
        assert out.metrics["reward/errors"] == 0
    finally:
        m.close()


def test_bad_reward_models_name_the_key(tmp_path):
    with pytest.raises(RewardModelError, match=r"reward.model.path: .*\(no config.json\)"):
        RewardManager(RewardConfig(model={"path": str(tmp_path / "nope")}))
    two = build_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardModelError, match=r"reward.model.path: .*num_labels=2; .*one score head"):
        RewardModelRunner(RewardConfig(model={"path": two}).model)
    bare = build_reward_model(tmp_path / "bare", chat_template=False)
    with pytest.raises(RewardModelError, match=r"reward.model.path: .*no chat template"):
        RewardModelRunner(RewardConfig(model={"path": bare}).model)
    with pytest.raises(ConfigError, match=r"model.dtype: 'int8' is not one of"):
        load_config(RewardConfig, overrides=["model.path=x", "model.dtype=int8"])


def test_reward_worker_resources():
    cfg = RewardConfig(model={"path": "x", "num_cpus": 2}).model
    assert reward_worker_options(cfg, get_platform("cpu")) == {"num_cpus": 2}
    gpu = get_platform(None, SIMULATED_PROBES["h100"])
    on_gpu = cfg.model_copy(update={"num_devices": 1})
    assert reward_worker_options(on_gpu, gpu) == {"num_cpus": 2, "num_gpus": 1}
    assert reward_worker_options(cfg.model_copy(update={"in_process": True}), gpu) is None


@pytest.mark.slow  # a Ray actor start plus a model load: ~25 s on 2 busy cores
def test_ray_reward_worker_scores_like_the_runner(rm_path, ray_session):
    cfg = load_config(RewardConfig, overrides=[f"model.path={rm_path}", "model.batch_size=3"])
    m = RewardManager(cfg, platform_name="cpu")
    try:
        requests = [RewardRequest("chat", r, None, True, None, prompt=p) for p, r in PAIRS]
        out = m.score(requests)
        assert out.scores == pytest.approx(RewardModelRunner(cfg.model).score(PAIRS), abs=1e-6)
        assert out.metrics["reward/errors"] == 0
        actor = m.model._actor
        assert m.score(requests[:1]).scores == pytest.approx(out.scores[:1], abs=1e-6)
        assert m.model._actor is actor  # one worker for the run, not one per batch
    finally:
        m.close()


@pytest.mark.slow
def test_dead_reward_worker_scores_zero_and_counts(rm_path, ray_session):
    m = RewardManager(RewardConfig(model={"path": rm_path}), platform_name="cpu")
    try:
        requests = [RewardRequest("chat", "r", None, True, None, prompt="p")] * 2
        assert m.score(requests).metrics["reward/errors"] == 0
        ray_session.kill(m.model._actor)
        out = m.score(requests)
        assert out.scores == [0.0, 0.0] and out.failed == [True, True]
        assert out.metrics["reward/errors"] == 2
    finally:
        m.close()
