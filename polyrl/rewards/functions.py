"""Python scoring functions: how one is called (its signature decides which keyword options it
gets), and a batch of calls run on the manager's timeout pool (polyrl/rewards/executor.py)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from polyrl.rewards.executor import TimeoutPool
from polyrl.rewards.outcome import Outcome, read_score
from polyrl.rewards.registry import RewardFn

if TYPE_CHECKING:
    from polyrl.rewards.manager import RewardRequest


@dataclass
class FunctionScorer:
    fn: RewardFn
    kwargs: dict[str, Any]
    pass_eos: bool
    verl_style: bool  # first parameter is data_source
    pass_source: bool


def make_scorer(fn: RewardFn, kwargs: dict[str, Any]) -> FunctionScorer:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins / C functions: call plainly
        return FunctionScorer(fn, kwargs, False, False, False)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = list(params)
    verl_style = bool(names) and names[0] == "data_source"
    return FunctionScorer(
        fn,
        kwargs,
        pass_eos=var_kw or "finished_with_eos" in params,
        verl_style=verl_style,
        pass_source=not verl_style and (var_kw or "data_source" in params),
    )


def call(scorer: FunctionScorer, req: "RewardRequest") -> tuple[float, float, dict[str, float]]:
    """Run one scoring call (in a worker thread) and normalise its result."""
    kwargs = dict(scorer.kwargs)
    if scorer.pass_eos:
        kwargs["finished_with_eos"] = req.finished_with_eos
    if scorer.pass_source:
        kwargs["data_source"] = req.data_source
    args = (req.solution_str, req.ground_truth, req.extra_info)
    if scorer.verl_style:
        args = (req.data_source, *args)
    return read_score(scorer.fn(*args, **kwargs))


def run_calls(pool: TimeoutPool, jobs: Sequence[tuple[FunctionScorer, "RewardRequest"]],
              timeout_s: float) -> list[Outcome]:
    """Every (scorer, request) on the pool; a call past `timeout_s` is abandoned (timed out)."""
    futures = [pool.submit(call, scorer, req) for scorer, req in jobs]
    timed_out = pool.run_all(futures, timeout_s)
    outcomes = []
    for future, late in zip(futures, timed_out):
        if late:
            outcomes.append(Outcome(timed_out=True))
        elif future.exception() is not None:
            outcomes.append(Outcome(error=future.exception()))
        else:
            score, acc, extras = future.result()
            outcomes.append(Outcome(score, acc, extras))
    return outcomes
