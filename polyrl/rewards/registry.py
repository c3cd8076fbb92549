"""Reward functions keyed by `data_source`, and loading of user functions from config.

Contract of a reward function:
    fn(solution_str: str, ground_truth, extra_info: dict | None, **options) -> float | dict
where a dict holds "score" (required) and optionally "acc" plus other numbers. Keyword options
the RewardManager passes when the function accepts them: `finished_with_eos` (did the response
end with the EOS token) and `data_source`. A verl-style fn(data_source, solution_str,
ground_truth, extra_info) is recognised by its first parameter's name.

A package scores a data source of its own by registering the function in the `polyrl.rewards`
entry-point group under the data_source (`"my/dataset" = "mypkg.scoring:score"`); a config names
one by import path in reward.custom_function (docs/plugins.md). Either is resolved where the
scorer runs.
"""

from __future__ import annotations

from typing import Any, Callable

from polyrl.config.targets import is_file_target
from polyrl.registry import PluginLoadError, Registry, defined_callables, load_plugin

RewardFn = Callable[..., "float | dict[str, Any]"]

ENTRY_POINT_GROUP = "polyrl.rewards"
REWARD_FNS: Registry[RewardFn] = Registry("reward data_source", entry_point_group=ENTRY_POINT_GROUP)
REWARD_FNS.register("arithmetic", "polyrl.rewards.arithmetic:arithmetic_score")
REWARD_FNS.register("shapes", "polyrl.rewards.shapes:shapes_score")
REWARD_FNS.register("reasoning_gym", "polyrl.rewards.reasoning_gym:reasoning_gym_score")
for _source in ("openai/gsm8k", "gsm8k"):
    REWARD_FNS.register(_source, "polyrl.rewards.gsm8k:gsm8k_score")
for _source in (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
    "hiyouga/geometry3k",  # verl's Geometry3K preprocessing: a \boxed{} answer (docs/vision.md)
):
    REWARD_FNS.register(_source, "polyrl.rewards.math_boxed:math_score")


class UnknownDataSourceError(ValueError):
    """No reward function is registered or configured for a data_source."""

    def __init__(self, data_source: str):
        self.data_source = data_source
        super().__init__(
            f"no reward function for data_source '{data_source}'; registered data sources: "
            f"{', '.join(REWARD_FNS.names())}. To score it, set "
            "reward.custom_function=my_pkg.my_module:my_fn (or /path/to/file.py:my_fn), "
            f"optionally with reward.custom_function_sources=['{data_source}'], or call "
            f"polyrl.rewards.REWARD_FNS.register('{data_source}', my_fn)"
        )


def load_function(spec: str) -> RewardFn:
    """Load "pkg.module:fn" or "/path/to/file.py:fn"; errors name reward.custom_function."""
    target, _, name = spec.rpartition(":")  # rpartition: a Windows path may hold "C:"
    if not target or not name:
        raise ValueError(f"reward.custom_function '{spec}' must look like module:function")
    try:
        return load_plugin(spec, "polyrl_user_reward_", callable_only=True)
    except PluginLoadError as exc:
        if exc.stage == "file":
            raise ValueError(f"reward.custom_function: file {exc.cause} does not exist") from None
        if exc.stage == "import":
            if is_file_target(target):
                raise exc.cause from None  # type: ignore[misc]
            raise ValueError(f"reward.custom_function: cannot import module '{target}': {exc.cause}") from exc.cause
        if exc.stage == "raised":
            raise exc.cause from None  # type: ignore[misc]  # the user's module failed: its own error
        raise ValueError(f"reward.custom_function: '{target}' has no function '{name}'; "
                         f"functions there: {', '.join(defined_callables(exc.module)) or '(none)'}") from None
