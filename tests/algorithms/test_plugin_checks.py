"""A plugin estimator or loss that returns the wrong thing is one line naming its config key
(polyrl/algorithms/plugin_checks.py): checked through the calls the trainer and the actor make
(`compute_advantages`, `actor_loss`), signatures at pre-flight, and the line survives Ray."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from polyrl.algorithms import actor_loss, compute_advantages
from polyrl.algorithms.config import AlgorithmConfig
from polyrl.algorithms.plugin_checks import PluginOutputError, check_signatures
from polyrl.config import ConfigError

B, T = 4, 5

ESTIMATORS = {
    "per_sequence": "return rewards.clone()",                           # [B], not [B, T]
    "a_list": "return [[0.0] * response_mask.shape[1]] * len(rewards)",
    "none": "return None",
    "int64": "return torch.zeros(response_mask.shape, dtype=torch.int64)",
    "nan": "return torch.full(response_mask.shape, float('nan'))",
}
LOSSES = {
    "bare_tensor": "return (logprob * advantages).mean()",
    "matrix": "return logprob * advantages, {}",
    "detached": "return (logprob * advantages).mean().detach(), {}",
    "string_metric": "return (logprob * advantages).mean(), {'note': 'hello'}",
    "nan": "return (logprob * advantages).mean() * float('nan'), {}",
    "good": "return -(logprob * advantages).mean(), {'my/metric': torch.tensor(0.5)}",
}


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """A plugin file of bad estimators and losses, named by file path as docs/plugins.md shows."""
    path = tmp_path_factory.mktemp("plugins") / "bad_plugins.py"
    body = ["import torch\n"]
    for name, line in ESTIMATORS.items():
        body.append(f"def est_{name}(rewards, group_ids, response_mask, *, norm_adv_by_std, eps):\n    {line}\n")
    for name, line in LOSSES.items():
        body.append(f"def loss_{name}(cfg, logprob, old_logprob, advantages, response_mask, *, num_tokens=None,"
                    f" num_seqs=None):\n    {line}\n")
    body.append(textwrap.dedent("""
        import threading
        RELEASE = threading.Event()
        def est_hang(rewards, group_ids, response_mask, *, norm_adv_by_std, eps):
            RELEASE.wait()  # never set while the test waits: an estimator that never returns
            return torch.zeros(response_mask.shape)
        def est_two_args(rewards, group_ids):
            return rewards
        async def loss_async(cfg, logprob, old_logprob, advantages, response_mask, **kw):
            return logprob.mean(), {}
    """))
    path.write_text("\n".join(body))
    return path


def inputs():
    torch.manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    return rewards, torch.tensor([0, 0, 1, 1]), torch.ones(B, T)


@pytest.mark.parametrize("name, needle", [
    ("per_sequence", "returned shape [4], not [B, T] = [4, 5]"),
    ("a_list", "returned a list, not a tensor"),
    ("none", "returned None, not a tensor"),
    ("int64", "returned dtype torch.int64"),
    ("nan", "returned 20 non-finite advantages"),
])
def test_bad_estimator_outputs_are_one_line_naming_the_key(plugins, name, needle):
    cfg = AlgorithmConfig(adv_estimator=f"{plugins}:est_{name}")
    with pytest.raises(PluginOutputError) as info:
        compute_advantages(cfg, *inputs())
    (line,) = info.value.problems
    assert line.startswith(f"algorithm.adv_estimator={plugins}:est_{name}: ") and needle in line, line


def test_an_estimator_that_never_returns_is_a_timeout_naming_it(plugins):
    from polyrl.algorithms import ADV_ESTIMATORS

    cfg = AlgorithmConfig(adv_estimator=f"{plugins}:est_hang")
    try:
        with pytest.raises(PluginOutputError, match=r"adv_estimator=.*est_hang: returned nothing within 0.2s"):
            compute_advantages(cfg, *inputs(), timeout_s=0.2)
    finally:  # let the plugin's thread end
        ADV_ESTIMATORS.get(cfg.adv_estimator).__globals__["RELEASE"].set()


def loss_inputs():
    torch.manual_seed(0)
    logprob = torch.randn(B, T, requires_grad=True)
    return logprob, logprob.detach() + 0.01, torch.randn(B, T), torch.ones(B, T)


@pytest.mark.parametrize("name, needle", [
    ("bare_tensor", "not a (loss, metrics) pair"),
    ("matrix", "a loss of shape [4, 5], not a scalar"),
    ("detached", "without gradient"),
    ("string_metric", "metric 'note' = a str"),
    ("nan", "nan loss from finite log-probs"),
])
def test_bad_loss_outputs_are_one_line_naming_the_key(plugins, name, needle):
    cfg = AlgorithmConfig(policy_loss=f"{plugins}:loss_{name}")
    with pytest.raises(PluginOutputError) as info:
        actor_loss(cfg, *loss_inputs())
    (line,) = info.value.problems
    assert line.startswith(f"algorithm.policy_loss={plugins}:loss_{name}: ") and needle in line, line


def test_a_good_plugin_loss_passes_and_a_nan_from_nan_inputs_is_not_blamed_on_it(plugins):
    cfg = AlgorithmConfig(policy_loss=f"{plugins}:loss_good")
    loss, metrics = actor_loss(cfg, *loss_inputs())
    assert loss.requires_grad and loss.dim() == 0 and metrics["my/metric"] == 0.5
    logprob, old, adv, mask = loss_inputs()
    adv = adv.clone()
    adv[0, 0] = math.nan  # non-finite input: the update's own non-finite handling, not the plugin's fault
    loss, _ = actor_loss(AlgorithmConfig(policy_loss=f"{plugins}:loss_nan"), logprob, old, adv, mask)
    assert math.isnan(loss.item())


def test_signatures_and_async_plugins_are_refused_at_pre_flight(plugins):
    check_signatures(AlgorithmConfig())  # the built-ins
    with pytest.raises(PluginOutputError, match=r"^invalid config:\n  algorithm.adv_estimator=.*cannot take"):
        check_signatures(AlgorithmConfig(adv_estimator=f"{plugins}:est_two_args"))
    with pytest.raises(PluginOutputError, match="algorithm.policy_loss=.*async function"):
        check_signatures(AlgorithmConfig(policy_loss=f"{plugins}:loss_async"))


def test_the_line_survives_a_ray_actor(ray_session, plugins):
    """Raised in a rank (the loss runs there), it reaches the CLI as the ConfigError it is."""
    import ray

    from polyrl.api import unwrapped

    @ray.remote
    def rank_update(path):  # only polyrl names inside: a Ray worker cannot import this test module
        import torch

        from polyrl.algorithms import actor_loss
        from polyrl.algorithms.config import AlgorithmConfig

        logprob = torch.zeros(2, 3, requires_grad=True)
        return actor_loss(AlgorithmConfig(policy_loss=f"{path}:loss_matrix"), logprob, logprob.detach(),
                          torch.ones(2, 3), torch.ones(2, 3))

    with pytest.raises(Exception) as info:
        ray.get(rank_update.remote(plugins))
    error = unwrapped(info.value)
    assert isinstance(error, ConfigError) and error.problems[0].startswith("algorithm.policy_loss=")
