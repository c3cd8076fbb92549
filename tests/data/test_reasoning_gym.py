"""reasoning-gym tasks as data files (`reasoning_gym:TASK?size=N&seed=S`, polyrl/data/reasoning_gym.py)
scored by the task's own scorer (polyrl/rewards/reasoning_gym.py), against the real library."""

from __future__ import annotations

import pytest
from cli_runs import train_here  # noqa: F401  (a fixture)

from polyrl.data import DataFileError, read_rows
from polyrl.rewards import RewardManager
from polyrl.rewards.manager import RewardRequest

pytest.importorskip("reasoning_gym")

ARITH = ("reasoning_gym:basic_arithmetic?size=20&seed={seed}&min_terms=2&max_terms=2&min_digits=1"
         "&max_digits=2&operators=+&allow_parentheses=false&allow_negation=false")
BARE = "&prompt=polyrl.data.reasoning_gym:bare_expression"


def test_rows_are_verl_rows_seeded_and_task_options_apply():
    rows = read_rows(ARITH.format(seed=0))
    assert len(rows) == 20
    row = rows[0]
    assert row["data_source"] == "reasoning_gym"
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["entry"]["question"]}]
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["entry"]["answer"]
    assert row["extra_info"]["task"] == "basic_arithmetic"
    for r in rows:  # operators=+ (a comma list for a list field), no negation, no parentheses
        expression = r["extra_info"]["entry"]["metadata"]["expression"]
        assert "+" in expression and "-" not in expression and "(" not in expression, expression
    assert read_rows(ARITH.format(seed=0)) == rows  # the same seed: the same rows
    other = [r["prompt"] for r in read_rows(ARITH.format(seed=100000))]
    assert other != [r["prompt"] for r in rows]


def test_prompt_function_system_prompt_and_prompt_key():
    bare = read_rows(ARITH.format(seed=0) + BARE)[0]
    expression = bare["extra_info"]["entry"]["metadata"]["expression"]
    assert bare["prompt"][0]["content"] == expression.replace(" ", "") + "="
    with_system = read_rows("reasoning_gym:chain_sum?size=2&seed=1&system=default", prompt_key="question")[0]
    assert with_system["question"][0]["role"] == "system" and "<answer>" in with_system["question"][0]["content"]
    assert "prompt" not in with_system


def test_the_task_scorer_is_the_reward():
    rows = read_rows(ARITH.format(seed=0)) + read_rows("reasoning_gym:number_sequence?size=4&seed=3")
    manager = RewardManager()
    manager.check_sources({r["data_source"] for r in rows})
    answers = [r["reward_model"]["ground_truth"] for r in rows]
    requests = []
    for row, answer in zip(rows, answers):
        requests.append(RewardRequest("reasoning_gym", f" {answer}\n", None, True, row["extra_info"]))
        requests.append(RewardRequest("reasoning_gym", f"so <answer>{answer}</answer>", None, True, row["extra_info"]))
        requests.append(RewardRequest("reasoning_gym", "no idea", None, True, row["extra_info"]))
    result = manager.score(requests)
    assert result.scores == [1.0, 1.0, 0.0] * len(rows)
    assert result.accs == [1.0, 1.0, 0.0] * len(rows)
    assert result.metrics["reward/errors"] == 0
    # basic_arithmetic's scorer gives partial credit to a near miss; the accuracy counts full scores
    near = manager.score([RewardRequest("reasoning_gym", f"{answers[0]}0", None, True, rows[0]["extra_info"])])
    manager.close()
    assert 0 < near.scores[0] < 1 and near.accs == [0.0]


@pytest.mark.parametrize("spec,needle", [
    ("reasoning_gym:basic_arithmetc?size=3", "unknown reasoning-gym task 'basic_arithmetc'; did you mean basic_arithmetic"),
    ("reasoning_gym:chain_sum?size=3&digits=2", "task 'chain_sum' has no option 'digits'; its options: min_terms"),
    ("reasoning_gym:chain_sum?size=3&min_terms=0", "reasoning-gym rejected the options: min_terms must be positive"),
    ("reasoning_gym:chain_sum?size=3&system=nope", "unknown system=nope"),
    ("reasoning_gym:chain_sum?size=3&prompt=no_such_mod:fn", "cannot import prompt=no_such_mod:fn"),
    ("reasoning_gym:chain_sum?size", "'size' is not KEY=VALUE"),
])
def test_bad_specs_name_the_problem(spec, needle):
    with pytest.raises(DataFileError, match="^data file reasoning_gym:") as info:
        read_rows(spec)
    assert needle in str(info.value)


def test_unknown_task_is_one_line_before_ray(train_here):
    out = train_here("data.train_files=[reasoning_gym:no_such_task?size=8&seed=0]", "data.val_files=[]")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "unknown reasoning-gym task 'no_such_task'" in out.stderr
    assert "starting the actors" not in out.stdout + out.stderr


def test_validation_prompts_the_training_set_holds_are_dropped(tiny_tokenizer):
    from polyrl.builtin import resolve
    from polyrl.data import DataConfig, build_loaders

    small = "reasoning_gym:basic_arithmetic?size={size}&seed={seed}&min_terms=2&max_terms=2&max_digits=1&operators=+"
    cfg = DataConfig(train_files=[small.format(size=60, seed=0)], val_files=[small.format(size=40, seed=1000),
                     resolve("builtin:arithmetic_val")], train_batch_size=4)
    train, val = build_loaders(cfg, tiny_tokenizer)
    seen = {s.prompt_text for s in train.dataset}
    gym = [s for s in val.dataset if s.data_source == "reasoning_gym"]
    assert 0 < len(gym) < 40 and not any(s.prompt_text in seen for s in gym)  # 1-digit sums collide
    assert sum(s.data_source == "arithmetic" for s in val.dataset) == 500  # other data untouched
    assert val.batch_size == len(val.dataset)
    every = DataConfig(train_files=[small.format(size=60, seed=0)], val_files=[small.format(size=5, seed=0)])
    with pytest.raises(DataFileError, match="all 5 validation prompts are also training prompts"):
        build_loaders(every, tiny_tokenizer)
