"""Each plugin kind by import path and by entry point, in this process (docs/plugins.md): the
registries polyrl's config keys resolve through (advantage estimators, policy losses,
environments, tools, rewards, platforms) take "package.module:name", "/path/to/file.py:name" and
the names a package registers in the kind's entry-point group; a bad one is one line that lists
the valid choices."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from polyrl.registry import Registry, RegistryError, import_module

PLUGIN = '''
import torch

from polyrl.agents import Environment, StepResult
from polyrl.platform.platforms import CPUPlatform


class ToyPlatform(CPUPlatform):
    """The CPU platform under another name: what a vendor's package would subclass."""
    name = "toyplat"


def toy_adv(rewards, group_ids, response_mask, *, norm_adv_by_std, eps):
    return torch.full(response_mask.shape, 7.0) * response_mask


def toy_loss(cfg, logprob, old_logprob, advantages, response_mask, **kwargs):
    return (logprob * 0).sum() + 3.0, {"toy/loss": 3.0}


class ToyEnv(Environment):
    def step(self, action_text):
        return StepResult("seen " + action_text, reward=2.0, done=True)


class ToyGame(Environment):
    """Starts its own episode (the row carries no prompt) and ends it at the first answer."""

    def __init__(self, reward=1.0):
        self.reward = reward

    def reset(self, row):
        return [{"role": "user", "content": "40+2="}]

    def step(self, action_text):
        return StepResult(None, reward=self.reward, done=True)


def toy_tool(text: str) -> str:
    """Echo the text.

    Args:
        text: what to echo.
    """
    return text


def toy_score(solution_str, ground_truth, extra_info=None):
    return 0.25
'''

ENTRY_POINTS = {
    "polyrl.platforms": "toyplat = toy_plugins:ToyPlatform",
    "polyrl.advantage_estimators": "toy_adv = toy_plugins:toy_adv",
    "polyrl.policy_losses": "toy_loss = toy_plugins:toy_loss",
    "polyrl.environments": "toy_env = toy_plugins:ToyEnv",
    "polyrl.tools": "toy_tool = toy_plugins:toy_tool",
    "polyrl.rewards": "toy_source = toy_plugins:toy_score",
}


def registries():
    from polyrl.agents.environments import ENVIRONMENTS
    from polyrl.agents.tools import TOOLS
    from polyrl.algorithms.advantages import ADV_ESTIMATORS
    from polyrl.algorithms.losses import POLICY_LOSSES
    from polyrl.platform import PLATFORMS
    from polyrl.rewards import REWARD_FNS

    return {"polyrl.platforms": PLATFORMS, "polyrl.advantage_estimators": ADV_ESTIMATORS,
            "polyrl.policy_losses": POLICY_LOSSES, "polyrl.environments": ENVIRONMENTS,
            "polyrl.tools": TOOLS, "polyrl.rewards": REWARD_FNS}


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """toy_plugins.py on sys.path, and a dist-info declaring it in every group, as `pip install`
    of a plugin package leaves them; every registry forgets its entry points for the test."""
    (tmp_path / "toy_plugins.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "toy_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n{line}\n\n" for g, line in ENTRY_POINTS.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    for group, registry in registries().items():
        assert registry.entry_point_group == group
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
        monkeypatch.setattr(registry, "_plugins", {})
        monkeypatch.setattr(registry, "_entry_points_loaded", False)
    yield tmp_path
    sys.modules.pop("toy_plugins", None)


def test_every_group_registers_its_entry_point(plugin_dir):
    found = {group: registry.names() for group, registry in registries().items()}
    for group, line in ENTRY_POINTS.items():
        assert line.split(" = ")[0] in found[group], (group, found[group])


def test_estimator_and_loss_by_entry_point_and_by_import_path(plugin_dir):
    from polyrl.algorithms import AlgorithmConfig, actor_loss, compute_advantages

    mask = torch.ones(2, 3)
    for adv, loss in (("toy_adv", "toy_loss"), ("toy_plugins:toy_adv", "toy_plugins:toy_loss"),
                      (f"{plugin_dir / 'toy_plugins.py'}:toy_adv", f"{plugin_dir / 'toy_plugins.py'}:toy_loss")):
        cfg = AlgorithmConfig(adv_estimator=adv, policy_loss=loss)
        out = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
        assert torch.equal(out.advantages, torch.full((2, 3), 7.0))
        value, metrics = actor_loss(cfg, torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3),
                                    out.advantages, mask)
        assert value.item() == 3.0 and metrics["toy/loss"] == 3.0


def test_environment_tool_and_reward_by_entry_point(plugin_dir):
    from polyrl.agents import AgentConfig
    from polyrl.agents.environments import ENVIRONMENTS
    from polyrl.agents.preflight import check_agent
    from polyrl.agents.tools import load_tools
    from polyrl.rewards import REWARD_FNS

    check_agent(AgentConfig(environment="toy_env", tools=["toy_tool"]))
    check_agent(AgentConfig(environment="toy_plugins:ToyEnv"))
    assert ENVIRONMENTS.get("toy_env")().step("x").observation == "seen x"
    assert load_tools(["toy_tool"])["toy_tool"](text="hi") == "hi"
    assert REWARD_FNS.get("toy_source")("a", "b") == 0.25


def test_the_runner_builds_an_environment_named_by_import_path(plugin_dir):
    """What a rollout worker does with agent.environment=module:Class: imports it, builds one per
    trajectory with agent.environment_kwargs, and trains on its reward (real engine)."""
    from polyrl.agents import AgentConfig, run_trajectories_sync
    from polyrl.builtin import resolve
    from polyrl.data import PromptSample
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.training.model_loading import load_tokenizer

    engine = NativeEngine(resolve("builtin:tiny-arith"))
    tokenizer = load_tokenizer("builtin:tiny-arith")
    cfg = AgentConfig(environment="toy_plugins:ToyGame", environment_kwargs={"reward": 0.5},
                      max_turns=2, max_response_tokens=16)
    rows = [PromptSample(0, "game", [], "", "", "42", {})]
    rollout = run_trajectories_sync(engine, tokenizer, rows, SamplingParams(n=2, max_tokens=4, seed=0), cfg)
    assert rollout.env_rewards.tolist() == [0.5, 0.5]
    assert rollout.metrics()["agent/env_errors"] == 0


def test_platform_by_entry_point_and_by_import_path(plugin_dir):
    from polyrl.platform import SIMULATED_PROBES, get_platform

    for name in ("toyplat", "toy_plugins:ToyPlatform", f"{plugin_dir / 'toy_plugins.py'}:ToyPlatform"):
        platform = get_platform(name, SIMULATED_PROBES["cpu"])
        assert type(platform).__name__ == "ToyPlatform" and platform.name == "toyplat"


def test_a_platform_that_is_not_a_platform_class_is_refused(plugin_dir):
    from polyrl.platform import SIMULATED_PROBES, PlatformError, get_platform

    with pytest.raises(PlatformError, match="names <function toy_tool.*not a subclass of polyrl.platform.Platform"):
        get_platform("toy_plugins:toy_tool", SIMULATED_PROBES["cpu"])
    with pytest.raises(PlatformError, match="unknown platform 'toyplatt'; registered platforms: cpu, cuda, rocm, "
                                            "npu, (.*, )?toyplat, or package.module:name"):
        get_platform("toyplatt", SIMULATED_PROBES["cpu"])


@pytest.mark.parametrize("key, value, message", [
    ("adv_estimator", "toy_plugins:nothing", "'toy_plugins' has no 'nothing'; defined there: ToyPlatform, toy_adv"),
    ("policy_loss", "no_such_pkg.mod:fn", "cannot import 'no_such_pkg.mod': No module named 'no_such_pkg'"),
    ("adv_estimator", "toy_plugins:ToyPlatform.name", "is not one of grpo, rloo, reinforce_pp, toy_adv, gae"),
])
def test_a_bad_plugin_key_is_one_line_naming_the_field(plugin_dir, key, value, message):
    from polyrl.algorithms import AlgorithmConfig
    from polyrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(AlgorithmConfig, overrides=[f"{key}={value}"])
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith(f"{key}: ") and message in err.value.problems[0], err.value.problems


def test_an_environment_that_does_not_load_is_one_line(plugin_dir):
    from polyrl.agents import AgentConfig
    from polyrl.agents.preflight import check_agent
    from polyrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"agent.environment=toy_plugins:Missing is not loadable: agent "
                                          r"environment 'toy_plugins:Missing': 'toy_plugins' has no 'Missing'"):
        check_agent(AgentConfig(environment="toy_plugins:Missing"))
    with pytest.raises(ConfigError, match=r"agent.environment=toy_envv is not a registered environment; "
                                          r"registered: tools, (.*, )?toy_env, or package.module:name"):
        check_agent(AgentConfig(environment="toy_envv"))


def test_a_registry_without_import_paths_does_not_import_them():
    registry = Registry("thing")
    registry.register("a", 1)
    with pytest.raises(RegistryError, match="unknown thing 'os.path:join'; valid choices: a$"):
        registry.get("os.path:join")


def test_a_package_in_the_run_directory_is_found_last(tmp_path, monkeypatch):
    """`polyrl train` as a console script has its bin directory on sys.path, not the directory it
    runs in; a plugin package there is still found, after everything installed."""
    (tmp_path / "rundir_plugin_pkg.py").write_text("VALUE = 11\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), os.getcwd())])
    before = list(sys.path)
    with pytest.raises(ModuleNotFoundError):
        import_module("rundir_plugin_missing")
    assert sys.path == before  # a miss leaves the path as it was
    try:
        assert import_module("rundir_plugin_pkg").VALUE == 11
        assert sys.path == [*before, str(tmp_path)]  # appended: it shadows nothing installed
    finally:
        sys.modules.pop("rundir_plugin_pkg", None)


def test_config_modules_import_only_config_machinery():
    """algorithms/config.py and agents/config.py are leaves (docs/architecture.md, "Layers"):
    at module level they import polyrl.config and other config modules only."""
    import ast

    import polyrl

    root = Path(polyrl.__file__).parent
    for path in (root / "algorithms" / "config.py", root / "agents" / "config.py",
                 root / "algorithms" / "off_policy_config.py", root / "algorithms" / "overlong_config.py"):
        imported = [n.module for n in ast.parse(path.read_text()).body
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("polyrl")]
        wrong = [m for m in imported if not (m == "polyrl.config" or m.startswith("polyrl.config.")
                                             or m.endswith(".config") or m.endswith("_config"))]
        assert not wrong, (path.name, wrong)


def test_log_ratio_clamp_is_defined_once():
    import polyrl

    root = Path(polyrl.__file__).parent
    defining = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
                if "LOG_RATIO_CLAMP = " in p.read_text()]
    assert defining == ["algorithms/losses/ratio.py"]


def test_an_entry_point_whose_module_does_not_import_is_one_line(plugin_dir):
    """A plugin package installed without one of its dependencies: the key's check says so in
    one line instead of a traceback out of the config's validation."""
    from polyrl.agents import AgentConfig
    from polyrl.agents.preflight import check_agent
    from polyrl.algorithms import AlgorithmConfig
    from polyrl.config import ConfigError, load_config

    (plugin_dir / "toy_plugins.py").write_text("import toy_missing_dependency\n")
    sys.modules.pop("toy_plugins", None)
    with pytest.raises(ConfigError) as err:
        load_config(AlgorithmConfig, overrides=["adv_estimator=toy_adv"])
    assert err.value.problems == ["adv_estimator: advantage estimator 'toy_adv': loading it raised "
                                  "ModuleNotFoundError: No module named 'toy_missing_dependency'"]
    with pytest.raises(ConfigError, match="agent.environment=toy_env is not loadable: importing it raised "
                                          "ModuleNotFoundError: No module named 'toy_missing_dependency'"):
        check_agent(AgentConfig(environment="toy_env"))
