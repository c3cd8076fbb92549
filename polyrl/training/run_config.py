"""The keys every training run shares, `polyrl train` (trainer.*) and `polyrl sft` (trainer.*):
its length, seed, output, validation and logging cadence, checkpoints and resume. One class, so
the two commands cannot drift; each subclass only changes defaults and adds its own keys."""

from __future__ import annotations

from pydantic import Field, field_validator

from polyrl.config import Config


class CheckpointConfig(Config):
    """When checkpoints are written, how many are kept, and where a run resumes (RL and SFT)."""

    save_every: int = Field(0, ge=0)
    """Write a checkpoint every this many steps (0: only at the end, if save_at_end)."""
    save_at_end: bool = True
    """Write a checkpoint after the last step."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints to keep; older ones are deleted."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint in output_dir (if any); off: start
    fresh; or the path of a checkpoints/step_* directory."""
    save_on_interrupt: bool = True
    """On Ctrl-C / SIGTERM, finish the current step and write a checkpoint before exiting
    (exit code 130 / 143)."""

    @field_validator("resume", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        # YAML reads a bare `off` / `on` as a boolean
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value


class RunConfig(CheckpointConfig):
    total_steps: int | None = Field(None, ge=1)
    """Training steps (default: enough for total_epochs over the training data)."""
    total_epochs: int = Field(1, ge=1)
    """Passes over the training data when total_steps is not set."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    output_dir: str = "outputs/polyrl"
    """Where metrics, samples, checkpoints and summary.json go."""
    val_every: int = Field(10, ge=0)
    """Validate every this many steps (0 disables periodic validation)."""
    val_before_train: bool = True
    """Validate before the first step (the 'before' of the before/after)."""
    log_every: int = Field(1, ge=1)
    """Write metrics every this many steps."""
    progress_bar: bool = True
    """Show a live progress bar on the console."""
