"""`polyrl sft` configuration: the same sections and key names as `polyrl train` where they mean
the same thing (`model.*`, `actor.*` for the optimizer and training engine, `trainer.*`,
`logging.*`, `platform`), and an SFT `data` section for chat files.

The `actor` section *is* the RL `ActorConfig` (polyrl/training/config.py), so an SFT run builds its
engine with the same `build_engine` call as a policy rank and a new strategy (FSDP2) or dtype
option reaches SFT unchanged. Its PPO-only keys are refused rather than silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from polyrl.config import Config
from polyrl.training.config import ActorConfig, ModelConfig
from polyrl.training.run_config import RunConfig

BUILTIN_TRAIN = "builtin:arithmetic_chat_train"
BUILTIN_VAL = "builtin:arithmetic_chat_val"

PPO_ONLY = ("ppo_epochs", "mini_batch_size", "old_logprobs")
"""ActorConfig keys with no meaning in supervised training (one optimizer step per batch)."""


class SFTDataConfig(Config):
    train_files: list[str] = Field(default_factory=lambda: [BUILTIN_TRAIN])
    """Parquet or JSONL files in verl's SFT schema: a `messages` column (list of {role, content}
    chat turns, optional `tools` column), or prompt / response columns (set data.prompt_key and
    data.response_key). Concatenated in order. A single path is accepted too."""
    val_files: list[str] = Field(default_factory=lambda: [BUILTIN_VAL])
    """Held-out files, same schema (validation loss and token accuracy); empty disables."""
    messages_key: str = "messages"
    """Column holding the conversation (a list of {role, content} messages)."""
    tools_key: str = "tools"
    """Column holding the tool schemas passed to the chat template (absent or null: none)."""
    prompt_key: str | None = None
    """prompt/response schema: column of the prompt (a string, or a list of messages); the
    row becomes those messages plus one assistant turn from data.response_key."""
    response_key: str | None = None
    """prompt/response schema: column of the assistant's response (a string)."""
    roles: list[str] = Field(default_factory=lambda: ["system", "user", "assistant", "tool"])
    """Message roles a conversation may use; any other role is a bad row."""
    max_length: int = Field(1024, ge=2)
    """Longest conversation in tokens after the chat template (also capped by the model's
    max_position_embeddings); longer ones are handled by data.truncation."""
    truncation: Literal["drop", "left", "error"] = "drop"
    """Over-long conversations: drop (skip, counted), left (remove the oldest turns after any
    system message until it fits, keeping at least one assistant turn; counted), error (stop)."""
    on_bad_row: Literal["skip", "error"] = "skip"
    """A row that cannot be trained on (no assistant turn, unknown role, bad message shape,
    template failure, tools the template cannot render): skip counts and logs it; error stops."""
    max_samples: int | None = Field(None, ge=1)
    """Use only the first N rows of each split (quick experiments); null uses all."""
    train_batch_size: int = Field(64, ge=1)
    """Conversations per optimizer step, over all ranks (gradient accumulation over micro-batches
    of actor.micro_batch_tokens tokens makes up the rest)."""
    shuffle: bool = True
    """Shuffle training rows, a fresh permutation each epoch derived from (seed, epoch)."""
    seed: int = 0
    """Seed of the shuffle (the same seed gives the same batches on every run and on resume)."""
    drop_last: bool = True
    """Drop the last incomplete batch of each epoch."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _schema(self) -> "SFTDataConfig":
        if (self.prompt_key is None) != (self.response_key is None):
            raise ValueError("set both data.prompt_key and data.response_key (prompt/response "
                             "schema) or neither (messages schema, data.messages_key)")
        return self


class SFTTrainerConfig(RunConfig):
    """The keys of `polyrl train`'s trainer (polyrl/training/run_config.py) with SFT's defaults; a
    finished checkpoint's policy/ is the fine-tuned model."""

    total_epochs: int = Field(2, ge=1)
    output_dir: str = "outputs/polyrl-sft"
    val_every: int = Field(20, ge=0)


class SFTLoggingConfig(Config):
    sinks: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["jsonl"])
    experiment_name: str = "polyrl"
    """MLflow experiment (when sinks includes mlflow)."""
    """Where metrics go: jsonl (OUTPUT_DIR/metrics.jsonl, always on), tensorboard, wandb
    (the sinks of polyrl/trainer/sinks.py)."""
    wandb_project: str = "polyrl"
    """Weights & Biases project (when sinks includes wandb)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: write the W&B run under OUTPUT_DIR/wandb; online: stream to the server."""
    run_name: str | None = None
    """Run name shown by W&B (default: the name of trainer.output_dir)."""
    plot_at_end: bool = True
    """Write OUTPUT_DIR/curves.png (loss, token accuracy, learning rate) when training ends."""

    @field_validator("sinks")
    @classmethod
    def _jsonl_always(cls, sinks: list[str]) -> list[str]:
        return ["jsonl", *(s for s in dict.fromkeys(sinks) if s != "jsonl")]


class SFTActorConfig(ActorConfig):
    """The RL actor section with defaults tuned for a full fine-tune of the bundled tiny model on
    the bundled chat file (docs/sft.md); for a real model start near actor.lr=1e-5."""

    lr: float = Field(1e-3, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """Schedule after warm-up; cosine / linear reach min_lr_ratio at the run's last step."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of `lr` for decaying schedules."""


class SFTConfig(Config):
    """Everything one `polyrl sft` run needs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    actor: SFTActorConfig = Field(default_factory=SFTActorConfig)
    """Optimizer, schedule, micro-batch token budget, dtypes, ranks and strategy of the training
    engine (the same keys as `polyrl train`; the PPO-only ones are refused)."""
    trainer: SFTTrainerConfig = Field(default_factory=SFTTrainerConfig)
    logging: SFTLoggingConfig = Field(default_factory=SFTLoggingConfig)
    platform: str = "auto"
    """Hardware platform: auto (detect), cpu, cuda, rocm or npu."""

    @model_validator(mode="after")
    def _no_ppo_keys(self) -> "SFTConfig":
        set_keys = [k for k in PPO_ONLY if k in self.actor.model_fields_set]
        if set_keys:
            raise ValueError(f"actor.{set_keys[0]} has no meaning in polyrl sft (one optimizer "
                             "step per data.train_batch_size conversations); remove it")
        if self.actor.sequence_parallel_size > 1:  # sft shards its rows over every rank
            raise ValueError("actor.sequence_parallel_size: polyrl sft does not split sequences over "
                             "ranks (only polyrl train does); remove it")
        return self

    @property
    def output_path(self) -> Path:
        return Path(self.trainer.output_dir)
