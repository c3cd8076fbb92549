"""TRL-style batched reward functions next to verl's compute_score: told apart by signature,
scored through the RewardManager with its error accounting, timeouts and value checks."""

import logging
import textwrap
import pytest

from polyrl.config import ConfigError
from polyrl.rewards import RewardConfig, RewardManager, RewardRequest
from polyrl.rewards.functions import call_batch


def write(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


def req(text, truth="7", source="mine", prompt="What is 3+4?", extra=None):
    return RewardRequest(source, text, truth, True, extra, prompt=prompt)


@pytest.fixture
def manager(tmp_path):
    made = []

    def make(body, fn="reward", **cfg):
        path = write(tmp_path, f"m{len(made)}", body)
        m = RewardManager(RewardConfig(custom_function=f"{path}:{fn}", **cfg))
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


TRL = """
    CALLS = []

    def reward(prompts, completions, ground_truth, **kwargs):
        CALLS.append({"prompts": prompts, "completions": completions, "ground_truth": ground_truth,
                      **kwargs})
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(t.strip() == g) for t, g in zip(texts, ground_truth)]
"""


def test_trl_function_is_called_once_per_batch_with_columns_as_lists(manager):
    m = manager(TRL)
    out = m.score([req("7", extra={"level": 1}), req("9", extra={"level": 2}), req("7", source="other")])
    assert out.scores == [1.0, 0.0, 1.0] and out.accs == [1.0, 0.0, 1.0]
    calls = m.router.own_function("mine").fn.__globals__["CALLS"]
    assert len(calls) == 1  # batched: one call for the three responses
    call = calls[0]
    assert call["prompts"] == ["What is 3+4?"] * 3
    assert call["completions"] == ["7", "9", "7"]  # plain prompts: plain completions
    assert call["ground_truth"] == ["7", "7", "7"]
    assert call["data_source"] == ["mine", "mine", "other"]
    assert call["level"] == [1, 2, None]  # extra_info keys arrive as columns
    assert call["extra_info"] == [{"level": 1}, {"level": 2}, None]
    assert call["finished_with_eos"] == [True, True, True]
    assert out.metrics["reward/no_score"] == 0.0


def test_conversational_prompts_get_message_completions(manager):
    m = manager(TRL)
    chat = [{"role": "user", "content": "What is 3+4?"}]
    out = m.score([req("7", prompt=chat), req("8", prompt=chat)])
    assert out.scores == [1.0, 0.0]
    call = m.router.own_function("mine").fn.__globals__["CALLS"][0]
    assert call["prompts"] == [chat, chat]
    assert call["completions"] == [[{"role": "assistant", "content": "7"}],
                                   [{"role": "assistant", "content": "8"}]]


def test_only_declared_keywords_are_passed_without_kwargs(manager):
    m = manager("""
        def reward(completions, ground_truth, scale):
            return [scale * float(c == g) for c, g in zip(completions, ground_truth)]
    """, custom_function_kwargs={"scale": 2.0})
    assert m.score([req("7"), req("1")]).scores == [2.0, 0.0]


def test_verl_compute_score_works_unchanged_next_to_it(tmp_path):
    verl = write(tmp_path, "verl_reward", """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)
    """)
    trl = write(tmp_path, "trl_reward", TRL)
    m = RewardManager(RewardConfig(combine={"mine": [
        {"kind": "function", "function": f"{verl}:compute_score", "weight": 1.0},
        {"kind": "function", "function": f"{trl}:reward", "weight": 0.5}]}))
    try:
        assert m.score([req("7"), req("3")]).scores == [1.5, 0.0]
    finally:
        m.close()


def test_none_is_no_score_not_a_failure(manager):
    m = manager("""
        def reward(prompts, completions, **kwargs):
            return [None if c == "skip" else 1.0 for c in completions]
    """)
    out = m.score([req("skip"), req("7"), req("skip")])
    assert out.scores == [0.0, 1.0, 0.0] and out.failed == [False, False, False]
    assert out.metrics["reward/no_score"] == 2.0 and out.metrics["reward/errors"] == 0.0


def test_bad_values_are_refused_per_sample(manager):
    m = manager("""
        def reward(prompts, completions, **kwargs):
            return {"nan": float("nan"), "big": 1e300, "str": "high"}.get(completions[0], 1.0), 1.0, 2.0
    """)
    # a tuple is a sequence of the right length: its first entry is checked like any score
    for bad in ("nan", "big", "str"):
        out = m.score([req(bad), req("a"), req("b")])
        assert out.failed == [True, False, False] and out.scores == [0.0, 1.0, 2.0]
    assert m.error_summary()["errors"] == 3


def test_wrong_length_or_raising_call_fails_each_sample(manager, caplog):
    m = manager("""
        def reward(prompts, completions, **kwargs):
            if completions[0] == "boom":
                raise RuntimeError("verifier exploded")
            return [1.0]
    """)
    with caplog.at_level(logging.ERROR, logger="polyrl.rewards.manager"):
        out = m.score([req("boom"), req("y")])
    assert out.failed == [True, True] and out.scores == [0.0, 0.0]
    assert "verifier exploded" in caplog.text  # the first traceback is logged
    out = m.score([req("x"), req("y")])  # one value for two completions
    assert out.failed == [True, True]
    summary = m.error_summary()
    assert summary["errors"] == 4 and summary["calls"] == 4
    assert "verifier exploded" in summary["first_error"]
    with pytest.raises(Exception, match="returned 1 values for 2 completions"):
        call_batch(m.router.own_function("mine"), [req("x"), req("y")])



def test_batched_call_times_out_each_of_its_samples(tmp_path):
    path = write(tmp_path, "hangs", """
        import threading
        EVENT = threading.Event()
        def reward(prompts, completions, **kwargs):
            EVENT.wait()
            return [1.0] * len(completions)
    """)
    m = RewardManager(RewardConfig(custom_function=f"{path}:reward", timeout_s=0.05))
    try:
        out = m.score([req("a"), req("b")])
        assert out.failed == [True, True] and out.metrics["reward/timeouts"] == 2.0
    finally:
        m.router.own_function("mine").fn.__globals__["EVENT"].set()
        m.close()


@pytest.mark.parametrize("body", [
    "def reward(x):\n    return 1.0\n",  # one argument: neither form
    "def reward(data_source, solution_str):\n    return 1.0\n",  # verl form missing ground_truth
    "def reward(a, b, c, d, e):\n    return 1.0\n",  # too many required arguments
])
def test_a_function_it_cannot_call_is_a_startup_error_naming_both_forms(tmp_path, body):
    path = tmp_path / "bad.py"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        RewardManager(RewardConfig(custom_function=f"{path}:reward"))
    (line,) = info.value.problems
    assert line.startswith(f"reward.custom_function={path}:reward: cannot call reward(")
    assert "compute_score(data_source, solution_str, ground_truth" in line
    assert "fn(prompts, completions, **columns)" in line


@pytest.mark.slow
def test_a_trl_function_trains_in_a_short_run(tmp_path, capsys):
    """`polyrl train reward.custom_function=FILE:fn` with a TRL-style function, 2 steps, no
    validation: batched calls, chat completions (the embedded task's prompts are messages), and
    None answers counted in reward/no_score."""
    import json

    from polyrl.cli.main import main

    calls = tmp_path / "calls.jsonl"
    path = write(tmp_path, "trl_len", f"""
        import json

        def length_reward(prompts, completions, ground_truth, **kwargs):
            texts = [c[0]["content"] for c in completions]  # conversational: message lists
            with open({str(calls)!r}, "a") as f:
                f.write(json.dumps({{"n": len(texts), "roles": sorted({{p[-1]["role"] for p in prompts}}),
                                    "truths": len(ground_truth)}}) + "\\n")
            return [None if i % 4 == 0 else len(t) / 10 for i, t in enumerate(texts)]
    """)
    out = tmp_path / "out"
    code = main(["train", "trainer.progress_bar=false", f"trainer.output_dir={out}",
                 f"reward.custom_function={path}:length_reward", "trainer.total_steps=2",
                 "trainer.val_every=0", "trainer.val_before_train=false", "data.val_files=[]",
                 "logging.plot_at_end=false"])
    assert code == 0
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    assert sum(c["n"] for c in seen) == 2 * 16 * 8 and all(c["n"] > 1 for c in seen)  # batched
    assert all(c["roles"] == ["user"] and c["truths"] == c["n"] for c in seen)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/errors"] == 0 and r["reward/no_score"] > 0 for r in rows)
    assert all(r["reward/score_mean"] > 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_errors"]["errors"] == 0


def test_polyrl_train_with_an_uncallable_function_is_one_line_before_ray(tmp_path, capsys, caplog):
    import ray

    from polyrl.cli.main import main

    ray_before = ray.is_initialized()
    path = tmp_path / "bad.py"
    path.write_text("def reward(x):\n    return 1.0\n")
    code = main(["train", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'out'}",
                 f"reward.custom_function={path}:reward"])
    err = capsys.readouterr().err + caplog.text
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "cannot call reward(x)" in line]
    assert "compute_score(data_source" in line and "fn(prompts, completions, **columns)" in line
    assert ray.is_initialized() == ray_before
