"""A user's plugin package, written into a temporary directory by the tests: an advantage
estimator, a policy loss, an environment, a tool and a reward function, each outside polyrl.

Every plugin, when called, appends a line to `$POLYRL_PLUGIN_MARKS/<kind>-<pid>.jsonl` saying
which Ray actor (or none: the driver) it ran in, so a test can tell that it really ran and where.
POLYRL_ variables reach every Ray actor through the environment plan (FORWARDED_PREFIXES).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = "polyrl_user_plugins"

FILES = {
    "__init__.py": '''
import json
import os


def mark(kind):
    actor = None
    try:
        import ray
        if ray.is_initialized():
            actor = ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - outside Ray: the driver or a plain process
        pass
    with open(os.path.join(os.environ["POLYRL_PLUGIN_MARKS"], f"{kind}-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"actor": actor}) + "\\n")
''',
    "algos.py": '''
import torch

from polyrl.algorithms.losses.ppo import ppo_clip_policy_loss
from polyrl_user_plugins import mark


def centered(rewards, group_ids, response_mask, *, norm_adv_by_std, eps):
    """Reward minus the batch mean, on every loss token."""
    mark("estimator")
    return (rewards - rewards.mean())[:, None].to(torch.float32) * response_mask.to(torch.float32)


def marked_ppo(cfg, logprob, old_logprob, advantages, response_mask, **kwargs):
    """PPO's clipped loss, plus a metric that says it ran."""
    mark("loss")
    loss, metrics = ppo_clip_policy_loss(cfg, logprob, old_logprob, advantages, response_mask, **kwargs)
    return loss, {**metrics, "plugin/loss_calls": 1.0}
''',
    "envs.py": '''
from polyrl.agents import Environment, StepResult
from polyrl_user_plugins import mark


class OneStep(Environment):
    """Any answer ends the episode with a fixed reward."""

    def __init__(self, reward=1.0):
        self.reward = reward

    def step(self, action_text):
        mark("environment")
        return StepResult(None, reward=self.reward, done=True)
''',
    "tools.py": '''
from polyrl_user_plugins import mark


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: what to evaluate, e.g. 2+3.
    """
    mark("tool")
    return "5"
''',
    "rewards.py": '''
from polyrl_user_plugins import mark


def score(solution_str, ground_truth, extra_info=None):
    mark("reward")
    return float(str(ground_truth) in solution_str)
''',
}


def write_package(root: Path) -> Path:
    """The package under `root` (a directory to put on PYTHONPATH); returns `root`."""
    package = root / PACKAGE
    package.mkdir(parents=True)
    for name, text in FILES.items():
        (package / name).write_text(text.lstrip())
    return root


def marks(directory: Path) -> dict[str, list[str | None]]:
    """kind -> the actor id of every call (None: outside any actor)."""
    import json

    out: dict[str, list[str | None]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        kind = path.name.split("-")[0]
        out.setdefault(kind, []).extend(json.loads(line)["actor"] for line in path.read_text().splitlines())
    return out
