"""Each logged step to the metric sinks (polyrl/trainer/sinks.py), a console progress bar, a
phase timer, and the metrics of a batch of scored samples."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator


from polyrl.trainer.sinks import MetricsSink, close_all, log_all


class PhaseTimer:
    """`with timer("generate"): ...` records timing/generate in seconds."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing/{phase}"] = self.times.get(f"timing/{phase}", 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


class MetricsWriter:
    def __init__(self, sinks: list[MetricsSink], total_steps: int, start_step: int, progress: bool):
        self.sinks = sinks
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="polyrl", unit="step",
                            dynamic_ncols=True)
        self.last_val: float | None = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        log_all(self.sinks, step, metrics)
        if "val/acc" in metrics:
            self.last_val = metrics["val/acc"]

    def progress(self, step: int, metrics: dict[str, Any]) -> None:
        if self.bar is None:
            return
        postfix = {
            "reward": f"{metrics.get('reward/score_mean', 0):.3f}",
            "acc": f"{metrics.get('reward/acc_mean', 0):.3f}",
            "s/step": f"{metrics.get('timing/step', 0):.2f}",
        }
        if self.last_val is not None:
            postfix["val_acc"] = f"{self.last_val:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        close_all(self.sinks)


def response_metrics(batch: Any) -> dict[str, float]:
    """Reward and response-length statistics of a scored `RolloutBatch`."""
    lengths = batch.response_lengths.float()
    return {
        "reward/score_mean": float(batch.rewards.mean()),
        "reward/acc_mean": float(batch.acc.mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_frac": float(batch.truncated.float().mean()),
        "response/masked_token_frac": 1.0 - float(batch.loss_mask.values.sum()) / max(float(lengths.sum()), 1.0),
        "perf/generated_tokens": float(lengths.sum()),
        **(batch.agent.metrics() if batch.agent is not None else {}),
    }
