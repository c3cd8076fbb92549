"""The client side shared by reward.http and reward.judge: an httpx client on an asyncio loop in a
daemon thread of its own, so many requests can be in flight without one thread each, and a POST
retried with back-off after connection errors, 5xx and 429.

A subclass holds `cfg` (timeout_s, max_concurrency, retries, backoff_s), defines `_score_all`, and
counts what it reports through the `_on_request` / `_on_retry` hooks.
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Sequence

import httpx

from polyrl.rewards.outcome import Outcome

if TYPE_CHECKING:
    from polyrl.rewards.manager import RewardRequest


class LoopHttpClient:
    cfg: Any  # timeout_s, max_concurrency, retries, backoff_s

    def __init__(self, thread_name: str):
        self._thread_name = thread_name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._lock = threading.Lock()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name=self._thread_name,
                                                daemon=True)  # never blocks interpreter exit
                self._thread.start()
                self._loop = loop
            return self._loop

    def submit(self, requests: Sequence["RewardRequest"]) -> "Future[list[Outcome]]":
        """Start scoring `requests`; the future holds one Outcome per request, in order."""
        return asyncio.run_coroutine_threadsafe(self._score_all(list(requests)), self._start())

    async def _score_all(self, requests: list["RewardRequest"]) -> list[Outcome]:
        raise NotImplementedError

    def wait_bound_s(self, n: int) -> float:
        """Longest a batch of `n` can take while the loop is healthy: waves of max_concurrency,
        each at most timeout_s (plus a margin for the loop's own work)."""
        return math.ceil(max(n, 1) / self.cfg.max_concurrency) * self.cfg.timeout_s + 30.0

    def _open_client(self, headers: dict[str, str]) -> None:
        if self._client is None:  # created on the loop that uses it
            self._client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.cfg.timeout_s),
                                             limits=httpx.Limits(max_connections=self.cfg.max_concurrency))

    def _on_request(self) -> None:
        """Called before every POST, first ones and retries alike."""

    def _on_retry(self) -> None:
        """Called before every POST sent again after a retryable failure."""

    async def _post(self, url: str, error: type[Exception], **content: Any) -> "httpx.Response | Outcome":
        """POST `url` (`content` as httpx.post takes it) with up to cfg.retries retries; the 2xx/3xx
        response, or the failed Outcome: timed out on a client timeout, else `error` naming the URL."""
        delay, failure = self.cfg.backoff_s, None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self._on_retry()
                await asyncio.sleep(delay)  # back-off between attempts, not a test barrier
                delay *= 2
            self._on_request()
            try:
                response = await self._client.post(url, **content)
            except httpx.TimeoutException:
                return Outcome(timed_out=True)
            except httpx.TransportError as exc:  # refused, reset: the service may come back
                failure = error(f"POST {url}: {type(exc).__name__}: {exc}")
                continue
            if response.status_code >= 500 or response.status_code == 429:
                failure = error(f"POST {url}: HTTP {response.status_code}: {response.text[:200]}")
                continue
            if response.status_code >= 400:  # the request itself is wrong: retrying repeats it
                return Outcome(error=error(f"POST {url}: HTTP {response.status_code}: {response.text[:200]}"))
            return response
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
