"""`reward.http`: a remote verifier, one POST per sample.

Requests run on an asyncio loop in a thread of their own, so many can be in flight without one
thread each, and every sample gets a hard deadline (`asyncio.wait_for` cancels the request):
a client-side read timeout alone would not do, since a server that trickles bytes resets it.
The deadline clock of a sample starts when its first request is sent, not while it waits for a
free slot under `max_concurrency`, the same rule as the function pool (polyrl/rewards/executor.py).

The body is the arguments of verl's `compute_score`, so an existing verl grading service needs no
change: {"data_source", "solution_str", "ground_truth", "extra_info"}.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import httpx

from polyrl.rewards.config import HttpRewardConfig
from polyrl.rewards.loop_client import LoopHttpClient
from polyrl.rewards.outcome import BadScoreError, Outcome, read_score

if TYPE_CHECKING:
    from polyrl.rewards.manager import RewardRequest


class RewardHTTPError(RuntimeError):
    """The endpoint failed for a sample: connection error or an error status, after retries."""


def _jsonable(value: Any) -> Any:
    """numpy values from Parquet rows (arrays, scalars) as JSON lists and numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def request_body(req: "RewardRequest") -> bytes:
    return json.dumps({"data_source": req.data_source, "solution_str": req.solution_str,
                       "ground_truth": req.ground_truth, "extra_info": req.extra_info},
                      default=_jsonable).encode()


class HttpScorer(LoopHttpClient):
    def __init__(self, cfg: HttpRewardConfig):
        super().__init__("polyrl-reward-http")
        self.cfg = cfg
        self.retries = 0
        """Requests sent again after a retryable failure (since the start)."""

    async def _score_all(self, requests: list["RewardRequest"]) -> list[Outcome]:
        self._open_client({"content-type": "application/json", **self.cfg.headers})
        slots = asyncio.Semaphore(self.cfg.max_concurrency)
        return list(await asyncio.gather(*(self._score_one(slots, r) for r in requests)))

    async def _score_one(self, slots: asyncio.Semaphore, req: "RewardRequest") -> Outcome:
        async with slots:
            try:
                return await asyncio.wait_for(self._attempts(req), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                return Outcome(timed_out=True)

    def _on_retry(self) -> None:
        self.retries += 1

    async def _attempts(self, req: "RewardRequest") -> Outcome:
        response = await self._post(self.cfg.url, RewardHTTPError, content=request_body(req))
        return response if isinstance(response, Outcome) else _read_answer(response)


def _read_answer(response: httpx.Response) -> Outcome:
    who = "reward.http endpoint"
    try:
        answer = response.json()
    except ValueError:
        return Outcome(error=BadScoreError(f"{who} answered non-JSON: {response.text[:200]!r}"))
    if not isinstance(answer, dict):
        return Outcome(error=BadScoreError(f"{who} answered {type(answer).__name__}; expected "
                                           '{"score": float}'))
    try:
        score, acc, extras = read_score(answer, who)
    except BadScoreError as exc:
        return Outcome(error=exc)
    return Outcome(score, acc, extras)
