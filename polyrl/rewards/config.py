"""`RewardConfig`: which function scores which data source, and how long a call may take."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from polyrl.config import Config


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

    timeout_s: float = Field(10.0, gt=0)
    """Most seconds one scoring call may run; a slower call scores 0 and counts as a timeout."""

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
