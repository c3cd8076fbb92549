"""Start Ray and Ray actors only through the environment plan.

Every process polyrl starts gets its variables from `polyrl.envplan`, so what `polyrl env`
prints is what the processes see — also on a remote cluster, whose workers do not inherit the
driver's environment.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from polyrl.distributed.topologies import TopologySpec
from polyrl.envplan import EnvPlan, PlanContext, build_plan
from polyrl.envplan.this_process import apply_here, restore
from polyrl.platform import Platform

logger = logging.getLogger(__name__)


def plan_for_role(
    platform: Platform,
    role: str,
    *,
    topology: TopologySpec,
    backend: str = "native",
    config_env: Mapping[str, str] | None = None,
    backend_version: str | None = None,
    hands_devices: bool = False,
    visible_devices: tuple[int, ...] = (),
    code_dirs: tuple[str, ...] = (),
) -> EnvPlan:
    """The environment of an actor of `role` in a run of `topology` (the planned `TopologySpec`,
    polyrl/distributed/topologies.py: its placement and mode scope the rules); `hands_devices`:
    it reserves no devices through Ray and gives its engine processes the devices of its
    placement (`visible_devices`) itself (`PlanContext`); `code_dirs`: where the config's
    plugins import from (PYTHONPATH)."""
    ctx = PlanContext(platform, role, backend, placement=topology.placement,  # type: ignore[arg-type]
                      mode=topology.mode, backend_version=backend_version,
                      hands_devices=hands_devices, visible_devices=tuple(visible_devices))
    return build_plan(ctx, user_env=os.environ, config_env=config_env or {}, code_dirs=code_dirs)


def submitted_env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """The env_vars of the runtime env `ray job submit` gave this driver ({} outside a job);
    Ray hands the job's config to its driver in RAY_JOB_CONFIG_JSON_ENV_VAR."""
    try:
        job = json.loads(environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
        return dict((job.get("runtime_env") or {}).get("env_vars") or {})
    except (ValueError, AttributeError, TypeError):
        return {}


def init_ray(
    plan: EnvPlan,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    namespace: str = "polyrl",
    start_timeout_s: float | None = None,
) -> EnvPlan:
    """Join or start Ray with `plan`, the job-level environment plan (the run plan's
    `launch.job.env`, polyrl/topology/run_plan.py: what `polyrl train --dry-run` prints), as the
    job's runtime env. Returns the plan.

    `start_timeout_s` (`ray.timeout_s`): how long a local Ray waits for its GCS to start (whole
    seconds, at most `GCS_START_WAIT_CAP_S`; Ray's own default is 30 s, too short on an
    overloaded machine). A start-up that times out raises `RayStartTimeout`, one line.

    If Ray is already initialised in this process (a test session, a notebook), it is reused
    and the plan is applied per actor instead.
    """
    import ray  # here: the plans above are read where Ray is not installed (ray.enabled=false)

    if ray.is_initialized():
        return plan
    runtime_env = plan.runtime_env()
    # a `ray job submit` driver: Ray refuses a ray.init runtime env that names a variable of the
    # job's --runtime-env again, even with the same value; the job already gives it to every worker
    submitted = submitted_env_vars(os.environ)
    runtime_env["env_vars"] = {k: v for k, v in runtime_env.get("env_vars", {}).items()
                               if submitted.get(k) != v}
    kwargs: dict[str, Any] = dict(
        namespace=namespace,
        runtime_env=runtime_env,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    if address:
        kwargs["address"] = address
    else:  # "local": a new instance even when a `ray start` cluster runs on this machine
        kwargs.update(address="local", num_cpus=num_cpus or os.cpu_count())
    where = f"joining {address}" if address not in (None, "local") else \
        f"a local instance, {kwargs.get('num_cpus') or os.cpu_count()} CPUs"
    logger.info("starting Ray (%s)", where)  # the interrupt tests signal on this line
    local = kwargs["address"] == "local"
    with keep_signal_handlers(), gcs_start_wait(start_timeout_s if local else None):
        try:
            ray.init(**kwargs)
        except Exception as exc:  # noqa: BLE001 - Ray raises RuntimeError, TimeoutError or Exception
            if not isinstance(exc, TimeoutError) and "timed out" not in str(exc).lower():
                raise
            raise RayStartTimeout(start_timeout_message(exc)) from None
    return plan


GCS_START_WAIT_CAP_S = 120
"""Longest GCS start-up wait `ray.timeout_s` asks of Ray (Ray's own choice for a slow GCS
backend): a GCS that died is not waited on for the full remote-call timeout."""


class RayStartTimeout(TimeoutError):
    """Ray's own start-up timed out (an OSError: `polyrl train` prints it as one line)."""


def start_timeout_message(exc: BaseException) -> str:
    why = " ".join(str(exc).split()) or type(exc).__name__
    load = f"load average {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores; " if hasattr(os, "getloadavg") else ""
    return (f"Ray did not start in time ({load}Ray: {why[:200]}): retry when the machine is less "
            f"busy, raise ray.timeout_s (it bounds Ray's wait for its GCS, up to "
            f"{GCS_START_WAIT_CAP_S} s), or start Ray once with `ray start --head` and set "
            "ray.address=auto")


@contextmanager
def gcs_start_wait(timeout_s: float | None) -> Iterator[None]:
    """Ray reads its GCS start-up wait from RAY_gcs_server_port_wait_time_s when it starts a
    node: set only for the duration of ray.init, and never over the user's own value."""
    name = "RAY_gcs_server_port_wait_time_s"
    if timeout_s is None or name in os.environ:
        yield
        return
    previous = apply_here({name: str(int(min(timeout_s, GCS_START_WAIT_CAP_S)))})
    try:
        yield
    finally:
        restore(previous)


@contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Keep the caller's SIGINT / SIGTERM handlers through `ray.init`.

    `ray.init` replaces the SIGTERM handler twice (a driver handler that calls `sys.exit(15)`,
    then the local node's, which drains the node for up to 30 s and calls `sys.exit(1)`), and
    its core worker installs a C++ handler that prints a stack dump: a SIGTERM during or after
    start-up then exited 15, 1 or 134 without polyrl's message (docs/training.md promises 143).
    So Ray's Python-level installer is a no-op for the duration (a SIGTERM inside `ray.init`
    reaches the caller's handler, which may raise out of it; the node's atexit hook still
    stops the processes it started), and afterwards the caller's handlers are installed again,
    which also replaces the C++ handler. Main thread only: that is where signals are delivered.
    A caller without a SIGTERM handler of its own keeps Ray's (which stops the node's processes)."""
    import ray

    main = threading.current_thread() is threading.main_thread()
    if not main or not callable(signal.getsignal(signal.SIGTERM)):
        yield
        return
    ours = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    installer = getattr(utils, "set_sigterm_handler", None)
    if installer is not None:
        utils.set_sigterm_handler = _ignore_handler
    try:
        yield
    finally:
        if installer is not None:
            utils.set_sigterm_handler = installer
        for sig, handler in ours.items():
            if handler is not None:  # None: installed outside Python; nothing to put back
                signal.signal(sig, handler)


def _ignore_handler(handler: Any) -> None:
    """Stands in for Ray's `set_sigterm_handler` while `keep_signal_handlers` holds."""


def actor_options(
    plan: EnvPlan, resources: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """Ray `.options(...)` for an actor of the plan's role: its resources plus its runtime env
    (exactly the plan's variables, the job's included: the driver's CPU priority among them,
    rule `ray-worker-priority` in polyrl/envplan/rules.py)."""
    return {**dict(resources), "runtime_env": plan.runtime_env(), **extra}
