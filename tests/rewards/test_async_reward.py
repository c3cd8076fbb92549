"""An `async def` reward function (per sample, verl's form, or TRL's batched form) is awaited on
every call through the real RewardManager, instead of being accepted and then failing each call."""

from __future__ import annotations

import textwrap

from polyrl.rewards import RewardConfig, RewardManager, RewardRequest


def test_async_reward_functions_are_awaited(tmp_path):
    path = tmp_path / "async_reward.py"
    path.write_text(textwrap.dedent("""
        import asyncio

        async def per_sample(solution_str, ground_truth, extra_info=None, bonus=0.0):
            await asyncio.sleep(0)  # a real suspension point: the coroutine must be driven
            return float(solution_str.strip() == ground_truth) + bonus

        async def verl_form(data_source, solution_str, ground_truth, extra_info=None):
            await asyncio.sleep(0)
            return {"score": float(solution_str.strip() == ground_truth), "acc": 1.0}

        async def batched(prompts, completions, **columns):
            await asyncio.sleep(0)
            return [float(len(c)) for c in completions]
    """))
    reqs = [RewardRequest("gsm8k", "7", "7", True), RewardRequest("gsm8k", "9", "7", True)]
    for name, kwargs, want in [("per_sample", {"bonus": 0.5}, [1.5, 0.5]), ("verl_form", {}, [1.0, 0.0]),
                               ("batched", {}, [1.0, 1.0])]:
        manager = RewardManager(RewardConfig(custom_function=f"{path}:{name}", custom_function_kwargs=kwargs))
        try:
            assert manager.score(reqs).scores == want, name
        finally:
            manager.close()
