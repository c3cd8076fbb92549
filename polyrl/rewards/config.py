"""`RewardConfig`: which scorer scores which data source, and how long a call may take.

Five kinds of scorer: a Python function (built-in per data source, or `custom_function`), a
remote verifier (`http`), a local reward model (`model`), an LLM judge (`judge`,
polyrl/rewards/judge_config.py), and a weighted sum of those (`combine`). Routing is decided
per data source by `polyrl/rewards/routing.py`; docs/rewards.md has an example of each.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from polyrl.config import Config
from polyrl.rewards.judge_config import JudgeRewardConfig


class HttpRewardConfig(Config):
    url: str
    """Endpoint that scores one sample per POST: the body is {"data_source", "solution_str",
    "ground_truth", "extra_info"}, the answer {"score": float} (optional "acc"; other numeric
    keys become reward/extra/<key> metrics)."""
    timeout_s: float = Field(30.0, gt=0)
    """Most seconds one sample may take, retries included, counted from when its first request
    is sent; past it the sample scores 0 and counts in reward/timeouts."""
    max_concurrency: int = Field(16, ge=1)
    """Requests in flight at once. A batch takes at most ceil(samples / max_concurrency) x
    timeout_s."""
    retries: int = Field(2, ge=0)
    """Retries after a connection error, a 5xx or a 429 answer (not after a 4xx or an answer
    that is not a score: those would fail again). Waits backoff_s, then doubles."""
    backoff_s: float = Field(0.5, ge=0)
    """Wait before the first retry; each further retry waits twice as long."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers sent with every request (e.g. an API key of the grading service)."""
    sources: list[str] | None = None
    """data_source values scored by the endpoint; null: every data source not routed elsewhere;
    []: none (the endpoint is used only as a term of reward.combine)."""

    @model_validator(mode="after")
    def _check_url(self) -> "HttpRewardConfig":
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url '{self.url}' must start with http:// or https://; "
                             "set reward.http.url=http://HOST:PORT/PATH")
        return self


class ModelRewardConfig(Config):
    path: str
    """Local Hugging Face directory of a sequence-classification reward model with one score
    head (num_labels=1) and a tokenizer with a chat template. Nothing is downloaded."""
    batch_size: int = Field(8, ge=1)
    """Conversations per forward pass."""
    max_length: int = Field(2048, ge=8)
    """Tokens of a rendered conversation the model reads; longer ones keep their end (the
    response), since the score head reads the last token."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype of the reward model."""
    num_cpus: float = Field(1, gt=0)
    """CPUs the Ray reward worker reserves."""
    num_devices: float = Field(0, ge=0)
    """Accelerators (GPUs, NPUs) the Ray reward worker reserves; 0 runs it on CPU."""
    in_process: bool = False
    """Run the reward model in the driver process instead of a Ray reward worker (small models
    on CPU; the driver's own cores then do the work)."""
    timeout_s: float = Field(600.0, gt=0)
    """Most seconds the reward worker may take for one batch (model loading included on the
    first); past it the batch scores 0 and counts in reward/timeouts."""
    trust_remote_code: bool = False
    """Allow model code shipped in the reward model's directory."""
    sources: list[str] | None = None
    """data_source values scored by the reward model; null: every data source not routed
    elsewhere; []: none (the model is used only as a term of reward.combine)."""


class RewardTerm(Config):
    kind: Literal["function", "model", "http", "judge"]
    """function: a Python function; model: reward.model; http: reward.http; judge: reward.judge."""
    weight: float = 1.0
    """Factor of this term in the sum."""
    function: str | None = None
    """kind=function only: "package.module:fn" or "/path/file.py:fn"; null: the function that
    scores the data source on its own (reward.custom_function where it routes the source, else
    the built-in verifier)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """kind=function only: keyword arguments passed on every call."""
    name: str | None = None
    """Name of the term's metric reward/term/<name> (default: the kind, or the function's name)."""

    @model_validator(mode="after")
    def _check(self) -> "RewardTerm":
        if self.kind != "function" and (self.function is not None or self.kwargs):
            raise ValueError(f"function / kwargs apply to kind=function only (this term is "
                             f"kind={self.kind}); remove them")
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"function '{self.function}' must name a function: module:fn or "
                             "/path/to/file.py:fn")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "function" and self.function:
            return self.function.rpartition(":")[2]
        return self.kind


SOURCES_KEY = {"reward.custom_function": "reward.custom_function_sources",
               "reward.http": "reward.http.sources", "reward.model": "reward.model.sources",
               "reward.judge": "reward.judge.sources"}


class RewardConfig(Config):
    custom_function: str | None = None
    """A user scoring function as "package.module:function" or "/path/to/file.py:function",
    called as fn(solution_str, ground_truth, extra_info, **kwargs) -> float | {"score", "acc"}.
    It takes precedence over the built-ins (for all data sources, or only those listed in
    custom_function_sources). verl-style fn(data_source, solution_str, ...) also works."""

    custom_function_sources: list[str] | None = None
    """data_source values routed to custom_function; null routes every data source to it."""

    custom_function_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed to custom_function on every call."""

    http: HttpRewardConfig | None = None
    """A remote verifier (reward.http.url, ...); see docs/rewards.md."""

    model: ModelRewardConfig | None = None
    """A local reward model run by a Ray reward worker (reward.model.path, ...)."""

    judge: JudgeRewardConfig | None = None
    """An LLM judge behind an OpenAI-compatible endpoint (reward.judge.url, reward.judge.model,
    ...); see docs/rewards.md."""

    combine: dict[str, list[RewardTerm]] = Field(default_factory=dict)
    """Weighted sums per data_source ("*": every data source not listed), e.g.
    {gsm8k: [{kind: function}, {kind: function, function: "polyrl.rewards.shaping:length_penalty",
    weight: 0.1}]}. The score is sum(weight x term score); the accuracy is the first term's."""

    timeout_s: float = Field(10.0, gt=0)
    """Most seconds one scoring-function call may run; a slower call scores 0 and counts as a
    timeout (reward.http and reward.model have their own timeout_s)."""

    num_workers: int = Field(4, ge=1)
    """Threads that run scoring calls (scoring is cheap; threads only bound the timeout)."""

    warn_error_rate: float = Field(0.5, gt=0, le=1)
    """Warn during the run once this share of scoring calls (errors + timeouts, counted since
    the start and over at least one batch) has failed: those samples score 0, so little or
    nothing is learned. The run's totals are in summary.json ("reward_errors")."""

    gsm8k_method: Literal["strict", "flexible"] = "strict"
    """GSM8K answer extraction: strict takes the number after "#### "; flexible falls back to the
    last number in the response when there is no "#### "."""

    @model_validator(mode="after")
    def _check_custom(self) -> "RewardConfig":
        if self.custom_function is not None and ":" not in self.custom_function:
            raise ValueError(
                f"custom_function '{self.custom_function}' must name a function: set "
                "reward.custom_function=my_pkg.my_module:my_fn or /path/to/file.py:my_fn"
            )
        if self.custom_function is None and self.custom_function_sources is not None:
            raise ValueError(
                "custom_function_sources is set but custom_function is not; set "
                "reward.custom_function=module:function or remove reward.custom_function_sources"
            )
        if self.custom_function is None and self.custom_function_kwargs:
            raise ValueError(
                "custom_function_kwargs is set but custom_function is not; set "
                "reward.custom_function=module:function or remove reward.custom_function_kwargs"
            )
        return self

    @model_validator(mode="after")
    def _check_routing(self) -> "RewardConfig":
        for source, terms in self.combine.items():
            if not terms:
                raise ValueError(f"combine.{source} is empty; list at least one term "
                                 "({kind: function|model|http, weight: ...}) or remove it")
            for i, term in enumerate(terms):
                section = {"model": self.model, "http": self.http, "judge": self.judge}.get(term.kind, True)
                if section is None:
                    raise ValueError(f"combine.{source}[{i}] is kind={term.kind} but reward.{term.kind} "
                                     f"is not set; set reward.{term.kind}."
                                     f"{'path' if term.kind == 'model' else 'url'}=...")
        claims = self.routes()
        catch_all = [key for key, sources in claims.items() if sources is None]
        if len(catch_all) > 1 and "*" not in self.combine:
            keys = ", ".join(SOURCES_KEY[k] for k in catch_all)
            raise ValueError(f"{' and '.join(catch_all)} both score every data source; list which "
                             f"data sources each scores ({keys}) or sum them with reward.combine")
        seen: dict[str, str] = {}
        for key, sources in claims.items():
            for source in sources or []:
                if source in seen:
                    raise ValueError(f"data_source '{source}' is listed by both {seen[source]} and {key}; "
                                     f"keep one, or sum them with reward.combine.{source}")
                seen[source] = key
        return self

    def routes(self) -> dict[str, list[str] | None]:
        """The single scorers that are configured -> the data sources each claims (None: all)."""
        out: dict[str, list[str] | None] = {}
        if self.custom_function is not None:
            out["reward.custom_function"] = self.custom_function_sources
        if self.http is not None:
            out["reward.http"] = self.http.sources
        if self.model is not None:
            out["reward.model"] = self.model.sources
        if self.judge is not None:
            out["reward.judge"] = self.judge.sources
        return out
