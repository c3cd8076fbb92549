"""Checkpoints that a crash cannot half-write, and resume that continues exactly.

Layout of one checkpoint (`<output_dir>/checkpoints/step_000010/`):
    policy/            the policy in Hugging Face format (transformers and the engines load it)
    rank0.pt ...       per rank: optimizer, LR scheduler, torch RNG, weight version
    driver.pt          data-loader position, Python / NumPy / torch RNG, run counters
    config.yaml        the config that wrote it
A checkpoint is written under a temporary name and renamed when complete; a directory named
`step_*` is therefore always whole. Only the last `keep_last` are kept.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

logger = logging.getLogger(__name__)

PREFIX = "step_"

# Fields whose change makes a checkpoint meaningless for this run (different model, data order
# or batch shape). Any other change is allowed and logged.
INCOMPATIBLE = (
    "model.path", "model.tokenizer_path", "data.train_files", "data.train_batch_size",
    "data.seed", "data.shuffle", "data.drop_last", "data.max_prompt_length", "data.prompt_key",
    "data.max_samples", "rollout.n", "actor.world_size", "actor.mini_batch_size",
    "actor.param_dtype", "trainer.seed",
)


class CheckpointError(RuntimeError):
    pass


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_dir(output_dir: Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f"{PREFIX}{step:06d}"


def complete_checkpoints(output_dir: Path) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and p.name[len(PREFIX):].isdigit() and (p / "driver.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def find_resume_point(resume: str, output_dir: Path) -> Path | None:
    """`off` -> None; `auto` -> the latest complete checkpoint (or None); else that path."""
    if resume == "off":
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "driver.pt").is_file():
        raise CheckpointError(f"trainer.resume: {path} is not a complete polyrl checkpoint "
                              "(no driver.pt); give a checkpoints/step_* directory, auto or off")
    return path


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k != "env":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_compatible(saved: dict, current: dict) -> list[str]:
    """Raise naming the first incompatible field; return the harmless differences."""
    a, b = flatten(saved), flatten(current)
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    bad = [k for k in changed if k in INCOMPATIBLE]
    if bad:
        details = "; ".join(f"{k}: checkpoint has {a.get(k)!r}, this run has {b.get(k)!r}" for k in bad)
        raise CheckpointError(
            f"cannot resume: incompatible config ({details}). Resume with the checkpoint's values, "
            "or start fresh with trainer.resume=off or another trainer.output_dir")
    return changed


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class CheckpointWriter:
    """Writes `step_*` directories atomically and prunes old ones."""

    def __init__(self, output_dir: Path, keep_last: int):
        self.output_dir = output_dir
        self.keep_last = keep_last

    def begin(self, step: int) -> Path:
        tmp = checkpoint_root(self.output_dir) / f".tmp-{PREFIX}{step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, driver_state: dict, config: dict) -> Path:
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        torch.save(driver_state, tmp / "driver.pt")  # written last: its presence marks completeness
        final = step_dir(self.output_dir, step)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune()
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def prune(self) -> None:
        for old in complete_checkpoints(self.output_dir)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def check_writable(output_dir: Path, need_bytes: int) -> None:
    """Fail before training, not at the first save, if checkpoints cannot be written."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".polyrl-write-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"trainer.output_dir: {output_dir} is not writable ({exc.strerror}); "
                              "choose another directory with --output-dir") from None
    free = shutil.disk_usage(output_dir).free
    if free < need_bytes:
        raise CheckpointError(
            f"trainer.output_dir: {output_dir} has {free / 2**20:.0f} MiB free but checkpoints need "
            f"about {need_bytes / 2**20:.0f} MiB (lower trainer.keep_last or free space)")
