"""Plugins from a user's own package, outside polyrl (docs/plugins.md): named by import path in
the config of a real `polyrl train`, with the package's directory on PYTHONPATH only, each one is
called where it runs (the estimator and the reward on the driver, the policy loss in the policy
worker, the environment and the tool in the rollout worker: Ray actors), and the dry run shows
the PYTHONPATH every actor gets, with its source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "agents"))
from user_package import PACKAGE, marks, write_package  # noqa: E402

POLYRL = Path(sys.executable).parent / "polyrl"
"""The console script, as a user runs it (its directory, not the run directory, is on sys.path)."""

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
ANSWER = "The answer is 5."
USER = [{"role": "user", "content": "what is 2+3?"}]

PLUGIN_KEYS = [
    f"algorithm.adv_estimator={PACKAGE}.algos:centered",
    f"algorithm.policy_loss={PACKAGE}.algos:marked_ppo",
    f"reward.custom_function={PACKAGE}.rewards:score",
    f"agent.environment={PACKAGE}.envs:OneStep",
    "agent.environment_kwargs={reward: 1.0}",
    f"agent.tools=[{PACKAGE}.tools:calculator]",
    "agent.tools_in_prompt=false",
]


def command() -> list[str]:
    return [str(POLYRL)] if POLYRL.exists() else [sys.executable, "-m", "polyrl"]


POLYRL_ROOT = str(Path(__import__("polyrl").__file__).parents[1])
"""Where this polyrl is: on PYTHONPATH after the plugins, since a subprocess runs in another
directory and an editable install may point elsewhere."""


def user_env(plugins: Path | None, marks_dir: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([*([str(plugins)] if plugins else []), POLYRL_ROOT])
    if marks_dir is not None:
        env["POLYRL_PLUGIN_MARKS"] = str(marks_dir)
    return env


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A scripted model that calls the calculator then answers, and 4 rows: 2 for the tools
    environment (extra_info.agent_name), 2 for the default one (the plugin environment)."""
    from agent_models import build_scripted_model, byte_level_tokenizer

    from polyrl.agents.chat import ChatDelta

    tokenizer = byte_level_tokenizer([CALL, ANSWER])
    header = ChatDelta(tokenizer).prompt_ids(USER)[-1]
    root = tmp_path_factory.mktemp("scripted")
    model = build_scripted_model(root / "model", tokenizer, header, CALL, ANSWER)
    rows = [{"data_source": "arithmetic", "prompt": USER, "reward_model": {"ground_truth": "5"},
             "extra_info": {"i": i, **({"agent_name": "tools"} if i % 2 else {})}} for i in range(4)]
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return model, data


@pytest.mark.slow
def test_every_plugin_kind_runs_from_a_user_package_on_pythonpath(scripted, tmp_path):
    model, data = scripted
    plugins = write_package(tmp_path / "plugins")
    marks_dir, out, run_dir = tmp_path / "marks", tmp_path / "out", tmp_path / "run"
    marks_dir.mkdir()
    run_dir.mkdir()  # the run directory holds nothing: the package is found through PYTHONPATH
    proc = subprocess.run(
        [*command(), "train", f"model.path={model}", f"data.train_files=[{data}]", "data.train_batch_size=4",
         "rollout.n=2", "rollout.response_length=8", "actor.lr=1e-6", "agent.max_turns=3",
         "agent.max_response_tokens=64", *PLUGIN_KEYS, "trainer.total_steps=1", "trainer.val_every=0",
         "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.save_at_end=false",
         "actor.num_cpus_per_worker=1", f"trainer.output_dir={out}", "logging.plot_at_end=false"],
        cwd=run_dir, env=user_env(plugins, marks_dir), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    called = marks(marks_dir)
    assert set(called) == {"estimator", "loss", "environment", "tool", "reward"}, called
    # where each runs: the loss in the policy worker, the environment and the tool in the process
    # that hosts the rollout engine (hybrid: the same policy worker), all of them Ray actors
    for kind in ("loss", "environment", "tool"):
        assert all(actor is not None for actor in called[kind]), (kind, called[kind])
    # the estimator and the scorer are the driver's (polyrl/trainer/loop.py)
    for kind in ("estimator", "reward"):
        assert called[kind] and all(actor is None for actor in called[kind]), (kind, called[kind])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 1 and "actor/grad_norm" in r)
    assert step["plugin/loss_calls"] > 0  # the loss's own metric came back from the worker
    assert step["agent/tool_calls_mean"] > 0 and step["agent/tool_errors"] == 0
    assert step["agent/env_reward_mean"] == 1.0 and step["agent/env_errors"] == 0


def test_dry_run_shows_the_pythonpath_every_actor_gets(tmp_path):
    """The config's plugins are checked when the config is built (the estimator and the loss are
    imported), and every actor's environment carries the user's PYTHONPATH, made absolute, with
    its source."""
    plugins = write_package(tmp_path / "plugins")
    proc = subprocess.run(
        [*command(), "train", "--dry-run", "--json", "rollout.n=2", *PLUGIN_KEYS[:2]],
        cwd=tmp_path, env=user_env(Path("plugins")), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    for env in [plan["job"]["env"], *(actor["env"] for actor in plan["actors"])]:
        assert env["PYTHONPATH"]["value"] == os.pathsep.join([str(plugins), POLYRL_ROOT])
        assert env["PYTHONPATH"]["source"] == "user-env" and "module:name" in env["PYTHONPATH"]["reason"]


@pytest.mark.parametrize("key, field", [
    (f"algorithm.adv_estimator={PACKAGE}.algos:centered", "algorithm.adv_estimator"),
    (f"algorithm.policy_loss={PACKAGE}.algos:marked_ppo", "algorithm.policy_loss"),
])
def test_a_plugin_that_does_not_import_is_one_line_naming_the_key(tmp_path, key, field):
    """Without the package on PYTHONPATH: exit code 2, one line naming the key and the module,
    before Ray starts."""
    proc = subprocess.run([*command(), "train", "--dry-run", key], cwd=tmp_path, env=user_env(None),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"{field}: " in proc.stderr and f"cannot import '{PACKAGE}.algos'" in proc.stderr, proc.stderr


def test_a_plugin_package_in_the_run_directory_reaches_every_actors_pythonpath(tmp_path):
    """The console script, run where the package is (not on PYTHONPATH): the config check finds
    it there, and every actor's PYTHONPATH gets that directory, with the source `plugins`."""
    write_package(tmp_path)
    proc = subprocess.run(
        [*command(), "train", "--dry-run", "--json", "rollout.n=2", *PLUGIN_KEYS[:2]],
        cwd=tmp_path, env=user_env(None), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    for env in [plan["job"]["env"], *(actor["env"] for actor in plan["actors"])]:
        assert env["PYTHONPATH"]["value"] == os.pathsep.join([POLYRL_ROOT, str(tmp_path)])
        assert env["PYTHONPATH"]["source"] == "plugins" and str(tmp_path) in env["PYTHONPATH"]["reason"]
