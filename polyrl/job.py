"""The job config: one schema assembled from the components' own config classes.

It sits low in the layers (below workers, topology and trainer, which all take a `JobConfig`),
importing only the components' config modules, which are leaves (they import nothing but
`polyrl.config`): so every signature that takes the whole job is typed."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from polyrl.agents.config import AgentConfig
from polyrl.algorithms.config import AlgorithmConfig, check_critic, check_rollout
from polyrl.algorithms.distill_config import DistillConfig
from polyrl.config import Config
from polyrl.data.config import DataConfig
from polyrl.rewards.config import RewardConfig
from polyrl.rollout.config import RolloutConfig
from polyrl.distributed.topologies import TopologySpec, topology_of
from polyrl.weights.config import WeightSyncConfig
from polyrl.training.config import ActorConfig, ModelConfig
from polyrl.training.critic_config import CriticConfig
from polyrl.training.run_config import RunConfig


SinkName = Literal["jsonl", "tensorboard", "wandb"]


class LoggingConfig(Config):
    """Metric sinks, sample logging and the end-of-run plot."""

    sinks: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["jsonl"])
    """Where metrics go: jsonl (OUTPUT_DIR/metrics.jsonl, always on even if omitted),
    tensorboard (OUTPUT_DIR/tensorboard, needs polyrl[tensorboard]), wandb (needs polyrl[wandb]),
    mlflow (MLFLOW_TRACKING_URI, else OUTPUT_DIR/mlruns; needs polyrl[mlflow])."""
    experiment_name: str = "polyrl"
    """MLflow experiment of the run (when sinks includes mlflow); created if missing."""
    wandb_project: str = "polyrl"
    """Weights & Biases project of the run (when sinks includes wandb)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: write the W&B run under OUTPUT_DIR/wandb with no network (upload later with
    `wandb sync`); online: stream to the W&B server (needs `wandb login`)."""
    run_name: str | None = None
    """Run name shown by W&B (default: the name of trainer.output_dir)."""
    samples_every: int = Field(10, ge=0)
    """Write example prompts, responses and rewards to OUTPUT_DIR/samples.{jsonl,txt} every this
    many steps (0 disables)."""
    num_samples: int = Field(4, ge=1)
    """Examples written each time, taken from different prompts where possible."""
    plot_at_end: bool = True
    """Write OUTPUT_DIR/curves.png (reward, accuracy, validation, length) when training ends."""

    @field_validator("sinks")
    @classmethod
    def _jsonl_always(cls, sinks: list[str]) -> list[str]:
        # metrics.jsonl is what resume, `polyrl plot` and summary tooling read: never optional
        return ["jsonl", *(s for s in dict.fromkeys(sinks) if s != "jsonl")]

    def resolved_run_name(self, output_dir: Path) -> str:
        return self.run_name or Path(output_dir).resolve().name


class RayConfig(Config):
    enabled: bool = True
    """false: run the trainer, the policy worker and its engine in this one process, without
    Ray (one rank, rollout.placement=colocated, trainer.mode=sync; docs/training.md, "One process,
    no Ray"): a debugger stops in any of them and nothing is spawned."""
    address: str | None = None
    """Ray cluster to join ("auto" = the cluster started by `ray start`); null starts a local
    Ray instance for this run."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local Ray instance (default: all cores)."""
    namespace: str = "polyrl"
    """Ray namespace of the run's actors."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest wait on any remote call before polyrl names who did not answer; also a local
    Ray's wait for its GCS at start-up (whole seconds, at most 120)."""


class TrainerConfig(RunConfig):
    mode: Literal["sync", "async"] = "sync"
    """sync: generate then train each step (on-policy); async: overlap them (bounded staleness)."""


class AsyncConfig(Config):
    """trainer.mode=async: rollout and training overlap (docs/async.md)."""

    max_staleness: int = Field(1, ge=0)
    """Most policy versions a sample's oldest token may lag the trainer's weights when it is
    trained on. Generation pauses when starting more groups would exceed it; samples over it
    at consume time (e.g. after a resume) are discarded, counted and their prompts regenerated.
    0 is on-policy (no overlap)."""
    partial_rollout: Literal["abort", "wait"] = "abort"
    """At a weight sync, abort in-flight requests and continue them with the new weights from
    the tokens generated so far (abort), or let them finish on the old weights first (wait)."""
    queue_size: int | None = Field(None, ge=1)
    """Most finished groups waiting for the trainer; generation pauses when the queue is full
    (default: no bound beyond max_staleness, i.e. (max_staleness + 1) x data.train_batch_size)."""
    groups_per_request: int = Field(4, ge=1)
    """Prompt groups per call to a replica: smaller streams finer, larger costs fewer calls."""
    max_inflight_per_replica: int | None = Field(None, ge=1)
    """Groups generating at once on one replica (default: data.train_batch_size)."""
    max_retries: int = Field(3, ge=0)
    """A group whose replica died is retried on another replica at most this many times."""
    restart_replicas: bool = True
    """Replace a dead replica with a new one that loads the current weights."""


class JobConfig(Config):
    """Everything one `polyrl train` run needs. Each section is owned by its component."""

    # `async` is a Python keyword: the field is async_, the config key `async`
    model_config = {**Config.model_config, "validate_by_name": True, "validate_by_alias": True,
                    "serialize_by_alias": True}

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=lambda: DataConfig(
        train_files=["builtin:arithmetic_train"], val_files=["builtin:arithmetic_val"]))
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """On-policy distillation from a frozen teacher (docs/algorithms.md)."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    weights: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Multi-turn rollouts with tools or environments (docs/agents.md)."""
    """PPO with a value model (algorithm.adv_estimator=gae): on the policy ranks and engine."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    """Asynchronous training (trainer.mode=async): staleness bound, partial rollouts, queue."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    platform: str = "auto"
    """Hardware platform: auto (detect), cpu, cuda, rocm or npu (or a registered plugin)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for every polyrl process; they win over your environment and
    polyrl's defaults (see `polyrl env`)."""

    @model_validator(mode="after")
    def _check(self) -> "JobConfig":
        check_rollout(self.algorithm, n=self.rollout.n, response_length=self.rollout.response_length)
        check_critic(self.algorithm, self.critic.enable)
        if self.rollout.lora_mode == "adapter":
            if not self.model.enabled:
                raise ValueError("rollout.lora_mode=adapter sends LoRA adapters: it needs model.lora_rank > 0")
            most = (self.rollout.engine_kwargs.get("vllm") or {}).get("max_lora_rank", 16)
            if self.model.lora_rank > most:
                raise ValueError(f"model.lora_rank={self.model.lora_rank} is larger than vLLM's max_lora_rank "
                                 f"({most}): set rollout.engine_kwargs.vllm.max_lora_rank={self.model.lora_rank}")
        self._ask_engine_routes()
        if self.rollout.batch_invariant:
            if self.actor.compute_dtype != self.rollout.dtype:
                raise ValueError(f"rollout.batch_invariant=true: the trainer recomputes log-probs in rollout.dtype="
                                 f"{self.rollout.dtype}; set actor.compute_dtype={self.rollout.dtype}")
            if self.model.enabled:
                raise ValueError("rollout.batch_invariant=true does not support LoRA (model.lora_rank > 0) yet; "
                                 "set model.lora_rank=0 or rollout.batch_invariant=false")
            if self.actor.compile == "on":
                raise ValueError("rollout.batch_invariant=true runs the trainer's forward eagerly; set "
                                 "actor.compile=auto or off")
        mini = self.actor.mini_batch_size
        if mini is not None and self.data.train_batch_size % mini:
            raise ValueError(
                f"actor.mini_batch_size={mini} must divide data.train_batch_size="
                f"{self.data.train_batch_size} (prompts per optimizer step)")
        self._check_topology()
        self._check_in_process()
        return self

    def _ask_engine_routes(self) -> None:
        """actor.router_replay=R3 on an engine that records routes only when started so (vLLM,
        SGLang; docs/moe.md): its launch argument is set in rollout.engine_kwargs, where the
        dry run shows it; turned off there by the user, one line."""
        from polyrl.backends import ROUTES_LAUNCH_ARGUMENT

        backend = self.rollout.backend
        flag = ROUTES_LAUNCH_ARGUMENT.get(backend)
        if self.actor.router_replay != "R3" or flag is None:
            return
        kwargs = self.rollout.engine_kwargs.setdefault(backend, {})
        if kwargs.setdefault(flag, True) is not True:
            value = str(kwargs[flag]).lower()
            raise ValueError(f"rollout.engine_kwargs.{backend}.{flag}={value}: actor.router_replay=R3 replays the "
                             "routes the engine records only when started with it; remove the key")

    def _check_in_process(self) -> None:
        """ray.enabled=false runs one rank in the calling process: refuse, naming the key, any
        setting that needs a second process."""
        if self.ray.enabled:
            return
        a, spec = self.actor, self.topology
        needs = [(a.world_size > 1, f"actor.world_size={a.world_size} needs a process per rank; set actor.world_size=1"),
                 (not spec.colocated_engine, f"rollout.placement={spec.placement} (the {spec.name} topology) "
                  "runs the engines in processes of their own; set rollout.placement=colocated trainer.mode=sync"),
                 (self.distill.own_ranks > 0, "distill.placement=disaggregated runs the teacher on ranks of "
                  "its own; set distill.placement=colocated"),
                 (self.reward.model is not None, "reward.model runs in a reward worker of its own; use a reward "
                  "function or reward.http"),
                 (self.ray.address is not None, f"ray.address={self.ray.address} joins a Ray cluster; unset it")]
        for bad, why in needs:
            if bad:
                raise ValueError(f"ray.enabled=false runs the whole run in this one process: {why} "
                                 "(or set ray.enabled=true)")

    def _check_topology(self) -> None:
        """What the selected topology (polyrl/distributed/topologies.py) allows: one check, from the
        same table the launch plan reads."""
        try:
            spec = self.topology
            spec.transport(self.weights.transport)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if spec.colocated_engine and self.rollout.num_replicas > 1:
            raise ValueError("num_replicas > 1 needs rollout.placement=disaggregated (colocated placement runs one "
                             "engine per trainer rank)")
        if spec.colocated_engine and self.data.train_batch_size % self.actor.world_size:
            raise ValueError(
                f"data.train_batch_size={self.data.train_batch_size} must be a multiple of "
                f"actor.world_size={self.actor.world_size}: each rank's engine generates an equal share")

    @property
    def topology(self) -> TopologySpec:
        """The topology rollout.placement x trainer.mode select (polyrl/distributed/topologies.py)."""
        return topology_of(self)

    @property
    def weight_transport(self) -> str:
        """The transport this run uses (`weights.transport` resolved by the topology)."""
        return self.topology.transport(self.weights.transport)

    @property
    def resolved_weights(self) -> WeightSyncConfig:
        """The weights section with `auto` replaced by `weight_transport`; a background publish
        only where generation overlaps training (streaming): in a synchronous topology the
        replicas wait for each version at once, so nothing would overlap, and a foreground
        publish reports its errors to the trainer directly."""
        return self.weights.model_copy(update={
            "transport": self.weight_transport,
            "background_publish": self.weights.background_publish and not self.topology.on_policy,
        })

    @property
    def num_mini_batches(self) -> int:
        return self.data.train_batch_size // (self.actor.mini_batch_size or self.data.train_batch_size)

    @property
    def output_path(self) -> Path:
        return Path(self.trainer.output_dir)
