"""The MLflow sink: the resolved config as params (flattened to dotted keys), every logged step's
numbers as metrics at that step, and - once the run has written them - `summary.json` and
`curves.png` as artifacts (`upload_run_files`).

Where: `MLFLOW_TRACKING_URI` when set (a tracking server or any store MLflow accepts), else a file
store under OUTPUT_DIR/mlruns (`mlflow ui --backend-store-uri OUTPUT_DIR/mlruns`). Experiment:
`logging.experiment_name`. The run id is kept in OUTPUT_DIR/mlflow_run_id, so a resumed run
continues the same MLflow run and the files are attached to it after training.

A tracker is a convenience, metrics.jsonl the record: when the tracking store cannot be reached
(a server that is down or goes away) the sink warns once, drops what it was given and
stops sending, and the run goes on. Uses MlflowClient, not mlflow's fluent API, so no "active
run" is left behind in a notebook's process.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import getproxies, proxy_bypass

logger = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run_id"
RUN_FILES = ("summary.json", "curves.png", "config.yaml")
"""What `upload_run_files` attaches to the run, when present."""
PARAM_VALUE_LIMIT = 6000  # MLflow refuses longer param values
PARAMS_PER_REQUEST = 100  # MLflow's log_batch limit
_BARE_SCHEMES = ("databricks", "databricks-uc", "uc")  # URIs that are only a scheme, no "://"
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /]")  # MLflow keys: alphanumerics, _ - . space /


def tracking_uri(output_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, else a file store in the run's directory (MLflow's own default is a
    SQLite file in the working directory, which needs SQLAlchemy and hides runs from their output)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (Path(output_dir).resolve() / "mlruns").as_uri()


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """{"actor": {"lr": 1e-5}} -> {"actor.lr": "1e-05"}; lists and nulls as JSON text."""
    if isinstance(config, dict) and config:
        out: dict[str, str] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    value = config if isinstance(config, str) else json.dumps(config)
    return {prefix.rstrip("."): value[:PARAM_VALUE_LIMIT]}


def file_store_refused(output_dir: Path | None = None) -> str | None:
    """Why MLflow will refuse the tracking store, known before the run starts: MLflow 3 opens a
    file store (the default OUTPUT_DIR/mlruns, or a file: MLFLOW_TRACKING_URI) only with
    MLFLOW_ALLOW_FILE_STORE=true. Any other URI: `tracking_uri_refused`. The one fix line for
    `check_available`, or None."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri is not None and (urlparse(uri).scheme not in ("file", "") or uri in _BARE_SCHEMES):
        return tracking_uri_refused()
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # MLflow 2 opens file stores without asking
        return None
    if MLFLOW_ALLOW_FILE_STORE.get():
        return None
    where = f"MLFLOW_TRACKING_URI={uri}" if uri else "the default store OUTPUT_DIR/mlruns"
    # no database URI in the hint: polyrl[mlflow] (mlflow-skinny) has no SQLAlchemy to open one
    return (f"logging.sinks includes mlflow and {where} is a file store, which MLflow opens only "
            "with MLFLOW_ALLOW_FILE_STORE=true: export MLFLOW_ALLOW_FILE_STORE=true, or set "
            "MLFLOW_TRACKING_URI to a tracking server (http://HOST:5000)")


_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy stores


def tracking_uri_refused() -> str | None:
    """Why the installed MLflow cannot open MLFLOW_TRACKING_URI at all, known before the run
    starts (else the sink would warn once and the run would log nothing): a database URI without
    SQLAlchemy (mlflow-skinny, what polyrl[mlflow] installs, has none), or a scheme no installed
    tracking store serves. The one fix line for `check_available`, or None."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    scheme = urlparse(uri).scheme.split("+")[0]
    fix = ("set MLFLOW_TRACKING_URI to a tracking server (http://HOST:5000), or unset it for the "
           "file store OUTPUT_DIR/mlruns (with MLFLOW_ALLOW_FILE_STORE=true)")
    if scheme in _DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        return (f"logging.sinks includes mlflow and MLFLOW_TRACKING_URI={uri} is a database, which "
                "MLflow opens only with SQLAlchemy, not installed by polyrl[mlflow] (mlflow-skinny): "
                f"{fix}, or pip install mlflow (the full package)")
    try:  # which schemes the installed MLflow's tracking stores serve (no store is opened)
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as stores

        stores.get_store_builder(uri)
    except ImportError:  # an MLflow without this registry: MLflow itself decides at start
        return None
    except Exception:  # noqa: BLE001 - MLflow's "unsupported URI" exception
        return (f"logging.sinks includes mlflow and MLFLOW_TRACKING_URI={uri} has a scheme "
                f"({scheme or 'none'}) the installed MLflow has no tracking store for: {fix}")
    return None


def _server_answers(uri: str) -> str | None:
    """None if an http(s) tracking server accepts a connection (or the URI is not a server),
    else why not. Asked before every request: MLflow's HTTP client retries a dead server for
    minutes (7 retries, doubling back-off), and a training step must not wait on its tracker;
    a refused connection is known in milliseconds."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return None
    if parsed.scheme in getproxies() and not proxy_bypass(parsed.hostname or ""):
        return None  # reached through a proxy: a direct connection says nothing; MLflow decides
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=5):
            return None
    except OSError as exc:
        return f"cannot connect to {parsed.hostname}:{port} ({exc})"


class MlflowSink:
    def __init__(self, experiment_name: str, run_name: str, config: dict[str, Any], output_dir: Path,
                 resume: bool = False):
        import mlflow  # noqa: F401 - checked by the caller; imported here so polyrl runs without it

        self.output_dir = Path(output_dir)
        self.uri = tracking_uri(self.output_dir)
        self.run_id: str | None = None
        self._warned = False
        if not resume:  # an earlier run's id must not receive this run's files
            (self.output_dir / RUN_ID_FILE).unlink(missing_ok=True)
        problem = _server_answers(self.uri)
        if problem is not None:
            self._give_up(problem)
            return
        try:
            self.client = self._make_client()
            self.run_id = self._start(experiment_name, run_name, resume)
            params = [(k, v) for k, v in flatten(config).items() if k]
            for start in range(0, len(params), PARAMS_PER_REQUEST):
                self._log_batch(params=params[start:start + PARAMS_PER_REQUEST])
        except Exception as exc:  # noqa: BLE001 - any tracker failure: warn once, train on
            self._give_up(exc)
            return
        logger.info("MLflow run %s (experiment %s) at %s", self.run_id, experiment_name, self.uri)

    def _make_client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def _start(self, experiment_name: str, run_name: str, resume: bool) -> str:
        id_file = self.output_dir / RUN_ID_FILE
        if resume and id_file.is_file():
            run_id = id_file.read_text().strip()
            try:
                self.client.update_run(run_id, status="RUNNING")
                return run_id
            except Exception:  # noqa: BLE001 - gone from the store: start a new run
                logger.info("MLflow run %s not found; starting a new one", run_id)
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(experiment_name))
        run = self.client.create_run(experiment_id, run_name=run_name)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run.info.run_id + "\n")
        return run.info.run_id

    def _log_batch(self, params=(), metrics=()) -> None:
        from mlflow.entities import Metric, Param

        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params],
                              metrics=[Metric(k, v, ts, step) for k, v, ts, step in metrics],
                              synchronous=True)

    def _give_up(self, why: Any) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("MLflow at %s: %s; metrics are no longer sent there (training goes on; "
                           "every step is in %s)", self.uri, why, self.output_dir / "metrics.jsonl")
        self.run_id = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        from polyrl.trainer.sinks import scalars

        now = int(time.time() * 1000)
        rows = [(_BAD_KEY_CHARS.sub("_", k), v, now, step) for k, v in scalars(metrics).items()]
        problem = _server_answers(self.uri)
        if problem is not None:
            self._give_up(problem)
            return
        try:
            self._log_batch(metrics=rows)
        except Exception as exc:  # noqa: BLE001 - the server went away mid-run
            self._give_up(exc)

    def close(self) -> None:
        if self.run_id is None:
            return
        try:
            self.client.set_terminated(self.run_id, "FINISHED")
        except Exception as exc:  # noqa: BLE001
            self._give_up(exc)


def upload_run_files(output_dir: Path, files: tuple[str, ...] = RUN_FILES) -> list[str]:
    """Attach the run's summary.json, curves.png and config.yaml to its MLflow run (the one
    named in OUTPUT_DIR/mlflow_run_id) once training has written them; returns what was sent.
    Failures warn and return what got through: the files stay in OUTPUT_DIR either way."""
    output_dir = Path(output_dir)
    id_file = output_dir / RUN_ID_FILE
    if not id_file.is_file():
        return []
    uri, run_id, sent = tracking_uri(output_dir), id_file.read_text().strip(), []
    if _server_answers(uri) is not None:
        logger.warning("MLflow at %s is unreachable: %s not attached to run %s", uri, ", ".join(files), run_id)
        return sent
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        for name in files:
            if (output_dir / name).is_file():
                client.log_artifact(run_id, str(output_dir / name))
                sent.append(name)
    except Exception as exc:  # noqa: BLE001 - a finished run must not fail on its tracker
        logger.warning("attaching run files to MLflow run %s at %s failed: %s", run_id, uri, exc)
    return sent
