"""polyrl from Python (notebooks, scripts): `polyrl.train(config)` and `polyrl.sft(config)`
(docs/python_api.md).

The same runs as `polyrl train` / `polyrl sft`, returning the summary (what summary.json holds)
instead of an exit code, and raising typed errors instead of exiting: `ConfigError` for a config
that cannot run, the error of the failing part (`DataFileError`, `ModelLoadError`,
`SinkUnavailable`, ...) for bad input found later, `TrainingInterrupted` / `StartupInterrupted`
for a signal. The CLI is built on these functions and turns the errors into one line and an exit
code. Ray and the run's actors are shut down before a call returns or raises (Ray itself stays
up when the caller had started it).

Importing this module imports neither torch nor Ray: they load on the first call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Union

if TYPE_CHECKING:
    from polyrl.job import JobConfig
    from polyrl.sft.config import SFTConfig

EMBEDDED_DEFAULT = Path(__file__).resolve().parent / "configs" / "embedded_default.yaml"
"""What `polyrl train` starts from without -c: the bundled tiny model and arithmetic task."""

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], "JobConfig", "SFTConfig", None]


def train(config: ConfigLike = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run RL post-training and return its summary.

    `config`: a YAML file path, a dict of dotted keys ({"rollout.n": 8}, applied on top of the
    embedded default like `polyrl train rollout.n=8`), a `JobConfig`, or None (the embedded
    default). `overrides`: dotted keys applied on top of a YAML file or the default."""
    from polyrl.job import JobConfig

    cfg = resolve_config(JobConfig, config, overrides, default_file=EMBEDDED_DEFAULT)
    return run_training(cfg)


def sft(config: ConfigLike = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run supervised fine-tuning and return its summary; `config` as for `train` (a dict of
    dotted keys and None start from SFT's defaults: the bundled tiny model and chat file)."""
    from polyrl.sft.config import SFTConfig

    cfg = resolve_config(SFTConfig, config, overrides, default_file=None)
    return run_sft_job(cfg)


def resolve_config(cls: type, config: ConfigLike, overrides: Mapping[str, Any] | None,
                   default_file: Path | None):
    """`config` (see `train`) as a validated `cls`; ConfigError naming each bad key otherwise."""
    from polyrl.config import ConfigError
    from polyrl.config.base import deep_merge, read_yaml, validate

    if isinstance(config, cls):
        if not overrides:
            return config
        data, updates = config.model_dump(mode="json"), dict(overrides)
    elif isinstance(config, (str, os.PathLike)):
        data, updates = read_yaml(config), dict(overrides or {})
    elif config is None or isinstance(config, Mapping):
        data = read_yaml(default_file) if default_file is not None else {}
        updates = {**(config or {}), **(overrides or {})}
    else:
        raise ConfigError([f"config must be a YAML path, a dict of dotted keys or a {cls.__name__}; "
                           f"got {type(config).__name__}"])
    return validate(cls, deep_merge(data, nest(updates)))


def nest(dotted: Mapping[str, Any]) -> dict[str, Any]:
    """{"a.b": 1, "a": {"c": 2}} -> {"a": {"b": 1, "c": 2}}: dotted keys as nested dicts."""
    from polyrl.config.base import deep_merge

    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node: Any = dict(value) if isinstance(value, Mapping) else value
        for part in reversed(str(key).split(".")):
            node = {part: node}
        out = deep_merge(out, node)
    return out


def run_training(cfg: "JobConfig") -> dict[str, Any]:
    """`Trainer(cfg).fit()` with start-up signals stopping it at once (StartupInterrupted) and
    errors raised inside Ray actors unwrapped to their own type; attaches the run's files to
    its MLflow run when logging.sinks includes mlflow."""
    from polyrl.trainer.interrupts import StartupInterrupted, abort_on_signals
    from polyrl.trainer.loop import Trainer

    children = None if ray_is_up() else child_pids()  # Ray started by this call: its processes are new
    try:
        try:
            with abort_on_signals():
                summary = Trainer(cfg).fit()
        except (StartupInterrupted, KeyboardInterrupt):
            if children is not None:
                stop_ray_leftovers(children)
            raise
    except Exception as exc:
        actionable = with_distill_hint(unwrapped(exc), cfg)
        if isinstance(actionable, StartupInterrupted) and children is not None:
            stop_ray_leftovers(children)
        if actionable is exc:
            raise  # an unexpected error keeps its traceback and chain
        raise actionable from None
    if "mlflow" in cfg.logging.sinks:
        from polyrl.trainer.sinks_mlflow import upload_run_files

        upload_run_files(cfg.output_path)
    return summary


def with_distill_hint(exc: BaseException, cfg: "JobConfig") -> BaseException:
    """Non-finite updates of a distillation run: the rank's message names the usual suspects
    (actor.lr, actor.grad_clip, the rewards) but not distill.coef, which scales every token's
    advantage."""
    from polyrl.training.base import NonFiniteUpdate

    if isinstance(exc, NonFiniteUpdate) and cfg.distill.enabled and "distill.coef" not in str(exc):
        hint = NonFiniteUpdate(f"{exc} With distillation on, also lower distill.coef (now {cfg.distill.coef:g}: "
                               "it scales every token's advantage).")
        return hint
    return exc


def ray_is_up() -> bool:
    """Ray is initialised in this process (never importing it: a run without Ray stays without)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def child_pids() -> set[int]:
    import psutil  # a dependency of peft, which polyrl requires

    return {p.pid for p in psutil.Process().children(recursive=True)}


def stop_ray_leftovers(before: set[int], timeout_s: float = 10.0) -> list[int]:
    """Shut down a Ray this call started, then end every Ray process (gcs_server, raylet, the
    monitor, dashboard, log_monitor, runtime_env_agent, workers) this process started since
    `before`. A signal inside `ray.init` can stop it after the head processes were spawned but
    before Ray recorded them, so `ray.shutdown()` alone does not know them and they would outlive
    the call (in a notebook: until the kernel exits). Returns the pids ended."""
    import sys

    import psutil

    ray = sys.modules.get("ray")
    if ray is not None:
        ray.shutdown()
    leftovers = []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in before:
            continue
        try:
            name, command = proc.name(), " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if "ray" in command or name in ("gcs_server", "raylet"):
            leftovers.append(proc)
    for proc in leftovers:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(leftovers, timeout=timeout_s)
    for proc in alive:  # one that ignored SIGTERM
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    return [p.pid for p in leftovers]


def run_sft_job(cfg: "SFTConfig") -> dict[str, Any]:
    """`run_sft(cfg)` after the LoRA check every rank would otherwise fail on, with start-up
    signals stopping it at once."""
    from polyrl.sft.launch import run_sft
    from polyrl.sft.preflight import check_lora
    from polyrl.trainer.interrupts import abort_on_signals

    check_lora(cfg.model)  # before any rank loads the model
    with abort_on_signals():
        summary = run_sft(cfg)
    if "mlflow" in cfg.logging.sinks:  # once SFT's logging.sinks offers it
        from polyrl.trainer.sinks_mlflow import upload_run_files

        upload_run_files(cfg.output_path)
    return summary


def unwrapped(exc: Exception) -> BaseException:
    """The error a user can act on behind `exc`: a `StartupInterrupted` raised inside Ray's own
    signal check (it comes out as a SystemError whose cause it is), or a known error raised in a
    Ray actor (Ray wraps it; `cause` is the original). Anything else unchanged."""
    from polyrl.config import ConfigError
    from polyrl.rollout.factory import EngineUnavailable
    from polyrl.trainer.interrupts import StartupInterrupted
    from polyrl.training.base import NonFiniteUpdate
    from polyrl.training.lora import LoraError
    from polyrl.training.model_loading import ModelLoadError

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, StartupInterrupted):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    inner = getattr(exc, "cause", None)
    # ConfigError: a plugin's output checked where a rank calls it (algorithms/plugin_checks.py)
    if isinstance(inner, (ModelLoadError, NonFiniteUpdate, EngineUnavailable, OSError, LoraError, ConfigError)):
        return inner
    return exc
