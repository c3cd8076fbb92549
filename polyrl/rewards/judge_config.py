"""`JudgeRewardConfig` (reward.judge): an LLM judge behind an OpenAI-compatible endpoint
(polyrl/rewards/judge.py, docs/rewards.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from polyrl.config import Config

DEFAULT_RUBRIC = (
    "You are grading an answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{ground_truth}\n\n"
    "Answer to grade:\n{response}\n\nRate how correct the answer is on a scale from 0 to 10, "
    "10 meaning it agrees with the reference. Reply with the number only."
)


class JudgeRewardConfig(Config):
    url: str
    """Base URL of an OpenAI-compatible server: `polyrl serve`, a vLLM or SGLang server, or a
    provider (e.g. http://127.0.0.1:8000/v1). The judge POSTs to URL/chat/completions."""
    model: str
    """The model id sent in each request (`polyrl serve --served-model-name`, vLLM's
    --served-model-name, or the provider's model name)."""
    api_key_env: str | None = None
    """Name of an environment variable holding the API key, sent as "Authorization: Bearer
    KEY" (the key itself never goes in a config file)."""
    prompt: str = DEFAULT_RUBRIC
    """The rubric: one user message, with {prompt} (the row's prompt, its last user message),
    {response} (the decoded response) and {ground_truth} replaced; other braces stay as written."""
    parser: Literal["number", "labels"] = "number"
    """number: the last number in the judge's reply, which must lie in score_range, mapped
    linearly onto 0..1; labels: the last of `labels` named in the reply (whole words, any case),
    scored by the map."""
    score_range: tuple[float, float] = (0.0, 10.0)
    """parser=number: the lowest and highest score the rubric asks for."""
    labels: dict[str, float] = Field(default_factory=dict)
    """parser=labels: label -> score, e.g. {CORRECT: 1.0, PARTIAL: 0.5, INCORRECT: 0.0}."""
    acc_threshold: float = Field(1.0, ge=0, le=1)
    """A sample counts as accurate (reward/acc_mean) when its judge score is at least this."""
    max_tokens: int = Field(16, ge=1)
    """Tokens the judge may write (a number or a label needs few)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the judge (0: greedy, the same answer for the same input)."""
    max_concurrency: int = Field(8, ge=1)
    """Judge requests in flight at once."""
    timeout_s: float = Field(60.0, gt=0)
    """Most seconds one sample may take, retries included; past it the sample scores 0 and
    counts in reward/timeouts and reward/judge/timeouts."""
    retries: int = Field(2, ge=0)
    """Retries after a connection error, a 5xx or a 429 answer; waits backoff_s, then doubles."""
    backoff_s: float = Field(0.5, ge=0)
    """Wait before the first retry."""
    cache_size: int = Field(10000, ge=0)
    """Parsed scores kept per rendered rubric (the same prompt, response and ground truth are
    not judged twice; GRPO groups repeat answers often); 0 turns the cache off."""
    check_at_start: bool = True
    """Ask the server for its models before the run starts, so an unreachable judge is one line
    then instead of a run that scores 0."""
    sources: list[str] | None = None
    """data_source values scored by the judge alone; null: every data source not routed
    elsewhere; []: none (the judge is used only as a term of reward.combine, with a weight)."""

    @model_validator(mode="after")
    def _check(self) -> "JudgeRewardConfig":
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url '{self.url}' must start with http:// or https://; set "
                             "reward.judge.url=http://HOST:PORT/v1")
        if self.parser == "labels" and not self.labels:
            raise ValueError("parser=labels needs reward.judge.labels, e.g. {CORRECT: 1.0, INCORRECT: 0.0}")
        low, high = self.score_range
        if self.parser == "number" and not high > low:
            raise ValueError(f"score_range {list(self.score_range)} must be [lowest, highest] with "
                             "highest > lowest")
        if not any(key in self.prompt for key in ("{response}",)):
            raise ValueError("prompt has no {response}: the judge would not see what it grades")
        return self
