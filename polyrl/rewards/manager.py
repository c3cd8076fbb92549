"""`RewardManager`: score a batch of responses; per data_source a function, a reward model, a
remote verifier, an LLM judge (polyrl/rewards/judge.py), or a weighted sum of those (routing: polyrl/rewards/routing.py).

Every term of a batch starts before any is awaited: endpoint requests and the reward worker's
batch run while the function pool works. A scorer that raises, returns garbage or runs past `reward.timeout_s` scores 0 for that
sample and is counted (`reward/errors`, `reward/timeouts`), so one bad verifier input cannot stop
training; the first traceback per data source is logged so the bug is still visible. A function
that fails on most calls is another matter - nothing is learned - so once the failed share passes
`reward.warn_error_rate` the run says so, and `error_summary()` gives the totals for summary.json.
Rows whose ground truth is null are scored as usual but counted (`reward/null_ground_truth`).
A batched (TRL-style) function's None answers score 0 without failing (`reward/no_score`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from polyrl.rewards.config import RewardConfig
from polyrl.rewards.executor import TimeoutPool
from polyrl.rewards.functions import run_calls
from polyrl.rewards.outcome import Outcome
from polyrl.rewards.routing import Router, Term

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
    prompt: str | list[dict[str, Any]] | None = None
    """The prompt as stored in the data row (messages or a string); a reward model reads it
    with the response. Functions and endpoints do not get it (verl's compute_score does not)."""


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
    """Other numeric keys a scorer returned in its dict, per sample (first term's wins)."""
    metrics: dict[str, float] = field(default_factory=dict)


class RewardManager:
    def __init__(self, cfg: RewardConfig | None = None, platform_name: str | None = None):
        self.cfg = cfg or RewardConfig()
        self.router = Router(self.cfg)
        self.http = self.model = self.judge = None
        if self.cfg.judge is not None:
            from polyrl.rewards.judge import JudgeScorer

            self.judge = JudgeScorer(self.cfg.judge)
            if self.cfg.judge.check_at_start:  # before Ray starts: one line (JudgeUnreachableError)
                self.judge.check_reachable()
        if self.cfg.http is not None:
            from polyrl.rewards.http import HttpScorer

            self.http = HttpScorer(self.cfg.http)
        if self.cfg.model is not None:
            from polyrl.rewards.reward_model import ModelScorer

            self.model = ModelScorer(self.cfg.model, platform_name)
        self._pool: TimeoutPool | None = None  # threads start on first use, not at construction
        self._logged: set[tuple[str, str]] = set()
        self.total_calls = 0
        self.total_errors = 0
        self.total_timeouts = 0
        self.total_null_ground_truth = 0
        self.first_error: str | None = None
        self._warned_rate = False
        self._http_retries_seen = 0

    def terms_for(self, data_source: str) -> tuple[Term, ...]:
        """The terms that score `data_source`; raises UnknownDataSourceError if none do."""
        return self.router.terms_for(data_source)

    def check_sources(self, data_sources: Iterable[str]) -> None:
        """Fail at start, not mid-run, if a dataset holds a data_source nobody can score."""
        for source in sorted(set(data_sources)):
            self.terms_for(source)

    def score(self, requests: Sequence[RewardRequest]) -> RewardBatchResult:
        plans = [self.terms_for(r.data_source) for r in requests]  # unknown source: raise now
        jobs: dict[str, list[tuple[int, int]]] = defaultdict(list)  # kind -> (sample, term)
        for i, plan in enumerate(plans):
            for t, term in enumerate(plan):
                jobs[term.kind].append((i, t))
        outcomes = self._run(requests, plans, jobs)

        n = len(requests)
        scores, accs, failed = [0.0] * n, [0.0] * n, [False] * n
        extras: list[dict[str, float]] = [{} for _ in range(n)]
        for i, plan in enumerate(plans):
            for t, term in enumerate(plan):
                out = outcomes[(i, t)]
                scores[i] += term.weight * out.score
                failed[i] |= out.failed
                for key, value in out.extras.items():
                    extras[i].setdefault(key, value)
            accs[i] = outcomes[(i, 0)].acc
        errors = sum(o.error is not None for o in outcomes.values())
        timeouts = sum(o.timed_out for o in outcomes.values())
        self._log_failures(requests, plans, outcomes)
        null_truth = sum(r.ground_truth is None for r in requests)
        self._count(len(outcomes), errors, timeouts, null_truth)
        metrics = self._metrics(requests, scores, accs, errors, timeouts)
        metrics.update(self._term_metrics(plans, outcomes, extras))
        metrics["reward/null_ground_truth"] = float(null_truth)
        if any(term.fn is not None and term.fn.batched for plan in plans for term in plan):
            metrics["reward/no_score"] = float(sum(o.no_score for o in outcomes.values()))
        return RewardBatchResult(scores, accs, failed, extras, metrics)

    def _run(self, requests, plans, jobs) -> dict[tuple[int, int], Outcome]:
        """Every term of the batch: endpoint and reward model started first, functions on the
        pool while they run, then the endpoint's and the model's answers collected."""
        http_keys, model_keys, fn_keys = jobs.get("http", []), jobs.get("model", []), jobs.get("function", [])
        judge_keys = jobs.get("judge", [])
        http_future = self.http.submit([requests[i] for i, _ in http_keys]) if http_keys else None
        judge_future = self.judge.submit([requests[i] for i, _ in judge_keys]) if judge_keys else None
        model_handle = self.model.submit([requests[i] for i, _ in model_keys]) if model_keys else None
        outcomes: dict[tuple[int, int], Outcome] = {}
        if fn_keys:
            if self._pool is None:
                self._pool = TimeoutPool(self.cfg.num_workers)
            fn_jobs = [(plans[i][t].fn, requests[i]) for i, t in fn_keys]
            outcomes.update(zip(fn_keys, run_calls(self._pool, fn_jobs, self.cfg.timeout_s)))
        if http_future is not None:
            outcomes.update(zip(http_keys, _loop_answers(http_future, self.http, len(http_keys))))
        if judge_future is not None:
            outcomes.update(zip(judge_keys, _loop_answers(judge_future, self.judge, len(judge_keys))))
        if model_handle is not None:
            outcomes.update(zip(model_keys, self.model.collect(model_handle, len(model_keys))))
        return outcomes

    def _log_failures(self, requests, plans, outcomes) -> None:
        timeouts: dict[str, int] = defaultdict(int)
        for (i, t), out in outcomes.items():
            term, source = plans[i][t], requests[i].data_source
            if out.timed_out:
                timeouts[term.kind] += 1
            if out.error is None:
                continue
            if self.first_error is None:
                self.first_error = f"data_source '{source}': {type(out.error).__name__}: {out.error}"
            if (source, term.label) not in self._logged:
                self._logged.add((source, term.label))
                logger.error(
                    "reward %s '%s' for data_source '%s' failed; the sample scores 0 for it "
                    "(later errors are only counted in reward/errors)", term.kind, term.label,
                    source, exc_info=out.error)
        limits = {"function": ("reward.timeout_s", self.cfg.timeout_s),
                  "http": ("reward.http.timeout_s", self.cfg.http and self.cfg.http.timeout_s),
                  "model": ("reward.model.timeout_s", self.cfg.model and self.cfg.model.timeout_s),
                  "judge": ("reward.judge.timeout_s", self.cfg.judge and self.cfg.judge.timeout_s)}
        for kind, count in timeouts.items():
            key, value = limits[kind]
            logger.warning("%d reward call(s) exceeded %s=%s and scored 0", count, key, value)

    def _term_metrics(self, plans, outcomes, extras) -> dict[str, float]:
        """reward/term/<label> (mean raw score of each term of a sum), reward/extra/<key> (mean
        of each extra number a scorer returned), reward/http_retries (this batch)."""
        metrics: dict[str, float] = {}
        if any(len(plan) > 1 for plan in plans):
            by_label: dict[str, list[float]] = defaultdict(list)
            for (i, t), out in outcomes.items():
                by_label[plans[i][t].label].append(out.score)
            metrics.update({f"reward/term/{k}": sum(v) / len(v) for k, v in by_label.items()})
        by_key: dict[str, list[float]] = defaultdict(list)
        for sample in extras:
            for key, value in sample.items():
                by_key[key].append(value)
        metrics.update({f"reward/extra/{k}": sum(v) / len(v) for k, v in by_key.items()})
        if self.http is not None:
            metrics["reward/http_retries"] = float(self.http.retries - self._http_retries_seen)
            self._http_retries_seen = self.http.retries
        if self.judge is not None:
            metrics.update(self.judge.metrics())
        return metrics

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
        for scorer in (self.http, self.model, self.judge):
            if scorer is not None:
                scorer.close()


def _loop_answers(future: concurrent.futures.Future, client, n: int) -> list[Outcome]:
    """The answers of a loop client's (reward.http, reward.judge) batch of n samples. The loop bounds
    every sample; this bound only guards a dead loop (R5)."""
    try:
        return future.result(timeout=client.wait_bound_s(n))
    except concurrent.futures.TimeoutError:
        future.cancel()
        return [Outcome(timed_out=True) for _ in range(n)]
