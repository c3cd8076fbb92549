"""What an advantage estimator or a policy loss (built in or a plugin, docs/plugins.md) must take
and return, checked where polyrl calls it, so a plugin's mistake is one line naming its config
key instead of a traceback from deep inside polyrl, or a NaN that silently trains nothing.

- signatures, at pre-flight (`check_signatures`): the call polyrl makes must bind, and the
  function must not be `async def` (polyrl calls it synchronously);
- outputs, at every call (`checked_advantages`, `checked_loss`): types, shapes and dtypes, and
  a non-finite output from finite inputs. Non-finite *inputs* are not the plugin's fault: they are
  left to the update's own non-finite handling (actor.max_nonfinite_steps).
"""

from __future__ import annotations

import inspect
import math
from numbers import Real
from typing import Any, Callable

import torch

from polyrl.config import ConfigError

ESTIMATOR_CONTRACT = ("an advantage estimator is fn(rewards [B], group_ids [B], response_mask [B, T], *, "
                      "norm_adv_by_std, eps) -> float tensor [B, T] (docs/plugins.md)")
LOSS_CONTRACT = ("a policy loss is fn(cfg, logprob, old_logprob, advantages, response_mask, *, num_tokens, "
                 "num_seqs) -> (scalar loss tensor with grad, dict of float metrics) (docs/plugins.md)")


class PluginOutputError(ConfigError):
    """A plugin (or built-in) estimator or loss returned what polyrl cannot use; one line."""

    def __init__(self, key: str, name: str, problem: str, contract: str):
        super().__init__([f"{key}={name}: {problem}; {contract}"])
        self.parts = (key, name, problem, contract)

    def __reduce__(self):  # raised in a Ray rank: rebuilt on the driver from its parts, not its message
        return (type(self), self.parts)


def check_signatures(cfg: Any) -> None:
    """The estimator and the loss `cfg` (an AlgorithmConfig) names take the call polyrl makes."""
    from polyrl.algorithms.config import VALUE_ESTIMATORS

    if cfg.adv_estimator not in VALUE_ESTIMATORS:
        from polyrl.algorithms.advantages import ADV_ESTIMATORS

        _check_binds("algorithm.adv_estimator", cfg.adv_estimator, ADV_ESTIMATORS.get(cfg.adv_estimator),
                     ESTIMATOR_CONTRACT, 3, ("norm_adv_by_std", "eps"))
    from polyrl.algorithms.losses import POLICY_LOSSES

    _check_binds("algorithm.policy_loss", cfg.policy_loss, POLICY_LOSSES.get(cfg.policy_loss),
                 LOSS_CONTRACT, 5, ("num_tokens", "num_seqs"))


def _check_binds(key: str, name: str, fn: Callable, contract: str, positional: int,
                 keywords: tuple[str, ...]) -> None:
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise PluginOutputError(key, name, "is an async function, which polyrl cannot await here; "
                                "make it a plain def", contract)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(*range(positional), **{k: None for k in keywords})
    except TypeError as exc:
        raise PluginOutputError(key, name, f"cannot take polyrl's call ({exc})", contract) from None


def call_with_deadline(call: Callable[[], Any], timeout_s: float, key: str, name: str, contract: str) -> Any:
    """`call()` in a thread of its own, waited on for `timeout_s`: a plugin that never returns is
    one line naming its key instead of a driver that hangs. The wait is in the calling thread,
    so a signal's handler runs during it (a second SIGTERM or Ctrl-C abandons the step); the
    stuck thread is a daemon, so it does not keep the process alive."""
    import threading

    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # re-raised in the caller's thread, traceback and all
            result["error"] = exc

    thread = threading.Thread(target=run, name=f"polyrl {key}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PluginOutputError(key, name, f"returned nothing within {timeout_s:g}s (still running: a loop "
                                "that never ends, or a wait on something that never comes?)", contract)
    if "error" in result:
        raise result["error"]
    return result["value"]


def checked_advantages(name: str, adv: Any, rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """`adv` as float32 [B, T] if it is a usable estimator output, else PluginOutputError."""
    key, shape = "algorithm.adv_estimator", list(response_mask.shape)
    if not isinstance(adv, torch.Tensor):
        raise PluginOutputError(key, name, f"returned {_what(adv)}, not a tensor", ESTIMATOR_CONTRACT)
    if list(adv.shape) != shape:
        raise PluginOutputError(key, name, f"returned shape {list(adv.shape)}, not [B, T] = {shape}",
                                ESTIMATOR_CONTRACT)
    if not adv.is_floating_point():
        raise PluginOutputError(key, name, f"returned dtype {adv.dtype}, not a float dtype", ESTIMATOR_CONTRACT)
    mask = response_mask.bool()
    if torch.isfinite(rewards).all() and not torch.isfinite(adv[mask]).all():
        bad = int((~torch.isfinite(adv[mask])).sum())
        raise PluginOutputError(key, name, f"returned {bad} non-finite advantages (NaN or inf) from finite "
                                "rewards", ESTIMATOR_CONTRACT)
    return adv.float()


def checked_loss(name: str, out: Any, logprob: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                 response_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """(scalar loss, float metrics) if `out` is a usable policy-loss output, else PluginOutputError.
    `inputs`: the loss's tensor inputs, to tell a NaN the loss made from one it was given."""
    key = "algorithm.policy_loss"
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PluginOutputError(key, name, f"returned {_what(out)}, not a (loss, metrics) pair", LOSS_CONTRACT)
    loss, metrics = out
    if not isinstance(loss, torch.Tensor):
        raise PluginOutputError(key, name, f"returned a loss that is {_what(loss)}, not a tensor", LOSS_CONTRACT)
    if loss.numel() != 1:
        raise PluginOutputError(key, name, f"returned a loss of shape {list(loss.shape)}, not a scalar (reduce "
                                "it, e.g. with polyrl.algorithms.aggregate)", LOSS_CONTRACT)
    if not loss.is_floating_point():
        raise PluginOutputError(key, name, f"returned a loss of dtype {loss.dtype}", LOSS_CONTRACT)
    if logprob.requires_grad and not loss.requires_grad:
        raise PluginOutputError(key, name, "returned a loss without gradient (detached, or not computed from "
                                "logprob), so the update would change nothing", LOSS_CONTRACT)
    if not isinstance(metrics, dict):
        raise PluginOutputError(key, name, f"returned metrics that are {_what(metrics)}, not a dict",
                                LOSS_CONTRACT)
    floats = {}
    for metric, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, Real):  # numbers (bools and numpy scalars too) become floats
            raise PluginOutputError(key, name, f"returned metric {metric!r} = {_what(value)}, not a number",
                                    LOSS_CONTRACT)
        floats[str(metric)] = float(value)
    loss = loss.reshape(())
    if not math.isfinite(loss.item()):
        mask = response_mask.bool()
        if all(torch.isfinite(t.detach()[mask]).all() for t in (logprob, *inputs) if t.shape == mask.shape):
            raise PluginOutputError(key, name, f"returned a {loss.item()} loss from finite log-probs and "
                                    "advantages", LOSS_CONTRACT)
    return loss, floats


def _what(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, str):
        return f"a str ({value[:40]!r})"
    return f"a {type(value).__name__}"
