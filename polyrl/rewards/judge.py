"""`reward.judge`: an LLM judge (a generative reward). A served model reads a rubric holding the
prompt, the response and the ground truth, and its reply is parsed into a score in 0..1.

The judge is any OpenAI-compatible chat endpoint: `polyrl serve`, a vLLM or SGLang server, a
provider. Requests run on an asyncio loop in a thread of their own (the way reward.http runs,
polyrl/rewards/http.py): at most `max_concurrency` in flight, a hard per-sample deadline
(`timeout_s`, retries included), retries with back-off after connection errors, 5xx and 429.
Parsed scores are cached per rendered rubric, so a GRPO group that repeats an answer asks once.

Every failure scores the sample 0 and is counted by the manager (reward/errors or
reward/timeouts) and here by kind (reward/judge/*: requests, cache_hits, retries, timeouts,
http_errors, unparsed), so a judge that times out, answers 500 or writes garbage never stops a
step. An unreachable judge at start is one line before Ray (`check_reachable`).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import httpx

from polyrl.rewards.judge_config import JudgeRewardConfig
from polyrl.rewards.loop_client import LoopHttpClient
from polyrl.rewards.outcome import BadScoreError, Outcome

if TYPE_CHECKING:
    from polyrl.rewards.manager import RewardRequest

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
COUNTERS = ("requests", "cache_hits", "retries", "timeouts", "http_errors", "unparsed")


class JudgeError(RuntimeError):
    """The judge endpoint failed for a sample (connection error or error status, after retries)."""


class JudgeUnreachableError(ConnectionError):
    """The judge did not answer at start (one line: the CLI prints it, exit 2)."""


def prompt_text(prompt: Any) -> str:
    """The row's prompt for the rubric: a string as is, a chat as its last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1] if users else ""
    if isinstance(content, list):  # content parts: keep the text ones
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def render(template: str, req: "RewardRequest") -> str:
    """The rubric with {prompt}, {response} and {ground_truth} replaced (other braces kept)."""
    values = {"{prompt}": prompt_text(req.prompt), "{response}": req.solution_str,
              "{ground_truth}": "" if req.ground_truth is None else str(req.ground_truth)}
    return re.sub(r"\{prompt\}|\{response\}|\{ground_truth\}", lambda m: values[m.group(0)], template)


def parse_score(cfg: JudgeRewardConfig, reply: str) -> float:
    """The judge's reply as a score in 0..1; BadScoreError when it holds none."""
    if cfg.parser == "labels":
        names = sorted(cfg.labels, key=len, reverse=True)  # INCORRECT before CORRECT
        found = list(re.finditer(r"\b(" + "|".join(map(re.escape, names)) + r")\b", reply, re.IGNORECASE))
        if not found:
            raise BadScoreError(f"judge reply names none of the labels {list(cfg.labels)}: {reply[:200]!r}")
        by_lower = {name.lower(): score for name, score in cfg.labels.items()}
        return float(by_lower[found[-1].group(1).lower()])
    low, high = cfg.score_range
    numbers = _NUMBER.findall(reply)
    if not numbers:
        raise BadScoreError(f"judge reply holds no number: {reply[:200]!r}")
    value = float(numbers[-1])
    if not (low <= value <= high) or not math.isfinite(value):
        raise BadScoreError(f"judge reply's number {value:g} is outside score_range [{low:g}, {high:g}]")
    return (value - low) / (high - low)


class JudgeScorer(LoopHttpClient):
    def __init__(self, cfg: JudgeRewardConfig):
        super().__init__("polyrl-reward-judge")
        self.cfg = cfg
        self.counts = dict.fromkeys(COUNTERS, 0)
        """Totals since the start, by kind (reward/judge/<kind> reports each batch's share)."""
        self._reported = dict(self.counts)
        self._cache: OrderedDict[str, float] = OrderedDict()

    @property
    def endpoint(self) -> str:
        return self.cfg.url.rstrip("/") + "/chat/completions"

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None
        return {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}

    def check_reachable(self) -> None:
        """GET URL/models once; raises JudgeUnreachableError (one line) when the server cannot be
        reached or refuses the key. A server without /models (404) still counts as reachable."""
        url = self.cfg.url.rstrip("/") + "/models"
        try:
            response = httpx.get(url, headers=self.headers(), timeout=min(self.cfg.timeout_s, 30.0))
        except httpx.HTTPError as exc:
            raise JudgeUnreachableError(f"reward.judge.url={self.cfg.url} is unreachable ({type(exc).__name__}: "
                                        f"{exc}); start the judge server first, or set "
                                        "reward.judge.check_at_start=false") from None
        if response.status_code in (401, 403):
            raise JudgeUnreachableError(f"reward.judge.url={self.cfg.url} refused the request (HTTP "
                                        f"{response.status_code}); set reward.judge.api_key_env to the "
                                        "variable holding its API key")
        if response.status_code >= 500:
            raise JudgeUnreachableError(f"reward.judge.url={self.cfg.url} answered HTTP {response.status_code} "
                                        "at start; check the judge server")

    def metrics(self) -> dict[str, float]:
        """reward/judge/<kind>: the counts since the last call (one batch)."""
        out = {f"reward/judge/{k}": float(self.counts[k] - self._reported[k]) for k in COUNTERS}
        self._reported = dict(self.counts)
        return out

    async def _score_all(self, requests: list["RewardRequest"]) -> list[Outcome]:
        self._open_client(self.headers())
        slots = asyncio.Semaphore(self.cfg.max_concurrency)
        rubrics = [render(self.cfg.prompt, r) for r in requests]
        unique = list(dict.fromkeys(rubrics))  # a batch's repeated rubric is asked once too
        self.counts["cache_hits"] += len(rubrics) - len(unique)
        answers = dict(zip(unique, await asyncio.gather(*(self._score_one(slots, r) for r in unique))))
        return [answers[r] for r in rubrics]

    async def _score_one(self, slots: asyncio.Semaphore, rubric: str) -> Outcome:
        if rubric in self._cache:
            self._cache.move_to_end(rubric)
            self.counts["cache_hits"] += 1
            return self._outcome(self._cache[rubric])
        async with slots:  # the deadline starts once a slot is free
            try:
                outcome = await asyncio.wait_for(self._attempts(rubric), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                outcome = Outcome(timed_out=True)
        if outcome.timed_out:
            self.counts["timeouts"] += 1
        elif outcome.error is None and self.cfg.cache_size:
            self._cache[rubric] = outcome.score
            if len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return outcome

    def _outcome(self, score: float) -> Outcome:
        return Outcome(score, float(score >= self.cfg.acc_threshold))

    def _on_request(self) -> None:
        self.counts["requests"] += 1

    def _on_retry(self) -> None:
        self.counts["retries"] += 1

    async def _attempts(self, rubric: str) -> Outcome:
        body = {"model": self.cfg.model, "messages": [{"role": "user", "content": rubric}],
                "max_tokens": self.cfg.max_tokens, "temperature": self.cfg.temperature}
        response = await self._post(self.endpoint, JudgeError, json=body)
        if not isinstance(response, Outcome):
            return self._read(response)
        if response.error is not None:  # a 4xx, or retries spent (a timeout is counted by the caller)
            self.counts["http_errors"] += 1
        return response

    def _read(self, response: httpx.Response) -> Outcome:
        try:
            reply = response.json()["choices"][0]["message"]["content"]
            if not isinstance(reply, str):
                raise TypeError(f"content is {type(reply).__name__}")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self.counts["unparsed"] += 1
            return Outcome(error=BadScoreError(f"judge answered no chat completion ({type(exc).__name__}: "
                                               f"{exc}): {response.text[:200]!r}"))
        try:
            return self._outcome(parse_score(self.cfg, reply))
        except BadScoreError as exc:
            self.counts["unparsed"] += 1
            return Outcome(error=exc)
