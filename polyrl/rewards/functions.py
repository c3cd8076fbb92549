"""Python scoring functions: how one is called (its signature decides the form and which keyword
options it gets), and a batch of calls run on the manager's timeout pool (polyrl/rewards/executor.py).

Two forms are accepted, told apart by signature (docs/rewards.md):
- per sample, verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` or
  polyrl's `fn(solution_str, ground_truth, extra_info)`: one call per response;
- batched, TRL's `reward_funcs` form `fn(prompts, completions, **columns) -> list[float | None]`
  (any function with a `completions` parameter): one call for all the batch's responses it scores.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from polyrl.config import ConfigError
from polyrl.rewards.executor import TimeoutPool
from polyrl.rewards.outcome import BadScoreError, Outcome, read_score
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
    batched: bool = False
    """TRL's form: fn(prompts, completions, **columns) -> one score (or None) per completion."""
    accepts: frozenset[str] | None = None
    """batched: the keyword arguments fn declares (None: it takes **kwargs, so all of them)."""


ACCEPTED_FORMS = (
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict "
    "(or the same without data_source), called once per response; or TRL's reward function "
    "fn(prompts, completions, **columns) -> list[float | None], called once per batch "
    "(docs/rewards.md)")


def make_scorer(fn: RewardFn, kwargs: dict[str, Any], who: str = "reward function") -> FunctionScorer:
    """How to call `fn`; a ConfigError naming `who` and both accepted forms if it fits neither.
    An `async def` function is awaited to completion on each call (in its pool thread)."""
    if inspect.iscoroutinefunction(fn):
        fn = _awaited(fn)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins / C functions: call plainly
        return FunctionScorer(fn, kwargs, False, False, False)
    params = signature.parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = list(params)
    if "completions" in params:  # TRL names its arguments; nothing else has this one
        return FunctionScorer(fn, kwargs, False, False, False, batched=True,
                              accepts=None if var_kw else frozenset(names))
    verl_style = bool(names) and names[0] == "data_source"
    scorer = FunctionScorer(
        fn,
        kwargs,
        pass_eos=var_kw or "finished_with_eos" in params,
        verl_style=verl_style,
        pass_source=not verl_style and (var_kw or "data_source" in params),
    )
    options = dict(kwargs)
    if scorer.pass_eos:
        options["finished_with_eos"] = True
    if scorer.pass_source:
        options["data_source"] = ""
    args = ("", "", None, None) if verl_style else ("", None, None)
    try:  # the call `call` makes, bound without running: a mismatch is a start-up error
        signature.bind(*args, **options)
    except TypeError as exc:
        raise ConfigError([f"{who}: cannot call {getattr(fn, '__name__', fn)}{signature} ({exc}); "
                           f"accepted forms: {ACCEPTED_FORMS}"]) from None
    return scorer


def _awaited(fn: Any) -> RewardFn:
    """`fn` (async) as a plain function: each call runs the coroutine to its end on an event loop
    of its own. The scoring pool's threads run no loop, so `asyncio.run` may start one there."""
    import asyncio
    import functools

    @functools.wraps(fn)  # inspect.signature follows __wrapped__: the form is still read from fn
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


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


RESERVED = ("prompts", "completions", "ground_truth", "data_source", "extra_info", "finished_with_eos")
"""Keyword arguments of a batched call that a row's extra_info keys never override."""


def batch_arguments(requests: Sequence["RewardRequest"]) -> dict[str, list[Any]]:
    """TRL's arguments for `requests`: prompts and completions (chat messages where the prompt is
    a message list, as TRL's conversational format, else strings) and the rows' other columns
    as one list each: ground_truth (verl's reward_model.ground_truth), data_source, extra_info,
    finished_with_eos, and every key of extra_info (None in rows that lack it)."""
    columns: dict[str, list[Any]] = {
        "prompts": [r.prompt for r in requests],
        "completions": [[{"role": "assistant", "content": r.solution_str}]
                        if isinstance(r.prompt, list) else r.solution_str for r in requests],
        "ground_truth": [r.ground_truth for r in requests],
        "data_source": [r.data_source for r in requests],
        "extra_info": [r.extra_info for r in requests],
        "finished_with_eos": [r.finished_with_eos for r in requests],
    }
    keys = dict.fromkeys(k for r in requests for k in (r.extra_info or {}) if k not in RESERVED)
    for key in keys:
        columns[key] = [(r.extra_info or {}).get(key) for r in requests]
    return columns


def call_batch(scorer: FunctionScorer, requests: Sequence["RewardRequest"]) -> list[Any]:
    """One TRL-style call for `requests` (in a worker thread); its list, checked for length."""
    arguments = {**batch_arguments(requests), **scorer.kwargs}
    if scorer.accepts is not None:
        arguments = {k: v for k, v in arguments.items() if k in scorer.accepts}
    out = scorer.fn(**arguments)
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or len(out) != len(requests):
        got = f"{len(out)} values" if hasattr(out, "__len__") and not isinstance(out, (str, bytes)) \
            else type(out).__name__
        raise BadScoreError(f"reward function returned {got} for {len(requests)} completions; "
                            "expected a list with one float (or None) per completion")
    return list(out)


def read_batch_item(value: Any) -> Outcome:
    """One entry of a TRL-style answer: None is no score (0, counted apart), else a checked score."""
    if value is None:
        return Outcome(no_score=True)
    try:
        score, acc, extras = read_score(value)
    except BadScoreError as exc:
        return Outcome(error=exc)
    return Outcome(score, acc, extras)


def run_calls(pool: TimeoutPool, jobs: Sequence[tuple[FunctionScorer, "RewardRequest"]],
              timeout_s: float) -> list[Outcome]:
    """Every (scorer, request) on the pool; a call past `timeout_s` is abandoned (timed out).

    A batched scorer gets one call for all its requests, with `timeout_s` per request it scores;
    if that call raises or times out, each of its requests counts as failed."""
    per_sample = [i for i, (scorer, _) in enumerate(jobs) if not scorer.batched]
    groups: dict[int, list[int]] = {}
    for i, (scorer, _) in enumerate(jobs):
        if scorer.batched:
            groups.setdefault(id(scorer), []).append(i)
    futures = [pool.submit(call, *jobs[i]) for i in per_sample]
    batch_futures = [pool.submit(call_batch, jobs[idx[0]][0], [jobs[i][1] for i in idx])
                     for idx in groups.values()]
    outcomes: list[Outcome] = [Outcome()] * len(jobs)
    for i, future, late in zip(per_sample, futures, pool.run_all(futures, timeout_s)):
        if late:
            outcomes[i] = Outcome(timed_out=True)
        elif future.exception() is not None:
            outcomes[i] = Outcome(error=future.exception())
        else:
            score, acc, extras = future.result()
            outcomes[i] = Outcome(score, acc, extras)
    for idx, future in zip(groups.values(), batch_futures):
        late = pool.run_all([future], timeout_s * len(idx))[0]
        if late:
            answers = [Outcome(timed_out=True) for _ in idx]
        elif future.exception() is not None:
            answers = [Outcome(error=future.exception()) for _ in idx]
        else:
            answers = [read_batch_item(value) for value in future.result()]
        for i, answer in zip(idx, answers):
            outcomes[i] = answer
    return outcomes
