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
import math
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Sequence

import httpx

from polyrl.rewards.config import HttpRewardConfig
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


class HttpScorer:
    def __init__(self, cfg: HttpRewardConfig):
        self.cfg = cfg
        self.retries = 0
        """Requests sent again after a retryable failure (since the start)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._lock = threading.Lock()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name="polyrl-reward-http",
                                                daemon=True)  # never blocks interpreter exit
                self._thread.start()
                self._loop = loop
            return self._loop

    def submit(self, requests: Sequence["RewardRequest"]) -> "Future[list[Outcome]]":
        """Start scoring `requests`; the future holds one Outcome per request, in order."""
        return asyncio.run_coroutine_threadsafe(self._score_all(list(requests)), self._start())

    def wait_bound_s(self, n: int) -> float:
        """Longest a batch of `n` can take while the loop is healthy: waves of max_concurrency,
        each at most timeout_s (plus a margin for the loop's own work)."""
        return math.ceil(max(n, 1) / self.cfg.max_concurrency) * self.cfg.timeout_s + 30.0

    async def _score_all(self, requests: list["RewardRequest"]) -> list[Outcome]:
        if self._client is None:  # created on the loop that uses it
            self._client = httpx.AsyncClient(
                headers={"content-type": "application/json", **self.cfg.headers},
                limits=httpx.Limits(max_connections=self.cfg.max_concurrency),
                timeout=httpx.Timeout(self.cfg.timeout_s))
        slots = asyncio.Semaphore(self.cfg.max_concurrency)
        return list(await asyncio.gather(*(self._score_one(slots, r) for r in requests)))

    async def _score_one(self, slots: asyncio.Semaphore, req: "RewardRequest") -> Outcome:
        async with slots:
            try:
                return await asyncio.wait_for(self._attempts(req), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                return Outcome(timed_out=True)

    async def _attempts(self, req: "RewardRequest") -> Outcome:
        body = request_body(req)
        delay = self.cfg.backoff_s
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(delay)  # back-off between attempts, not a test barrier
                delay *= 2
            try:
                response = await self._client.post(self.cfg.url, content=body)
            except httpx.TimeoutException:
                return Outcome(timed_out=True)
            except httpx.TransportError as exc:  # refused, reset: the service may come back
                failure = RewardHTTPError(f"POST {self.cfg.url}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500 or response.status_code == 429:
                failure = RewardHTTPError(f"POST {self.cfg.url}: HTTP {response.status_code}: "
                                          f"{response.text[:200]}")
                continue
            if response.status_code >= 400:  # the request itself is wrong: retrying repeats it
                return Outcome(error=RewardHTTPError(
                    f"POST {self.cfg.url}: HTTP {response.status_code}: {response.text[:200]}"))
            return _read_answer(response)
        return Outcome(error=failure)

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result(timeout=10)
            self._client = None
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            loop.close()


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
