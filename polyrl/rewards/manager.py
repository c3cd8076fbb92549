"""`RewardManager`: score a batch of responses, one reward function per data_source.

A reward function that raises, returns garbage or runs past `reward.timeout_s` scores 0 for that
sample and is counted (`reward/errors`, `reward/timeouts`), so one bad verifier input cannot stop
training; the first traceback per data source is logged so the bug is still visible. A function
that fails on most calls is another matter - nothing is learned - so once the failed share passes
`reward.warn_error_rate` the run says so, and `error_summary()` gives the totals for summary.json.
Rows whose ground truth is null are scored as usual but counted (`reward/null_ground_truth`).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from polyrl.rewards.config import RewardConfig
from polyrl.rewards.executor import TimeoutPool
from polyrl.rewards.gsm8k import gsm8k_score
from polyrl.rewards.registry import REWARD_FNS, RewardFn, UnknownDataSourceError, load_function

logger = logging.getLogger(__name__)


@dataclass
class RewardRequest:
    data_source: str
    solution_str: str
    """The decoded response, without special tokens."""
    ground_truth: Any
    finished_with_eos: bool
    """True only if generation stopped on the EOS token (not on max_tokens, not padding).
    Required, so no caller can forget it: scorers such as arithmetic give 0 without it."""
    extra_info: dict | None = None


def ended_with_eos(token_ids: Sequence[int], eos_token_ids: Iterable[int]) -> bool:
    """Whether a generated sequence stopped on an EOS token (not on a length limit)."""
    return len(token_ids) > 0 and token_ids[-1] in set(eos_token_ids)


@dataclass
class RewardBatchResult:
    scores: list[float]
    accs: list[float]
    failed: list[bool]
    """True where the call raised or timed out (its score is 0)."""
    extras: list[dict[str, float]] = field(default_factory=list)
    """Other numeric keys a function returned in its dict, per sample."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Scorer:
    fn: RewardFn
    kwargs: dict[str, Any]
    pass_eos: bool
    verl_style: bool  # first parameter is data_source
    pass_source: bool


def _make_scorer(fn: RewardFn, kwargs: dict[str, Any]) -> _Scorer:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins / C functions: call plainly
        return _Scorer(fn, kwargs, False, False, False)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = list(params)
    verl_style = bool(names) and names[0] == "data_source"
    return _Scorer(
        fn,
        kwargs,
        pass_eos=var_kw or "finished_with_eos" in params,
        verl_style=verl_style,
        pass_source=not verl_style and (var_kw or "data_source" in params),
    )


def _call(scorer: _Scorer, req: RewardRequest) -> tuple[float, float, dict[str, float]]:
    """Run one scoring call (in a worker thread) and normalise its result."""
    kwargs = dict(scorer.kwargs)
    if scorer.pass_eos:
        kwargs["finished_with_eos"] = req.finished_with_eos
    if scorer.pass_source:
        kwargs["data_source"] = req.data_source
    args = (req.solution_str, req.ground_truth, req.extra_info)
    if scorer.verl_style:
        args = (req.data_source, *args)
    out = scorer.fn(*args, **kwargs)
    extras: dict[str, float] = {}
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"reward function returned a dict without 'score': {sorted(out)}")
        score = float(out["score"])
        acc = float(out.get("acc", score > 0))
        extras = {
            k: float(v) for k, v in out.items()
            if k not in ("score", "acc") and isinstance(v, (int, float, bool))
        }
    elif isinstance(out, (int, float)):
        score, acc = float(out), float(out > 0)
    else:
        raise TypeError(f"reward function returned {type(out).__name__}; expected float or dict")
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score, acc, extras


class RewardManager:
    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self._custom: _Scorer | None = None
        if self.cfg.custom_function:
            fn = load_function(self.cfg.custom_function)
            self._custom = _make_scorer(fn, dict(self.cfg.custom_function_kwargs))
        self._scorers: dict[str, _Scorer] = {}
        self._pool: TimeoutPool | None = None  # threads start on first use, not at construction
        self._logged_sources: set[str] = set()
        self.total_calls = 0
        self.total_errors = 0
        self.total_timeouts = 0
        self.total_null_ground_truth = 0
        self.first_error: str | None = None
        self._warned_rate = False

    def scorer_for(self, data_source: str) -> _Scorer:
        """The scorer for `data_source`; raises UnknownDataSourceError if there is none."""
        scorer = self._scorers.get(data_source)
        if scorer is not None:
            return scorer
        sources = self.cfg.custom_function_sources
        if self._custom is not None and (sources is None or data_source in sources):
            scorer = self._custom
        elif data_source in REWARD_FNS:
            fn = REWARD_FNS.get(data_source)
            options = {"method": self.cfg.gsm8k_method} if fn is gsm8k_score else {}
            scorer = _make_scorer(fn, options)
        else:
            raise UnknownDataSourceError(data_source)
        self._scorers[data_source] = scorer
        return scorer

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Fail at start, not mid-run, if a dataset holds a data_source nobody can score."""
        for source in sorted(set(data_sources)):
            self.scorer_for(source)

    def score(self, requests: Sequence[RewardRequest]) -> RewardBatchResult:
        scorers = [self.scorer_for(r.data_source) for r in requests]  # unknown source: raise now
        if self._pool is None:
            self._pool = TimeoutPool(self.cfg.num_workers)
        futures = [self._pool.submit(_call, s, r) for s, r in zip(scorers, requests)]
        timed_out = self._pool.run_all(futures, self.cfg.timeout_s)

        n = len(requests)
        scores, accs, failed = [0.0] * n, [0.0] * n, [False] * n
        extras: list[dict[str, float]] = [{} for _ in range(n)]
        errors = timeouts = 0
        for i, (future, req) in enumerate(zip(futures, requests)):
            if timed_out[i]:
                timeouts += 1
                failed[i] = True
                continue
            exc = future.exception()
            if exc is not None:
                errors += 1
                failed[i] = True
                if self.first_error is None:
                    self.first_error = f"data_source '{req.data_source}': {type(exc).__name__}: {exc}"
                if req.data_source not in self._logged_sources:
                    self._logged_sources.add(req.data_source)
                    logger.error(
                        "reward function for data_source '%s' raised; the sample scores 0 "
                        "(later errors are only counted in reward/errors)",
                        req.data_source,
                        exc_info=exc,
                    )
                continue
            scores[i], accs[i], extras[i] = future.result()
        if timeouts:
            logger.warning(
                "%d reward call(s) exceeded reward.timeout_s=%s and scored 0",
                timeouts, self.cfg.timeout_s,
            )
        null_truth = sum(r.ground_truth is None for r in requests)
        self._count(n, errors, timeouts, null_truth)
        metrics = self._metrics(requests, scores, accs, errors, timeouts)
        metrics["reward/null_ground_truth"] = float(null_truth)
        return RewardBatchResult(scores, accs, failed, extras, metrics)

    def _count(self, calls: int, errors: int, timeouts: int, null_truth: int) -> None:
        self.total_calls += calls
        self.total_errors += errors
        self.total_timeouts += timeouts
        self.total_null_ground_truth += null_truth
        rate = self.error_rate
        if not self._warned_rate and rate >= self.cfg.warn_error_rate:
            self._warned_rate = True
            logger.warning(
                "%.0f%% of reward calls so far failed (%d errors, %d timeouts of %d) and scored 0: "
                "the policy learns little or nothing. First error: %s. Fix the reward function "
                "(warning threshold: reward.warn_error_rate=%s)",
                100 * rate, self.total_errors, self.total_timeouts, self.total_calls,
                self.first_error or "(timeouts only)", self.cfg.warn_error_rate,
            )

    @property
    def error_rate(self) -> float:
        """Share of all scoring calls so far that raised or timed out."""
        return (self.total_errors + self.total_timeouts) / self.total_calls if self.total_calls else 0.0

    def error_summary(self) -> dict[str, Any]:
        """The run's scoring failures, for summary.json: counts, rate, the first error, and
        whether the rate passed reward.warn_error_rate."""
        return {
            "calls": self.total_calls,
            "errors": self.total_errors,
            "timeouts": self.total_timeouts,
            "error_rate": self.error_rate,
            "null_ground_truth": self.total_null_ground_truth,
            "first_error": self.first_error,
            "over_warn_rate": self.error_rate >= self.cfg.warn_error_rate and self.total_calls > 0,
        }

    @staticmethod
    def _metrics(requests, scores, accs, errors, timeouts) -> dict[str, float]:
        n = max(len(scores), 1)
        metrics = {
            "reward/score_mean": sum(scores) / n,
            "reward/acc_mean": sum(accs) / n,
            "reward/errors": float(errors),
            "reward/timeouts": float(timeouts),
        }
        by_source: dict[str, list[float]] = defaultdict(list)
        for req, acc in zip(requests, accs):
            by_source[req.data_source].append(acc)
        if len(by_source) > 1:
            for source, values in by_source.items():
                metrics[f"reward/acc/{source}"] = sum(values) / len(values)
        return metrics

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
