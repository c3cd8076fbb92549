"""Start Ray and Ray actors only through the environment plan.

Every process polyrl starts gets its variables from `polyrl.envplan`, so what `polyrl env`
prints is what the processes see — also on a remote cluster, whose workers do not inherit the
driver's environment.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import ray

from polyrl.envplan import EnvPlan, PlanContext, build_plan
from polyrl.platform import Platform

logger = logging.getLogger(__name__)


def plan_for_role(
    platform: Platform,
    role: str,
    *,
    backend: str = "native",
    placement: str = "hybrid",
    mode: str = "sync",
    config_env: Mapping[str, str] | None = None,
    backend_version: str | None = None,
    hands_devices: bool = False,
    visible_devices: tuple[int, ...] = (),
) -> EnvPlan:
    """The environment of an actor of `role`; `hands_devices`: it reserves no devices through
    Ray and gives its engine processes the devices of its placement (`visible_devices`) itself
    (`PlanContext`)."""
    ctx = PlanContext(platform, role, backend, placement, mode, backend_version,  # type: ignore[arg-type]
                      hands_devices, tuple(visible_devices))
    return build_plan(ctx, user_env=os.environ, config_env=config_env or {})


def init_ray(
    platform: Platform,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    namespace: str = "polyrl",
    config_env: Mapping[str, str] | None = None,
    **plan_kwargs: Any,
) -> EnvPlan:
    """Join or start Ray with the job-level plan as the job's runtime env. Returns the plan.

    If Ray is already initialised in this process (a test session, a notebook), it is reused
    and the plan is applied per actor instead.
    """
    plan = plan_for_role(platform, "job", config_env=config_env, **plan_kwargs)
    if ray.is_initialized():
        return plan
    kwargs: dict[str, Any] = dict(
        namespace=namespace,
        runtime_env=plan.runtime_env(),
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    if address:
        kwargs["address"] = address
    else:  # "local": a new instance even when a `ray start` cluster runs on this machine
        kwargs.update(address="local", num_cpus=num_cpus or os.cpu_count())
    ray.init(**kwargs)
    _keep_python_signal_handlers()
    return plan


def _keep_python_signal_handlers() -> None:
    """Ray's core worker installs its own SIGTERM handler at `ray.init`, which aborts the driver
    with a C++ stack dump instead of the clean exit 143 polyrl's handlers give: put Python's
    handlers back (main thread only: that is where signals are delivered)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.getsignal(sig))


def actor_options(
    plan: EnvPlan, resources: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """Ray `.options(...)` for an actor of the plan's role: its resources plus its runtime env."""
    return {**dict(resources), "runtime_env": plan.runtime_env(), **extra}
