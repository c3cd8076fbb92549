"""Build the environment plan for one role and render it to a Ray runtime env.

Precedence, highest first: the config's `env:` section > the user's environment > polyrl's
rules and platform defaults. A default is never written over a value the user set.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, Mapping, Sequence

from polyrl.envplan.rules import (
    BUNDLE_BACKENDS,
    ENGINE_BACKENDS,
    FORWARDED_PREFIXES,
    GPU_PLATFORMS,
    PLACEMENT_BUNDLE_VAR,
    POLYRL_DEFAULTS,
    RULES,
    EnvRule,
)
from polyrl.backends import ROLLOUT_BACKENDS
from polyrl.config.vocabulary import COLOCATED, PLACEMENTS
from polyrl.envplan.code_paths import PYTHONPATH, RAY_JOB_VAR, python_path_dirs
from polyrl.platform import Platform

logger = logging.getLogger(__name__)

ROLES = ("job", "trainer", "rollout")
BACKENDS = ROLLOUT_BACKENDS  # live: a plugin backend registered later is valid here too
MODES = ("sync", "async")

Source = str  # "user-env" | "config" | "platform-default" | "polyrl-default" | "rule:<id>" | "plugins"

_warned: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class EnvEntry:
    value: str
    source: Source
    reason: str
    link: str = ""

    def as_dict(self) -> dict[str, str]:
        out = {"value": self.value, "source": self.source, "reason": self.reason}
        if self.link:
            out["link"] = self.link
        return out


@dataclass(frozen=True)
class PlanContext:
    platform: Platform
    role: Literal["job", "trainer", "rollout"] = "job"
    backend: str = "native"
    _: KW_ONLY
    placement: str
    """Where the run's rollout engine lives (colocated / disaggregated,
    polyrl/config/vocabulary.py): the planned topology's (`TopologySpec.placement`)."""
    mode: str
    """sync / async: the planned topology's (`TopologySpec.mode`)."""
    backend_version: str | None = None
    hands_devices: bool = False
    """The actor reserves no devices through Ray and hands its engine processes the devices of
    its placement itself; only such an actor gets RAY_EXPERIMENTAL_NOSET_* (an actor reserving
    num_gpus must keep the visibility Ray gives it, or it sees every device of its node)."""
    visible_devices: tuple[int, ...] = ()
    """With hands_devices: the device ids of its placement (a TP-k replica's k ids on its node),
    set as its visible-devices variable (`handoff_variable`), which its engine processes inherit."""
    placement_bundle: int | None = None
    """The placement-group bundle index the actor is started in, for an actor that starts an
    engine placing Ray workers of its own into its bundles (`BUNDLE_BACKENDS`: TensorRT-LLM);
    set as PLACEMENT_BUNDLE_VAR (`EnvPlan.in_bundle`). None: not in a bundle, or not needed."""

    def __post_init__(self):
        for name, value, valid in (("role", self.role, ROLES), ("backend", self.backend, BACKENDS),
                                   ("placement", self.placement, PLACEMENTS),
                                   ("mode", self.mode, MODES)):
            if value not in valid:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(valid)}")


class EnvPlan:
    """`variable -> EnvEntry` for one role, in the order the entries were decided."""

    def __init__(self, context: PlanContext, entries: dict[str, EnvEntry]):
        self.context = context
        self.entries = entries

    def __getitem__(self, name: str) -> EnvEntry:
        return self.entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def values(self) -> dict[str, str]:
        return {name: e.value for name, e in self.entries.items()}

    def runtime_env(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A Ray `runtime_env` carrying exactly this plan's variables (merged into `base`)."""
        env = dict(base or {})
        env["env_vars"] = {**dict(env.get("env_vars") or {}), **self.values()}
        return env

    def in_bundle(self, index: int) -> "EnvPlan":
        """This plan for an actor started in placement-group bundle `index`: with
        PLACEMENT_BUNDLE_VAR (and whole visibility) when its engine places Ray workers in that
        bundle (`_bundle_entries`), unchanged otherwise.
        The placement code calls it once the bundle is known (polyrl/topology/launch_plan.py
        from the planned bundles, polyrl/placement/ray_groups.py from the live ones)."""
        context = dataclasses.replace(self.context, placement_bundle=index)
        added = _bundle_entries(context)
        if not added:
            return self
        entries = {k: v for k, v in self.entries.items() if k not in added}
        return EnvPlan(context, {**entries, **added})

    def to_json(self) -> dict[str, dict[str, str]]:
        return {name: e.as_dict() for name, e in self.entries.items()}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)


def hosts_engine(ctx: PlanContext) -> bool:
    """Whether processes of this role run the rollout engine: rollout actors, and in colocated
    placement the trainer ranks (the engine is colocated in the policy process). The engine's
    environment follows the engine into whichever process hosts it (verl PR 6664 set
    SGLANG_USE_AITER for server actors only, so a colocated engine on ROCm missed it)."""
    return ctx.role == "rollout" or (ctx.role == "trainer" and ctx.placement == COLOCATED)


def _platform_defaults(ctx: PlanContext) -> list[tuple[str, str, str, str]]:
    p = ctx.platform
    out = [(d.name, d.value, d.reason, d.link) for d in p.job_env_defaults()]
    if ctx.role == "rollout" and ctx.hands_devices and ctx.backend in ENGINE_BACKENDS \
            and p.name in GPU_PLATFORMS:
        reason = (f"the {ctx.backend} engine host reserves no devices through Ray (num_gpus=0) "
                  "and gives its engine processes exactly the devices of its placement; Ray must "
                  "not rewrite its visible-devices variable")
        out += [(k, v, reason, "https://github.com/verl-project/verl/pull/6664")
                for k, v in p.ray_noset_envvars().items()]
    if hosts_engine(ctx):
        out += [(d.name, d.value, d.reason, d.link) for d in p.rollout_env_defaults(ctx.backend)]
    return out


def build_plan(
    context: PlanContext,
    user_env: Mapping[str, str] | None = None,
    config_env: Mapping[str, str] | None = None,
    rules: tuple[EnvRule, ...] = RULES,
    code_dirs: Sequence[str] = (),
) -> EnvPlan:
    """The plan for `context.role`. Roles other than "job" include the job's variables too, so
    an actor's runtime env is complete on its own. `code_dirs`: the directories the config's
    plugins import from (`polyrl.envplan.code_paths.plugin_dirs`), added to PYTHONPATH."""
    user_env = dict(os.environ if user_env is None else user_env)
    config_env = {k: str(v) for k, v in (config_env or {}).items()}
    explicit = {**user_env, **config_env}
    entries: dict[str, EnvEntry] = {}

    def propose(name: str, value: str, source: Source, reason: str, link: str = "") -> None:
        if name in entries:  # first decision wins: earlier sources rank higher below
            return
        if name in config_env:
            entries[name] = _from_config(name, config_env[name], user_env, reason, link)
        elif name in user_env:
            entries[name] = EnvEntry(
                user_env[name], "user-env",
                f"set in your environment and kept (polyrl's {source} would be {value})", link)
        else:
            entries[name] = EnvEntry(value, source, reason, link)

    for name, value in config_env.items():
        propose(name, value, "config", "set in the config's env: section")
    roles = ("job",) if context.role == "job" else ("job", context.role)
    for role in roles:
        ctx = dataclasses.replace(context, role=role)
        for rule in rules:
            if rule.applies(ctx, explicit):
                for name, value in rule.variables.items():
                    propose(name, value, f"rule:{rule.id}", rule.reason, rule.link)
        for name, value, reason, link in _platform_defaults(ctx):
            propose(name, value, "platform-default", reason, link)
    for name, value, reason, link in POLYRL_DEFAULTS:
        propose(name, value, "polyrl-default", reason, link)
    for name in sorted(user_env):
        # the bundle is the placement's to name: a shell's value would be forwarded to every actor
        if name.startswith(FORWARDED_PREFIXES) and name not in entries and name != PLACEMENT_BUNDLE_VAR:
            entries[name] = EnvEntry(user_env[name], "user-env",
                                     "set in your environment; forwarded to every polyrl process")
    if PYTHONPATH not in entries:
        path = python_path_entry(user_env, code_dirs)
        if path is not None:
            entries[PYTHONPATH] = path
    if context.hands_devices and context.visible_devices:
        # the placement decides, not the launching shell: a CUDA_VISIBLE_DEVICES there describes
        # that machine, and any other value would put two replicas on one device
        entries[handoff_variable(context.platform)] = EnvEntry(
            ",".join(map(str, context.visible_devices)), "placement",
            "the devices of this engine host's placement (its replica's tensor-parallel devices "
            "on this node); its engine processes inherit them, and RAY_EXPERIMENTAL_NOSET_* keeps "
            "Ray from rewriting them")
    entries.update(_bundle_entries(context))
    return EnvPlan(context, entries)


def python_path_entry(user_env: Mapping[str, str], code_dirs: Sequence[str] = ()) -> EnvEntry | None:
    """PYTHONPATH for every process: your PYTHONPATH (absolute), then the plugins' directories,
    so a plugin named `module:name` imports in every Ray worker as it does on the driver
    (docs/plugins.md). None when there is neither, or inside a `ray job submit` job, whose
    runtime env places the code and writes PYTHONPATH itself."""
    if RAY_JOB_VAR in user_env:
        return None
    yours = python_path_dirs(user_env)
    added = [d for d in dict.fromkeys(os.path.abspath(d) for d in code_dirs) if d not in yours]
    if not yours and not added:
        return None
    value = os.pathsep.join([*yours, *added])
    why = ("so every Ray worker imports the plugins the config names by module path "
           "(module:name), as the driver does; docs/plugins.md")
    if not added:
        return EnvEntry(value, "user-env", f"set in your environment; forwarded to every polyrl process {why}")
    reason = f"the directories the config's plugins import from ({', '.join(added)})"
    if yours:
        reason = f"your PYTHONPATH, then {reason}"
    return EnvEntry(value, "plugins", f"{reason}, {why}")


def _bundle_entries(ctx: PlanContext) -> dict[str, EnvEntry]:
    """For an actor in a bundle whose engine starts Ray workers there (R2: scoped to
    `BUNDLE_BACKENDS`): PLACEMENT_BUNDLE_VAR, and on a device platform Ray's visibility left
    whole (RAY_EXPERIMENTAL_NOSET_*). The placement decides, not the shell or the config: another
    bundle would put the engine's workers beside another actor."""
    if ctx.placement_bundle is None or ctx.backend not in BUNDLE_BACKENDS or not hosts_engine(ctx):
        return {}
    entries = {PLACEMENT_BUNDLE_VAR: EnvEntry(
        str(ctx.placement_bundle), "placement",
        f"the placement-group bundle this actor starts in (Ray tells an actor its group, not its "
        f"bundle): the {ctx.backend} engine puts its Ray workers in the bundles of its replica "
        "starting here, a share of each device beside the polyrl actor of that bundle")}
    if ctx.platform.name in GPU_PLATFORMS:
        # TRT-LLM's workers copy this process's environment and take their device from
        # ray.get_gpu_ids(), which Ray maps through an inherited visible-devices list: narrowed
        # to this actor's device, a worker on another bundle's device reports the wrong one.
        # Left whole, each worker and this actor (Platform.local_device_indices) use physical ids.
        reason = (f"{ctx.backend}'s Ray workers inherit this actor's environment and find their "
                  "device by its physical id (ray.get_gpu_ids()); Ray must not narrow the "
                  "visible devices, which this actor then reads by physical id too")
        entries.update({k: EnvEntry(v, "placement", reason)
                        for k, v in ctx.platform.ray_noset_envvars().items()})
    return entries


def handoff_variable(platform: Platform) -> str:
    """The visible-devices variable an engine host sets for its engine processes: the one Ray's
    accelerator manager of the platform sets (HIP_VISIBLE_DEVICES on ROCm, whose physical ids it
    takes when ROCR_VISIBLE_DEVICES is unset): `Platform.handoff_devices_var`."""
    if platform.handoff_devices_var is None:
        raise ValueError(f"platform {platform.name} has no visible-devices variable to hand devices with")
    return platform.handoff_devices_var


def _from_config(name: str, value: str, user_env: Mapping[str, str], reason: str, link: str) -> EnvEntry:
    if name in user_env and user_env[name] != value:
        key = (name, user_env[name], value)
        if key not in _warned:
            _warned.add(key)
            logger.warning("env: the config sets %s=%s, overriding %s=%s from your environment",
                           name, value, name, user_env[name])
        reason = f"config env: section overrides your environment's {name}={user_env[name]}"
    elif reason != "set in the config's env: section":
        reason = f"set in the config's env: section (polyrl's default reason: {reason})"
    return EnvEntry(value, "config", reason, link)
