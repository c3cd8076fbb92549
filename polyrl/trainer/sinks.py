"""Where each step's metrics go: `metrics.jsonl` always, TensorBoard, Weights & Biases and MLflow
on request.

A sink is anything with `log(step, metrics)` and `close()`. The trainer builds its sinks once with
`build_sinks(cfg.logging.sinks, ...)` and hands every logged step to each of them. The optional
sinks import their package only when built, so polyrl runs without tensorboard or wandb installed;
asking for one that is missing is a one-line error naming the extra to install.

    logging.sinks=[jsonl,tensorboard]   ->  tensorboard --logdir OUTPUT_DIR/tensorboard
    logging.sinks=[wandb]               ->  wandb sync OUTPUT_DIR/wandb/offline-run-*   (offline)
    logging.sinks=[mlflow]              ->  MLFLOW_TRACKING_URI, else OUTPUT_DIR/mlruns
                                            (polyrl/trainer/sinks_mlflow.py)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import secrets
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable


logger = logging.getLogger(__name__)

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
          "mlflow": ("mlflow", "mlflow")}
"""Optional sink -> (module it needs, polyrl extra that installs it)."""


class SinkUnavailable(RuntimeError):
    """An optional sink was selected but cannot work: its package is not installed, or (MLflow)
    its store is one the package refuses to open."""


@runtime_checkable
class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of `metrics` as plain floats (tensors and numpy scalars unwrapped)."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
    return out


# --- the sinks ---------------------------------------------------------------------------------


class JsonlSink:
    """One JSON object per logged step, `{"step": N, key: value, ...}`, flushed every step.

    Opens in append mode, so a resumed run keeps the lines of earlier steps. `keep_through=S`
    first drops the lines of steps after S: those a resumed run is about to redo.
    """

    def __init__(self, path: Path, keep_through: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_through is not None:
            truncate_jsonl(self.path, keep_through)
        self._file = self.path.open("a")
        # a crash mid-write can leave the last line unterminated: never glue a new record to it
        if self._file.tell() > 0 and not self.path.read_bytes().endswith(b"\n"):
            self._file.write("\n")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """A scalar per numeric key (`reward/score_mean` groups under the `reward` tab).

    `purge_step=S` hides events at steps >= S left by an interrupted run, so a resumed run does
    not draw two lines over the redone steps.
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a step takes seconds; the live view should not lag by minutes

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run. `mode="offline"` needs no network or account: the run is written
    under `dir/wandb/offline-run-*` and can be uploaded later with `wandb sync`.

    The run id is kept in `dir/wandb/run_id`; `resume=True` continues that W&B run (W&B ignores
    steps at or below the last one it holds, so steps redone after a crash are not redrawn).
    """

    def __init__(self, project: str, run_name: str, config: dict[str, Any], dir: Path,
                 mode: Literal["offline", "online"] = "offline", resume: bool = False):
        _require("wandb")
        import wandb

        self.dir, self.mode = Path(dir), mode
        wandb_dir = self.dir / "wandb"
        wandb_dir.mkdir(parents=True, exist_ok=True)
        id_file = wandb_dir / "run_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        # console="off": polyrl's own log and progress bar stay untouched by W&B's stdout capture
        self.run = wandb.init(project=project, name=run_name, config=config, dir=str(self.dir),
                              mode=mode, id=run_id, resume="allow" if resume else None,
                              settings=wandb.Settings(console="off", silent=True))
        where = Path(self.run.dir).parent if mode == "offline" else self.run.url
        logger.info("W&B run %s (%s): %s", run_name, mode, where)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
        if self.mode == "offline":
            logger.info("upload the offline W&B run with: wandb sync %s", Path(self.run.dir).parent)


# --- building ----------------------------------------------------------------------------------


def check_available(names: list[str]) -> None:
    """Raise SinkUnavailable now (at set-up, before models load) if a selected sink cannot load."""
    for name in names:
        if name in EXTRAS:
            _require(name)
    if "mlflow" in names:
        from polyrl.trainer.sinks_mlflow import file_store_refused

        refused = file_store_refused()
        if refused is not None:
            raise SinkUnavailable(refused)


def build_sinks(
    names: list[str],
    output_dir: Path,
    run_name: str,
    config: dict[str, Any],
    wandb_mode: Literal["offline", "online"] = "offline",
    wandb_project: str = "polyrl",
    resume_step: int | None = None,
    experiment_name: str | None = None,
) -> list[MetricsSink]:
    """The sinks named in `names` (jsonl always first), writing under `output_dir`.

    `resume_step`: the checkpoint step a resumed run continues from; what an interrupted run
    logged after it is dropped (jsonl) or hidden (TensorBoard), and the W&B run continues.
    None means a fresh run: metrics.jsonl starts empty, older TensorBoard events in the directory
    are hidden, and W&B and MLflow start a new run. `experiment_name` (MLflow) defaults to the
    config's logging.experiment_name, else "polyrl".
    """
    output_dir = Path(output_dir)
    check_available(names)
    keep = -1 if resume_step is None else resume_step
    sinks: list[MetricsSink] = [JsonlSink(output_dir / "metrics.jsonl", keep_through=keep)]
    built: list[MetricsSink] = []
    try:
        for name in dict.fromkeys(names):
            if name == "jsonl":
                continue
            if name == "tensorboard":
                built.append(TensorBoardSink(output_dir / "tensorboard", purge_step=keep + 1))
            elif name == "wandb":
                built.append(WandbSink(wandb_project, run_name, config, output_dir, wandb_mode,
                                       resume=resume_step is not None))
            elif name == "mlflow":
                from polyrl.trainer.sinks_mlflow import MlflowSink

                experiment = experiment_name or (config.get("logging") or {}).get("experiment_name")
                built.append(MlflowSink(experiment or "polyrl", run_name, config, output_dir,
                                        resume=resume_step is not None))
            else:
                raise ValueError(f"unknown metrics sink '{name}'; valid choices: jsonl, tensorboard, "
                                 "wandb, mlflow")
    except BaseException:
        for sink in [*sinks, *built]:
            sink.close()
        raise
    return sinks + built


def log_all(sinks: list[MetricsSink], step: int, metrics: dict[str, Any]) -> None:
    for sink in sinks:
        sink.log(step, metrics)


def close_all(sinks: list[MetricsSink]) -> None:
    """Close every sink, even if one fails (the first error is raised after the rest closed)."""
    error: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            logger.warning("closing %s failed: %s", type(sink).__name__, exc)
            error = error or exc
    if error is not None:
        raise error


def truncate_jsonl(path: Path, keep_through: int) -> None:
    """Keep only the records of steps <= keep_through (and drop unreadable partial lines)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if line.strip() and json.loads(line)["step"] <= keep_through:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    path.write_text("".join(line + "\n" for line in kept))


def _require(name: str) -> None:
    module, extra = EXTRAS[name]
    if importlib.util.find_spec(module) is None:
        raise SinkUnavailable(
            f'logging.sinks includes {name} but the {module} package is not installed: '
            f'pip install "polyrl[{extra}]" (or drop {name} from logging.sinks)')


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v
