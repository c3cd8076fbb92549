"""`polyrl doctor`: inspect the real machine and name known-bad combinations before a run."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Literal, Mapping

from polyrl.backends import (
    PACKAGED_BACKENDS,
    ROLLOUT_BACKENDS,
    BackendError,
    EngineCapabilities,
    features_below_floor,
    is_import_path,
    version_problem,
)
from polyrl.cli.common import add_config_args, load_job_config
from polyrl.distributed.topologies import TopologySpec
from polyrl.envplan import PlanContext, build_plan
from polyrl.platform import Platform, PlatformError, get_platform

Level = Literal["ok", "info", "warn", "error"]


@dataclass
class Finding:
    level: Level
    topic: str
    message: str


CORE_PACKAGES = ("torch", "ray", "transformers")
PLATFORM_PACKAGES = ("torch_npu",)


def packages() -> tuple[str, ...]:
    """What doctor reports versions of: polyrl's core, every rollout backend's engine package
    (from the one backend list, plugins included), and platform add-ons."""
    engines = tuple(module for module, _extra in PACKAGED_BACKENDS.values())
    return CORE_PACKAGES + engines + PLATFORM_PACKAGES


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in packages():
        out[name] = None
        for dist in (_DISTRIBUTIONS.get(name), name):  # tensorrt_llm is installed as tensorrt-llm
            try:
                out[name] = version(dist) if dist else None
            except PackageNotFoundError:
                continue
            if out[name]:
                break
    return out


_DISTRIBUTIONS = {b.package: b.distribution for b in map(ROLLOUT_BACKENDS.get, ROLLOUT_BACKENDS.names())
                  if b.package and b.distribution}


def engine_version_findings(versions: dict[str, str | None], backend: str) -> list[Finding]:
    """One line per installed engine outside the versions polyrl supports: an error for the
    run's own backend (its start refuses it), a warning for the others."""
    found = []
    for name in ROLLOUT_BACKENDS.names():
        package = ROLLOUT_BACKENDS.get(name).package
        problem = version_problem(name, versions.get(package)) if package else None
        if problem:
            found.append(Finding("error" if name == backend else "warn", package, problem))
    return found


CAPABILITY_LABELS = {"tensor_parallel": "tensor parallel", "sleep": "sleep frees memory",
                     "partial_rollout": "partial rollout", "lora_adapters": "LoRA adapters",
                     "fp8": "FP8", "batch_invariant": "batch-invariant"}
"""How doctor names each `EngineCapabilities` flag (trainer_logprob_dtypes is spelled out)."""


def describe_capabilities(caps: EngineCapabilities) -> str:
    """One line: what the engine can and cannot do, and the dtypes of its trainer-exact log-probs."""
    can = [label for field, label in CAPABILITY_LABELS.items() if getattr(caps, field)]
    cannot = [label for field, label in CAPABILITY_LABELS.items() if not getattr(caps, field)]
    dtypes = ", ".join(sorted(caps.trainer_logprob_dtypes)) or "none (old log-probs recomputed)"
    return (f"can: {', '.join(can) or 'nothing declared'}; cannot: {', '.join(cannot) or '-'}; "
            f"log-probs equal the trainer's in: {dtypes}")


def capability_findings(versions: Mapping[str, str | None], backend: str,
                        platform: str | None = None) -> list[Finding]:
    """What each installed engine can do (its declared `EngineCapabilities`, polyrl/backends.py),
    the run's own backend included when it is a plugin named by import path, and one warning per
    declared capability its build for `platform` (polyrl's platform name) lacks
    (`EngineCapabilities.unavailable`: runs asking for it there are refused). A plugin that
    cannot be loaded is an error when the run uses it, else a warning."""
    names = ROLLOUT_BACKENDS.names()
    if is_import_path(backend) and backend not in names:
        names.append(backend)
    found = []
    for name in names:
        try:
            spec = ROLLOUT_BACKENDS.get(name)
        except (BackendError, KeyError) as exc:
            found.append(Finding("error" if name == backend else "warn", f"{name} engine", str(exc)))
            continue
        if spec.package is not None and not versions.get(spec.package):
            continue  # not installed: its package line says so
        found.append(Finding("info", f"{name} engine", describe_capabilities(spec.capabilities)))
        installed = versions.get(spec.package) if spec.package else None
        below = features_below_floor(name, installed)
        if below:
            lacking = ", ".join(f"{c} (needs >={floor})" for c, floor in below)
            found.append(Finding("warn", f"{name} engine",
                                 f"{spec.distribution or spec.package} {installed} is below the version floor of: "
                                 f"{lacking}; runs asking for them are refused"))
        for capability, where, why in spec.capabilities.unavailable:
            if where == platform and getattr(spec.capabilities, capability):
                label = CAPABILITY_LABELS.get(capability, capability.replace("_", " "))
                found.append(Finding("warn", f"{name} engine",
                                     f"{label} unavailable on {platform}: {why}; runs asking for it "
                                     "here are refused"))
    return found


def check_environment(platform: Platform, env: Mapping[str, str], topology: TopologySpec,
                      backend: str = "native") -> list[Finding]:
    """Known-bad combinations of platform, engines and environment variables in a run of
    `topology` (the config's planned `TopologySpec`) (pure)."""
    found: list[Finding] = []
    for var in platform.visible_devices_vars:
        if var in env and env[var].strip() == "":
            found.append(Finding("error", var, f"{var} is set but empty: it hides every device. "
                                 f"Unset it or list device ids."))
    if platform.name == "rocm" and env.get("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO") == "1":
        found.append(Finding("warn", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO",
                             "=1 on ROCm: Ray clears HIP_VISIBLE_DEVICES for num_gpus=0 server "
                             "actors, hiding every GPU from them (verl PR 6664)"))
    if env.get("NCCL_CUMEM_ENABLE") == "1" and backend == "vllm" and not topology.colocated_engine:
        found.append(Finding("warn", "NCCL_CUMEM_ENABLE",
                             "=1 with disaggregated vLLM weight sync over NCCL is known to hang or "
                             "crash; keep it only if your system needs cuMem NCCL (GB300 class)"))
    if env.get("TLLM_DISABLE_NVLS_MNNVL") == "1":
        job_plan = build_plan(PlanContext(platform, "job", placement=topology.placement, mode=topology.mode),
                              env, {})
        if "NCCL_NVLS_ENABLE" not in job_plan or not job_plan["NCCL_NVLS_ENABLE"].source.startswith("rule:"):
            found.append(Finding("info", "TLLM_DISABLE_NVLS_MNNVL",
                                 "=1 has no effect here: the NVLS/MNNVL workaround applies only "
                                 "to CUDA capability >= 10 (Blackwell)"))
        else:
            found.append(Finding("warn", "TLLM_DISABLE_NVLS_MNNVL",
                                 "=1 sets NCCL_NVLS_ENABLE=0 and NCCL_MNNVL_ENABLE=0 for the job; "
                                 "this hangs synchronous multi-node TRT-LLM rollout"))
    if env.get("POLYRL_PLATFORM") and env["POLYRL_PLATFORM"] != platform.name:
        found.append(Finding("error", "POLYRL_PLATFORM",
                             f"asks for {env['POLYRL_PLATFORM']} but {platform.name} is in use"))
    return found


def check_ray(address: str | None) -> Finding:
    if not address:
        return Finding("ok", "ray", "no RAY_ADDRESS: polyrl train starts a local Ray instance")
    if address == "auto":
        return Finding("info", "ray", "RAY_ADDRESS=auto: polyrl joins the cluster started with "
                       "`ray start --head` on this node")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            return Finding("ok", "ray", f"Ray at {address} is reachable")
    except (OSError, ValueError) as exc:
        return Finding("error", "ray", f"Ray at {address} is not reachable: {exc}")


def collect(topology: TopologySpec, env: Mapping[str, str] | None = None,
            backend: str = "native") -> list[Finding]:
    """Every finding for a run of `topology` with the `backend` engine on this machine."""
    env = dict(os.environ if env is None else env)
    findings: list[Finding] = []
    try:
        platform = get_platform(None)
    except PlatformError as exc:
        return [Finding("error", "platform", str(exc))]
    findings.append(Finding("ok", "platform", platform.describe()))
    for var in platform.visible_devices_vars:
        findings.append(Finding("info", var, f"= {env[var]!r}" if var in env else "unset"))
    versions = package_versions()
    for name, ver in versions.items():
        if ver:
            findings.append(Finding("ok", name, ver))
        elif name in ("torch", "ray", "transformers"):
            findings.append(Finding("error", name, "not installed (pip install polyrl)"))
        else:
            findings.append(Finding("info", name, "not installed"))
    findings.extend(engine_version_findings(versions, backend))
    findings.extend(capability_findings(versions, backend, platform.name))
    findings.append(check_ray(env.get("RAY_ADDRESS")))
    findings.extend(check_environment(platform, env, topology, backend))
    return findings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this machine, its engines and its environment",
                       description="Inspect the real machine: platform and devices, visible-"
                       "device variables, engine versions and what each installed engine can "
                       "do, Ray reachability and known-bad settings. Exits 1 when something is "
                       "an error.")
    add_config_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    style = {"ok": "green", "info": "cyan", "warn": "yellow", "error": "bold red"}
    cfg = load_job_config(args)
    findings = collect(cfg.topology, backend=cfg.rollout.backend)
    for f in findings:
        console.print(f"[{style[f.level]}]{f.level:>5}[/] {escape(f.topic)}: {escape(f.message)}", highlight=False)
    errors = sum(f.level == "error" for f in findings)
    warns = sum(f.level == "warn" for f in findings)
    console.print(f"{errors} error(s), {warns} warning(s)")
    return 1 if errors else 0
