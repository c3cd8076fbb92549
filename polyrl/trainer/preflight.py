"""Pre-flight checks: set-up mistakes found before Ray and the model start, each as one line.

Each check is a pure function of the resolved config, the loaded datasets and the model's config
(transformers `PretrainedConfig`, or anything with the same attributes), and raises `ConfigError`
with one problem naming the config key and the fix. `check_job` runs them all; the trainer calls
it after loading the tokenizer and the datasets, before the platform and Ray start, so a run
that cannot work fails in seconds instead of after minutes of start-up (or hours into training).
"""

from __future__ import annotations

from typing import Any, Sequence

from polyrl.agents.preflight import check_agent
from polyrl.backends import capabilities
from polyrl.config import ConfigError
from polyrl.job import JobConfig

CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where Hugging Face model configs keep the longest sequence the model was built for."""


def check_job(cfg: JobConfig, train_set: Sequence[Any], val_set: Sequence[Any] | None,
              model_config: Any | None) -> None:
    """Every pre-flight check; raises `ConfigError` (one problem) at the first failure.

    `cfg`: the JobConfig; `train_set` / `val_set`: the loaded datasets (items have `prompt_ids`);
    `model_config`: the policy's transformers config, or None where it is not at hand (skips the
    context-length check)."""
    check_platform(cfg)
    check_placement(cfg)
    check_engine_capabilities(cfg)
    check_rollout_engine(cfg)
    check_reward_function(cfg)
    check_agent(cfg.agent, train_set, val_set)  # tools, black-box agent, environment names
    check_batch_sizes(cfg, train_set, val_set)
    longest = longest_prompt(train_set, val_set)
    check_model_context(cfg, longest, model_config)
    check_max_model_len(cfg, longest)
    check_lora(cfg, model_config)


def check_rollout_engine(cfg: JobConfig) -> None:
    """The engine package (present, in its supported range) and its launch arguments, checked
    with the code the launch itself runs (rollout/factory.py), so the dry run, pre-flight and the
    launch refuse the same things."""
    from polyrl.platform import get_platform
    from polyrl.rollout.factory import EngineUnavailable, check_engine_launch, require_backend

    try:
        if cfg.ray.address in (None, "local"):
            check_engine_launch(cfg.rollout, cfg.model.path, get_platform(cfg.platform))
        else:  # a CPU driver of a GPU cluster must not judge FP8 by its own platform
            require_backend(cfg.rollout.backend)
    except (EngineUnavailable, ValueError) as exc:
        raise ConfigError([str(exc)]) from None


def check_engine_capabilities(cfg: JobConfig) -> None:
    """What the run asks of its engine, against what the engine declares
    (`EngineCapabilities`, polyrl/backends.py; a plugin's own declaration), never its name.
    Tensor parallelism is checked first of all, by `Trainer.setup` (polyrl/trainer/loop.py)."""
    backend = cfg.rollout.backend
    caps = capabilities(backend)
    streaming = not cfg.topology.on_policy  # the replicas take weights mid-generation
    if streaming and cfg.async_.partial_rollout == "abort" and not caps.partial_rollout:
        raise ConfigError([f"async.partial_rollout=abort: the {backend} engine declares no partial_rollout "
                           "(abort_all returning each request's tokens so far, continued later); "
                           "set async.partial_rollout=wait"])


def check_platform(cfg: JobConfig) -> None:
    """`platform=cuda` on a machine without CUDA (and the like) fails here, not inside Ray."""
    from polyrl.platform import PlatformError, get_platform

    try:
        get_platform(cfg.platform)
    except PlatformError as exc:
        raise ConfigError([f"platform={cfg.platform}: {exc}"]) from None


MAX_RANKS_PER_CORE = 4
"""Rank processes a local CPU run starts per core. Ranks may share cores (the Ray instance is
sized to hold them all; slower, not wrong), but each is a process with its own torch, model and
engine: 8 ranks took 21 s to start on 2 cores, and 64 stalled for minutes and filled memory."""


def check_placement(cfg: JobConfig, platform: Any = None) -> None:
    """The run's ranks fit the machine a local Ray instance runs on: on a device platform the
    launch plan's placement (polyrl/placement/planner.py) on this one node; on CPU at most
    `MAX_RANKS_PER_CORE` rank processes per core, and the CPUs they reserve within an explicit
    ray.num_cpus (or this machine's cores with ray.address=local, which `init_ray` starts so).
    A cluster (ray.address) is checked once joined (`Trainer.setup`).
    `platform`: the platform to plan for (default: `cfg.platform` on this machine)."""
    import os

    from polyrl.platform import get_platform
    from polyrl.topology.launch_plan import plan_launch
    from polyrl.topology.resources import cpus_needed, num_rollout_ranks

    if cfg.ray.address not in (None, "local"):
        return
    platform = platform or get_platform(cfg.platform)
    if platform.ray_resource:
        error = plan_launch(cfg, platform, nodes=1).placement_error
        if error:
            raise ConfigError([f"{error} (this machine: {platform.describe()})"])
        return
    policy, rollout = cfg.actor.world_size, num_rollout_ranks(cfg)
    keys = "actor.world_size" + (" or rollout.num_replicas" if rollout else "")
    per_rank, needed = cpus_needed(cfg)
    if cfg.ray.num_cpus is not None and needed > cfg.ray.num_cpus:
        raise ConfigError([
            f"ray.num_cpus={cfg.ray.num_cpus}: the run's {policy + rollout} ranks reserve {needed} CPUs "
            f"({per_rank} each); lower {keys} or actor.num_cpus_per_worker, or raise ray.num_cpus"])
    cores = os.cpu_count() or 1
    if cfg.ray.address == "local" and needed > cores:  # init_ray: a Ray of this machine's cores
        raise ConfigError([
            f"ray.address=local starts Ray with this machine's {cores} CPUs, but the run's "
            f"{policy + rollout} ranks reserve {needed} ({per_rank} each); lower {keys} or "
            "actor.num_cpus_per_worker, or leave ray.address unset (a Ray sized for the ranks)"])
    limit = MAX_RANKS_PER_CORE * cores
    if policy + rollout > limit:
        ranks = (f"{policy} policy + {rollout} rollout ranks (actor.world_size={policy}, "
                 f"rollout.num_replicas={cfg.rollout.num_replicas})" if rollout
                 else f"actor.world_size={policy}: {policy} policy ranks")
        raise ConfigError([
            f"{ranks} cannot be placed on this machine ({cores} "
            f"CPU cores, no GPUs): a local run starts at most {limit} rank processes "
            f"({MAX_RANKS_PER_CORE} per core); lower {keys}, or join a larger cluster with ray.address"])


def check_reward_function(cfg: JobConfig) -> None:
    """reward.custom_function imports and names a function (its module's own errors included)."""
    spec = cfg.reward.custom_function
    if spec is None:
        return
    from polyrl.rewards.functions import make_scorer
    from polyrl.rewards.registry import load_function

    try:
        fn = load_function(spec)
    except ValueError as exc:  # load_function's own messages already name the key
        raise ConfigError([str(exc).splitlines()[0]]) from None
    except Exception as exc:  # the user's module raised while it was imported
        where = _traceback_line(exc)
        raise ConfigError([f"reward.custom_function={spec}: importing it raised "
                           f"{type(exc).__name__}: {exc}{where}; fix the module"]) from None
    # verl's compute_score or TRL's batched fn(prompts, completions, **columns): neither is a
    # ConfigError naming both forms (the dry run stops here too)
    make_scorer(fn, dict(cfg.reward.custom_function_kwargs), who=f"reward.custom_function={spec}")


def check_batch_sizes(cfg: JobConfig, train_set: Sequence[Any], val_set: Sequence[Any] | None) -> None:
    """A training batch must fit in the training set (after bad and over-long rows are dropped)."""
    size, n = cfg.data.train_batch_size, len(train_set)
    if size > n and cfg.data.drop_last:
        raise ConfigError([
            f"data.train_batch_size={size} is larger than the training set ({n} prompts after "
            f"filtering): not one full batch; lower data.train_batch_size to at most {n}, add "
            "data, or set data.drop_last=false"])
    val_size = cfg.data.val_batch_size
    if val_set is not None and val_size is not None and val_size > len(val_set):
        raise ConfigError([
            f"data.val_batch_size={val_size} is larger than the validation set ({len(val_set)} "
            "prompts); lower it or leave it unset (one batch of the whole set)"])


def longest_prompt(train_set: Sequence[Any], val_set: Sequence[Any] | None) -> int:
    """Tokens of the longest prompt either split holds."""
    sets = [s for s in (train_set, val_set) if s]
    return max((len(p.prompt_ids) for s in sets for p in s), default=0)


def model_context_length(model_config: Any) -> int | None:
    """The longest sequence the model takes, from its config; None if the config does not say."""
    for name in CONTEXT_ATTRIBUTES:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_model_context(cfg: JobConfig, longest: int, model_config: Any | None) -> None:
    """Longest prompt + rollout.response_length must fit the model's context window."""
    context = model_context_length(model_config) if model_config is not None else None
    need = longest + cfg.rollout.response_length
    if context is not None and need > context:
        raise ConfigError([
            f"the longest prompt ({longest} tokens) + rollout.response_length="
            f"{cfg.rollout.response_length} = {need} tokens exceeds the model's context of "
            f"{context} tokens ({cfg.model.path}); lower rollout.response_length to at most "
            f"{max(context - longest, 0)}, or data.max_prompt_length to drop long prompts"])


def check_max_model_len(cfg: JobConfig, longest: int) -> None:
    """An explicit rollout.max_model_len below prompt + response would clip responses silently."""
    limit = cfg.rollout.max_model_len
    need = longest + cfg.rollout.response_length
    if limit is not None and limit < need:
        raise ConfigError([
            f"rollout.max_model_len={limit} is shorter than the longest prompt ({longest} tokens) "
            f"+ rollout.response_length={cfg.rollout.response_length} = {need}: responses would be "
            f"cut short; set rollout.max_model_len={need} or leave it unset (computed from the data)"])


def check_lora(cfg: JobConfig, model_config: Any | None) -> None:
    """model.lora_target_modules must name linear layers of the model and model.lora_rank fit
    them (polyrl/training/lora.py `check_lora_fits`, on the meta device)."""
    if not cfg.model.enabled or model_config is None:
        return
    from polyrl.training.lora import LoraError, check_lora_fits

    try:
        check_lora_fits(model_config, cfg.model, cfg.model.trust_remote_code)
    except LoraError as exc:
        raise ConfigError([str(exc)]) from None
    except (ValueError, OSError, ImportError):  # not a causal LM transformers knows: loading says so
        return


def _traceback_line(exc: BaseException) -> str:
    """" (file F, line N)" of the innermost frame, or of a SyntaxError's position."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return ""  # its message already holds "(file, line N)"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})" if tb is not None else ""
