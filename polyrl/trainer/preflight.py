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
from polyrl.algorithms.plugin_checks import check_signatures
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
    check_weights(cfg)
    check_placement(cfg)
    check_memory(cfg, model_config)
    check_engine_capabilities(cfg)
    check_rollout_engine(cfg)
    check_reward_function(cfg)
    check_signatures(cfg.algorithm)  # a plugin estimator / loss that cannot take polyrl's call
    check_agent(cfg.agent, train_set, val_set)  # tools, black-box agent, environment names
    check_batch_sizes(cfg, train_set, val_set)
    longest = longest_prompt(train_set, val_set)
    check_model_context(cfg, longest, model_config)
    check_max_model_len(cfg, longest)
    check_lora(cfg, model_config)
    check_sequence_parallel(cfg, model_config)
    check_tensor_parallel(cfg, model_config)
    check_router_replay(cfg, model_config)
    check_expert_parallel(cfg, model_config)
    check_colocated_teacher(cfg)
    check_vision(cfg, train_set, val_set, model_config)


def check_weights(cfg: JobConfig) -> None:
    """Every model the run loads (policy, critic, distillation teacher) has weights, and each
    safetensors file is as long as its header says: read from the headers alone, so a missing,
    truncated or corrupt file is one line naming its key here, not a SafetensorError inside
    the actors after Ray started. A directory that is not a model at all is left to the check
    that names it (loading the tokenizer, `check_teacher_tokenizer`)."""
    import json
    from pathlib import Path

    from polyrl.builtin import resolve
    from polyrl.trainer.checkpoint import _safetensors_damage

    models = [("model.path", cfg.model.path)]
    if cfg.critic.enable and cfg.critic.path:
        models.append(("critic.path", cfg.critic.path))
    if cfg.distill.enabled and cfg.distill.teacher:
        models.append(("distill.teacher", cfg.distill.teacher))
    for key, path in models:
        try:
            directory = Path(resolve(path)).expanduser()
        except FileNotFoundError:
            continue
        if not (directory / "config.json").is_file():
            continue
        files = sorted(directory.glob("*.safetensors"))
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                named = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise ConfigError([f"{key}: {index} is unreadable ({exc}); re-copy the model"]) from None
            missing = [name for name in named if not (directory / name).is_file()]
            if missing:
                raise ConfigError([f"{key}: {directory} lacks {missing[0]}, which its "
                                   f"model.safetensors.index.json names ({len(missing)} of {len(named)} "
                                   "shards missing); copy the whole model directory"])
        if not files and not any(directory.glob("pytorch_model*.bin")):
            raise ConfigError([f"{key}: {directory} holds no weights (no *.safetensors or pytorch_model*.bin "
                               "beside its config.json); copy the model's weight files there, or give a "
                               "complete model directory (e.g. the output of `polyrl export`)"])
        for file in files:
            try:
                problem = _safetensors_damage(file)
            except (KeyError, TypeError, AttributeError, IndexError) as exc:  # a header of the wrong shape
                problem = f"unreadable header ({type(exc).__name__}: {exc})"
            if problem:
                raise ConfigError([f"{key}: {file} is damaged ({problem}); re-copy or re-export the model"])


def check_rollout_engine(cfg: JobConfig) -> None:
    """The engine package (present, in its supported range) and its launch arguments, checked
    with the code the launch itself runs (rollout/factory.py), so the dry run, pre-flight and the
    launch refuse the same things."""
    from polyrl.platform import get_platform
    from polyrl.rollout.factory import EngineUnavailable, check_engine_launch, require_backend

    try:
        if cfg.ray.address in (None, "local"):
            check_engine_launch(cfg.rollout, cfg.model.path, get_platform(cfg.platform),
                                colocated=cfg.topology.colocated_engine)
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


def check_router_replay(cfg: JobConfig, model_config: Any | None) -> None:
    """actor.router_replay (docs/moe.md): R3 needs an engine that returns the routes it used, and
    any replay a mixture-of-experts policy (transformers' Qwen3-MoE / Qwen2-MoE routers)."""
    mode = cfg.actor.router_replay
    if mode == "off":
        return
    backend = cfg.rollout.backend
    if mode == "R3" and not capabilities(backend).routed_experts:
        raise ConfigError([f"actor.router_replay=R3: the {backend} engine declares no routed_experts (the experts "
                           "each sampled token was routed to); set actor.router_replay=R2 or off, or "
                           "rollout.backend=native (docs/moe.md)"])
    if mode == "R3":  # the engine build's platform and version floor for routes (polyrl/backends.py)
        from polyrl.backends import feature_platform_problem, feature_version_problem, installed_engine_version
        from polyrl.platform import get_platform

        local = cfg.ray.address in (None, "local")  # a cluster's own platform is not seen from here
        platform = cfg.platform if cfg.platform != "auto" else get_platform().name if local else None
        problem = (feature_platform_problem(backend, "routed_experts", platform, "actor.router_replay=R3",
                                            "set actor.router_replay=R2 or off, or rollout.backend=native "
                                            "(docs/moe.md)")
                   or feature_version_problem(backend, "routed_experts", installed_engine_version(backend),
                                              "actor.router_replay=R3"))
        if problem:
            raise ConfigError([problem])
    model_type = getattr(model_config, "model_type", None)
    if model_config is not None and model_type not in ("qwen3_moe", "qwen2_moe"):
        raise ConfigError([f"actor.router_replay={mode}: model.path is a {model_type} model, not a Qwen3-MoE / "
                           "Qwen2-MoE with routers to replay (docs/moe.md); set actor.router_replay=off"])


def check_expert_parallel(cfg: JobConfig, model_config: Any | None) -> None:
    """actor.expert_parallel_size (docs/moe.md): a Qwen3-MoE / Qwen2-MoE policy whose num_experts
    it divides (the mesh's own checks ran in the config)."""
    ep = cfg.actor.expert_parallel_size
    if ep == 1 or model_config is None:
        return
    experts = getattr(model_config, "num_experts", None)
    if getattr(model_config, "model_type", None) not in ("qwen3_moe", "qwen2_moe") or not experts:
        raise ConfigError([f"actor.expert_parallel_size={ep}: model.path is a {model_config.model_type} model, not a "
                           "Qwen3-MoE / Qwen2-MoE with experts to split (docs/moe.md); set actor.expert_parallel_size=1"])
    if experts % ep:
        raise ConfigError([f"actor.expert_parallel_size={ep} does not divide the model's num_experts={experts}; "
                           f"set it to a divisor of {experts}"])


def check_colocated_teacher(cfg: JobConfig) -> None:
    """distill.placement=colocated builds the teacher on every policy rank with the policy's mesh
    (polyrl/workers/policy.py `teacher_engine(cfg, cfg.actor, ...)`): under
    actor.tensor_parallel_size its heads, key-value heads and MLP width must divide by tp
    (training/tensor_parallel.py `check_divisible`), and under actor.expert_parallel_size a
    Qwen3-MoE / Qwen2-MoE teacher's num_experts by ep. A dense teacher under ep keeps its MLPs
    whole (training/fsdp2.py: a frozen model without experts is not split). A teacher on its own
    ranks (distill.placement=disaggregated) runs without tp or ep (workers/teacher.py)."""
    from polyrl.config.vocabulary import COLOCATED
    from polyrl.distributed.topologies import teacher_placement_of

    tp, ep = cfg.actor.tensor_parallel_size, cfg.actor.expert_parallel_size
    if teacher_placement_of(cfg) != COLOCATED or (tp == 1 and ep == 1):
        return
    config = teacher_config(cfg)
    if config is None:
        return  # a teacher that is not there is reported by the checks that load it
    where = f"distill.teacher={cfg.distill.teacher} (distill.placement=colocated: on the policy's mesh)"
    if tp > 1:
        from polyrl.training.tensor_parallel import TensorParallelError, check_divisible

        try:
            check_divisible(language_config(config), tp)
        except TensorParallelError as exc:
            raise ConfigError([f"{where}: {exc}, or set distill.placement=disaggregated"]) from None
    experts = getattr(config, "num_experts", None)
    if ep > 1 and getattr(config, "model_type", None) in ("qwen3_moe", "qwen2_moe") and experts and experts % ep:
        raise ConfigError([f"{where}: actor.expert_parallel_size={ep} does not divide the teacher's "
                           f"num_experts={experts}; set it to a divisor of both the policy's and {experts}, "
                           "or set distill.placement=disaggregated"])


def teacher_config(cfg: JobConfig) -> Any | None:
    """distill.teacher's transformers config, or None where it cannot be read here."""
    from pathlib import Path

    from transformers import AutoConfig

    from polyrl.builtin import resolve

    try:
        directory = Path(resolve(cfg.distill.teacher)).expanduser()
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError, KeyError):
        return None


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
    teacher = cfg.distill.own_ranks  # processes too, though `keys` above names none of theirs
    if policy + rollout + teacher > limit:
        ranks = (f"{policy} policy + {rollout} rollout ranks (actor.world_size={policy}, "
                 f"rollout.num_replicas={cfg.rollout.num_replicas})" if rollout
                 else f"actor.world_size={policy}: {policy} policy ranks")
        if teacher:
            ranks += f" + {teacher} teacher ranks (distill.world_size={teacher})"
            keys += " or distill.world_size"
        raise ConfigError([
            f"{ranks} cannot be placed on this machine ({cores} "
            f"CPU cores, no GPUs): a local run starts at most {limit} rank processes "
            f"({MAX_RANKS_PER_CORE} per core); lower {keys}, or join a larger cluster with ray.address"])


ENGINE_MEMORY = {"native": "copy", "vllm": "share", "sglang": "share"}
"""How a colocated engine uses its rank's device (polyrl/training/memory_floor.py `Setting.engine`):
the native engine keeps its own copy of the weights, asleep or awake; vLLM and SGLang take
rollout.gpu_memory_utilization of the device while awake and free it asleep; any other engine is
counted by its weights alone while awake (a floor)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_memory(cfg: JobConfig, model_config: Any | None, platform: Any = None) -> None:
    """A model that cannot fit a policy rank even sharded fails here, naming the memory a rank needs
    at least, what a rank has and the settings that would fit (polyrl/training/memory_floor.py
    `rank_floor`, `fitting_changes`), then on a device that an engine rank holds its weights
    (`check_engine_memory`). The floor counts what the code surely allocates for the
    policy, its reference, a colocated distillation teacher and a colocated engine (no activations
    or critic), so a run it
    refuses cannot fit. On a device platform a rank has one device; on a CPU a local run's ranks
    share the host's memory, and a cluster's CPU nodes (ray.address) are not checked.
    `model_config`: config.json as a dict or a transformers config (None: not checked);
    `platform`: the one to plan for (default: `cfg.platform` on this machine)."""
    from polyrl.platform import get_platform
    from polyrl.topology.resources import num_rollout_ranks
    from polyrl.training import memory_floor as mf

    if model_config is None:
        return
    platform = platform or get_platform(cfg.platform)
    if not platform.ray_resource and cfg.ray.address not in (None, "local"):
        return
    device = mf.device_memory_bytes(platform)
    try:
        shape = mf.model_shape(model_config, cfg.model.trust_remote_code) if device else None
    except ValueError as exc:
        raise ConfigError([f"model.path: {cfg.model.path}'s {exc}"]) from None
    if shape is None:
        return
    actor, rollout = cfg.actor, cfg.rollout
    on_device = bool(platform.ray_resource)
    knobs = mf.Knobs(world_size=actor.world_size, strategy=actor.strategy, offload=actor.offload,
                     master=DTYPE_BYTES[actor.param_dtype], lora_rank=cfg.model.lora_rank,
                     colocated_engine=cfg.topology.colocated_engine,
                     expert_parallel=getattr(actor, "expert_parallel_size", 1),
                     tensor_parallel=actor.tensor_parallel_size, sequence_parallel=actor.sequence_parallel_size)
    setting = mf.Setting(compute=DTYPE_BYTES[actor.compute_dtype], reference=cfg.algorithm.uses_reference,
                         lora_targets=cfg.model.lora_target_modules,
                         engine=ENGINE_MEMORY.get(rollout.backend, "weights"),
                         engine_dtype=DTYPE_BYTES[rollout.dtype], tensor_parallel=rollout.tensor_parallel_size,
                         memory_share=rollout.gpu_memory_utilization, device_bytes=device, on_device=on_device,
                         other_ranks=0 if on_device else num_rollout_ranks(cfg), teacher=colocated_teacher_params(cfg))
    need, phase = mf.rank_need(shape, knobs, setting)
    have = mf.available_bytes(knobs, setting)
    if need > have:
        raise ConfigError([memory_message(cfg, shape, knobs, setting, need, phase, have, platform)])
    if on_device:
        check_engine_memory(cfg, shape, setting, platform)


def colocated_teacher_params(cfg: JobConfig) -> int:
    """Parameters of a distillation teacher held on the policy ranks (distill.placement=colocated),
    from its config.json; 0 when there is none or its size cannot be told."""
    import json
    from pathlib import Path

    from polyrl.builtin import resolve
    from polyrl.config.vocabulary import COLOCATED
    from polyrl.distributed.topologies import teacher_placement_of
    from polyrl.training import memory_floor as mf

    if teacher_placement_of(cfg) != COLOCATED:
        return 0
    try:
        config = json.loads((Path(resolve(cfg.distill.teacher)).expanduser() / "config.json").read_text())
    except (FileNotFoundError, OSError, ValueError):
        return 0  # a teacher that is not there is reported by the checks that load it
    try:
        shape = mf.model_shape(config, cfg.model.trust_remote_code)
    except ValueError as exc:
        raise ConfigError([f"distill.teacher: {cfg.distill.teacher}'s {exc}"]) from None
    return shape.params if shape is not None else 0


def check_engine_memory(cfg: JobConfig, shape: Any, setting: Any, platform: Any) -> None:
    """An engine rank must hold its share of the weights (rollout.dtype), before any KV cache:
    vLLM and SGLang within rollout.gpu_memory_utilization of the device."""
    from polyrl.training import memory_floor as mf
    from polyrl.training.memory_plan import GiB as gib

    need, have = mf.engine_need(shape, setting)
    if need <= have:
        return
    r = cfg.rollout
    within = (f"its rollout.gpu_memory_utilization={r.gpu_memory_utilization} of a {platform.name} device's "
              f"{setting.device_bytes / gib:.1f} GiB is {have / gib:.1f} GiB" if setting.engine == "share"
              else f"a {platform.name} device has {have / gib:.1f} GiB")
    changes = mf.engine_changes(shape, setting, capabilities(r.backend).tensor_parallel)
    fix = ("fits: " + "; ".join(changes)) if changes else "use a smaller model or devices with more memory"
    raise ConfigError([f"rollout.backend={r.backend}: the engine's {r.dtype} weights of model.path={cfg.model.path} "
                       f"({shape.params / 1e9:.2f}B parameters) need {need / gib:.1f} GiB per engine rank at "
                       f"rollout.tensor_parallel_size={r.tensor_parallel_size}, but {within}; {fix}"])


def memory_message(cfg: JobConfig, shape: Any, knobs: Any, setting: Any, need: float, phase: str,
                   have: float, platform: Any) -> str:
    """One line: the model, the rank's need and what it is made of, what a rank has, what fits."""
    from polyrl.training import memory_floor as mf
    from polyrl.training.memory_plan import GiB as gib

    terms = mf.rank_floor(shape, knobs, setting)[phase]
    parts = ", ".join(f"{name} {value / gib:.1f}" for name, value in terms.items() if value)
    run = (f"actor.strategy={knobs.strategy}, actor.world_size={knobs.world_size}, "
           f"actor.param_dtype={cfg.actor.param_dtype}")
    if knobs.tensor_parallel > 1:
        run += f", actor.tensor_parallel_size={knobs.tensor_parallel}"
    if knobs.offload:
        run += ", actor.offload=true"
    if knobs.lora_rank:
        run += f", model.lora_rank={knobs.lora_rank}"
    if knobs.colocated_engine:
        run += f", rollout.placement=colocated ({cfg.rollout.backend} engine"
        run += (f" at rollout.gpu_memory_utilization={setting.memory_share})" if setting.engine == "share"
                and setting.on_device else ")")
    if setting.on_device:
        where = f"a {platform.name} device has {have / gib:.1f} GiB ({platform.device_name or platform.name})"
    else:
        ranks = knobs.world_size + setting.other_ranks
        where = (f"a rank has {have / gib:.1f} GiB (this machine's {setting.device_bytes / gib:.1f} GiB shared "
                 f"by {ranks} rank{'s' if ranks > 1 else ''})")
    changes = mf.fitting_changes(shape, knobs, setting)
    fix = ("fits: " + "; ".join(changes)) if changes else (
        "nothing fits by more ranks, offload, LoRA, bfloat16 master weights or disaggregated placement alone: "
        "use a smaller model or devices with more memory")
    return (f"model.path={cfg.model.path}: its {mf.describe_params(shape, knobs.expert_parallel)} need at least "
            f"{need / gib:.1f} GiB per policy rank during the {phase} ({parts} GiB) with {run}, but "
            f"{where}; {fix}")


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


def language_config(model_config: Any) -> Any:
    """The config of the language model: a vision-language config (Qwen2-VL, ...) keeps its
    context length and head counts in `text_config`, not at the top level."""
    get_text_config = getattr(model_config, "get_text_config", None)
    if callable(get_text_config):
        return get_text_config()
    return getattr(model_config, "text_config", None) or model_config


def model_context_length(model_config: Any) -> int | None:
    """The longest sequence the model takes, from its config; None if the config does not say."""
    for config in (model_config, language_config(model_config)):
        for name in CONTEXT_ATTRIBUTES:
            value = getattr(config, name, None)
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


def check_sequence_parallel(cfg: JobConfig, model_config: Any | None) -> None:
    """actor.sequence_parallel_size=k: not with the batch-invariant forward, and the model's
    query and key-value heads must divide by k (the all-to-all splits heads;
    training/ulysses.py `check_heads`, which the engine repeats on the built model)."""
    k = cfg.actor.sequence_parallel_size
    if k <= 1:
        return
    if cfg.rollout.batch_invariant:
        raise ConfigError([f"actor.sequence_parallel_size={k} cannot compute log-probs on the batch-invariant "
                           "forward (rollout.batch_invariant=true); set actor.sequence_parallel_size=1 or "
                           "rollout.batch_invariant=false"])
    text = language_config(model_config) if model_config is not None else None
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return  # the config does not say: the engine checks the built model
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    tp = cfg.actor.tensor_parallel_size  # each tp rank splits its 1/tp of the heads (ulysses.check_heads)
    if tp > 1 and (heads % (k * tp) or kv_heads % (k * tp)):
        raise ConfigError([f"actor.sequence_parallel_size={k} x actor.tensor_parallel_size={tp}: the model "
                           f"({cfg.model.path}) has {heads} attention heads and {kv_heads} key-value heads, which "
                           f"must both divide by {k * tp}; lower actor.sequence_parallel_size or "
                           "actor.tensor_parallel_size"])
    if heads % k or kv_heads % k:
        divisors = [d for d in range(2, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
        raise ConfigError([f"actor.sequence_parallel_size={k}: the model ({cfg.model.path}) has {heads} "
                           f"attention heads and {kv_heads} key-value heads, which must both divide by {k}; "
                           f"choose {' or '.join(map(str, divisors)) if divisors else '1'}"])


def check_tensor_parallel(cfg: JobConfig, model_config: Any | None) -> None:
    """actor.tensor_parallel_size=k: the model's heads, key-value heads and MLP width divide by
    k (polyrl/training/tensor_parallel.py `check_divisible`, which the engine repeats on the
    built model), and none of the settings tp does not take yet."""
    k = cfg.actor.tensor_parallel_size
    if k <= 1:
        return
    unsupported = {"rollout.batch_invariant": cfg.rollout.batch_invariant, "actor.offload": cfg.actor.offload}
    for key, on in unsupported.items():
        if on:
            raise ConfigError([f"actor.tensor_parallel_size={k} with {key} is not implemented; "
                               f"set actor.tensor_parallel_size=1 or leave {key} at its default"])
    if model_config is None:
        return
    from polyrl.training.tensor_parallel import TensorParallelError, check_divisible

    try:
        check_divisible(language_config(model_config), k)
    except TensorParallelError as exc:
        raise ConfigError([f"{exc} ({cfg.model.path})"]) from None


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


def check_vision(cfg: JobConfig, train_set: Sequence[Any], val_set: Sequence[Any] | None,
                 model_config: Any | None) -> None:
    """A vision-language model (docs/vision.md): a type polyrl/training/vlm.py drives, and none of
    the settings its image forward does not take yet, refused here rather than at the first
    forward minutes into the run."""
    from polyrl.training.vlm import SUPPORTED_MODEL_TYPES, is_vlm_config

    if model_config is None or not is_vlm_config(model_config):
        return
    model_type = getattr(model_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError([f"model.path: a {model_type} vision-language model; polyrl trains "
                           f"{', '.join(SUPPORTED_MODEL_TYPES)} (docs/vision.md)"])
    unsupported = {
        "actor.sequence_parallel_size": cfg.actor.sequence_parallel_size > 1,
        "rollout.batch_invariant": cfg.rollout.batch_invariant,
        "critic.enable": cfg.critic.enable,
    }
    for key, on in unsupported.items():
        if on:
            raise ConfigError([f"{key}: not supported with a vision-language model yet (docs/vision.md, "
                               f"'Not supported yet'); leave {key} at its default"])
    has_images = any(getattr(s, "images", None) is not None for s in (*train_set, *(val_set or ())))
    if has_images and not capabilities(cfg.rollout.backend).images:
        raise ConfigError([f"rollout.backend={cfg.rollout.backend}: the engine declares no images (image "
                           "prompts of a vision-language model); the native and vllm engines serve them "
                           "(docs/vision.md)"])
    if has_images:  # below the engine's declared floor for images (polyrl/backends.py)
        from polyrl.backends import feature_version_problem, installed_engine_version

        problem = feature_version_problem(cfg.rollout.backend, "images",
                                          installed_engine_version(cfg.rollout.backend), "image prompts")
        if problem:
            raise ConfigError([problem])
    if has_images and cfg.agent.enabled:
        raise ConfigError(["agent: multi-turn rollouts of image prompts are not supported yet "
                           "(docs/vision.md); leave agent off for vision-language data"])
    if has_images and not cfg.topology.on_policy:
        raise ConfigError(["trainer.mode=async: image prompts train in sync mode only so far "
                           "(docs/vision.md); set trainer.mode=sync"])


def _traceback_line(exc: BaseException) -> str:
    """" (file F, line N)" of the innermost frame, or of a SyntaxError's position."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return ""  # its message already holds "(file, line N)"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})" if tb is not None else ""
