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

import json
import logging
import random
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from polyrl.config.vocabulary import with_names

logger = logging.getLogger(__name__)

PREFIX = "step_"
TMP_PREFIX = ".tmp-"
"""A checkpoint being written (renamed to `step_*` once complete)."""

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
    """`off` -> None; `auto` -> the latest complete, readable checkpoint (or None), falling back
    past damaged ones with a warning; else that path, which must be readable."""
    if resume == "off":
        return None
    if resume == "auto":
        for path in reversed(complete_checkpoints(output_dir)):
            damage = checkpoint_damage(path)
            if damage is None:
                return path
            logger.warning("checkpoint %s is damaged (%s): resuming from the one before it; "
                           "delete it to silence this warning", path, damage)
        return None
    path = Path(resume)
    if not (path / "driver.pt").is_file():
        raise CheckpointError(f"trainer.resume: {path} is not a complete polyrl checkpoint "
                              "(no driver.pt); give a checkpoints/step_* directory, auto or off")
    damage = checkpoint_damage(path)
    if damage is not None:
        raise CheckpointError(f"trainer.resume: checkpoint {path} is damaged ({damage}); give an "
                              "earlier checkpoints/step_* directory, or trainer.resume=auto to take "
                              "the latest readable one")
    return path


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with a complete-looking checkpoint (a truncated or corrupted file), or None.

    A crash cannot half-write a `step_*` directory, but a full disk, a copy cut short or bad
    storage can still damage one. torch.save files are zip archives (checked against their
    CRCs); safetensors files must be as long as their header says. Reads each file once."""
    for file in sorted(path.rglob("*")):
        if file.suffix == ".pt":
            problem = _zip_damage(file)
        elif file.suffix == ".safetensors":
            problem = _safetensors_damage(file)
        else:
            continue
        if problem:
            return f"{file.relative_to(path)}: {problem}"
    return None


def _zip_damage(file: Path) -> str | None:
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"unreadable ({exc})"
    return f"member {bad} fails its checksum" if bad else None


def _safetensors_damage(file: Path) -> str | None:
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            if header_len > size - 8:
                return "truncated header"
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, OSError) as exc:
        return f"unreadable header ({exc})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    expected = 8 + header_len + end
    return f"{size} bytes, its header says {expected}" if size != expected else None


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k != "env":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_compatible(saved: dict, current: dict, where: str = "the checkpoint") -> list[str]:
    """Raise naming the first incompatible field; return the harmless differences.

    Checked on the driver, from the checkpoint's config.yaml, before any actor starts: a change
    the engines cannot load (`strategy_or_lora_problem`) is one line here instead of a
    traceback from inside a policy rank. A checkpoint written under an earlier placement name
    (`polyrl/config/vocabulary.py`) reads as the name, not as a change."""
    a, b = flatten(with_names(saved)), flatten(current)
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    bad = [k for k in changed if k in INCOMPATIBLE]
    if a.get("actor.strategy") == "fsdp2":
        # sharded checkpoints (torch.distributed.checkpoint) reshard onto any number of ranks;
        # under another strategy the strategy is what to fix (`strategy_or_lora_problem`)
        bad = [k for k in bad if k != "actor.world_size"]
    if bad:
        details = "; ".join(f"{k}: checkpoint has {a.get(k)!r}, this run has {b.get(k)!r}" for k in bad)
        raise CheckpointError(
            f"cannot resume: incompatible config ({details}). Resume with the checkpoint's values, "
            "or start fresh with trainer.resume=off or another trainer.output_dir")
    problem = strategy_or_lora_problem(a, b, where)
    if problem:
        raise CheckpointError(f"cannot resume: {problem}, or start fresh with trainer.resume=off "
                              "or another trainer.output_dir")
    return changed


def strategy_or_lora_problem(saved: dict[str, Any], current: dict[str, Any], where: str) -> str | None:
    """Why the policy engines could not load a checkpoint written under `saved` (flattened
    configs), with the fix; None if they can. What the engines read (polyrl/training/ddp.py,
    fsdp2.py `load`): ddp reads `policy/` (or a LoRA run's `policy_adapter/`) and one optimizer
    file per rank; fsdp2 reads its sharded `dcp/` on any number of ranks, or a full-model ddp
    checkpoint."""
    was, now = saved.get("actor.strategy", "ddp"), current.get("actor.strategy", "ddp")
    rank_was, rank_now = saved.get("model.lora_rank") or 0, current.get("model.lora_rank") or 0
    if rank_was != rank_now:
        kind = f"a LoRA rank-{rank_was} adapter" if rank_was else "a full-model policy (no LoRA)"
        return (f"{where} holds {kind}, this run has model.lora_rank={rank_now}; resume with "
                f"model.lora_rank={rank_was}")
    if rank_now and saved.get("model.lora_target_modules") != current.get("model.lora_target_modules"):
        return (f"{where} holds adapters on model.lora_target_modules="
                f"{saved.get('model.lora_target_modules')!r}, this run has "
                f"{current.get('model.lora_target_modules')!r}; resume with the checkpoint's value")
    if was == "fsdp2" and now == "ddp":
        return (f"{where} was written by actor.strategy=fsdp2 (sharded optimizer state in dcp/), "
                "which an actor.strategy=ddp run cannot read; resume with actor.strategy=fsdp2 "
                "(on any actor.world_size)")
    if was == "ddp" and now == "fsdp2" and rank_now:
        return (f"{where} was written by actor.strategy=ddp, and a LoRA run under "
                "actor.strategy=fsdp2 resumes only its own checkpoints; resume with actor.strategy=ddp")
    return None


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
        tmp = checkpoint_root(self.output_dir) / f"{TMP_PREFIX}{PREFIX}{step:06d}"
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


def checkpoint_bytes(output_dir: Path) -> int:
    """Bytes the run's checkpoints (complete or not) already take in `output_dir`."""
    root = checkpoint_root(output_dir)
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def check_writable(output_dir: Path, need_bytes: int, keep_last: int | None = None) -> None:
    """Fail before training, not at the first save, if checkpoints cannot be written.

    `need_bytes`: what the run's checkpoints take at most (`keep_last` kept + one being written).
    Checkpoints already in `output_dir` (a resume) are part of that budget: rotation deletes
    them as new ones arrive, so only the difference must be free - but at least one checkpoint's
    worth (`need_bytes / (keep_last + 1)`), the one written before the oldest is pruned."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".polyrl-write-probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"trainer.output_dir: {output_dir} is not writable ({exc.strerror}); "
                              "choose another directory with --output-dir") from None
    one = need_bytes // (keep_last + 1) if keep_last else 0
    need_bytes = max(need_bytes - checkpoint_bytes(output_dir), one)
    free = shutil.disk_usage(output_dir).free
    if free < need_bytes:
        raise CheckpointError(
            f"trainer.output_dir: {output_dir} has {free / 2**20:.0f} MiB free but checkpoints need "
            f"about {need_bytes / 2**20:.0f} MiB more (lower trainer.keep_last or free space)")


def read_resume_point(resume: str, output_dir: Path, config: dict[str, Any]) -> tuple[Path, dict[str, Any], list[str]] | None:
    """(checkpoint directory, its driver state, settings changed since it was written) of the
    checkpoint `resume` selects in `output_dir` (trainer.resume), or None for a fresh run. A
    change that makes the checkpoint unusable raises (`check_compatible`)."""
    import yaml

    resume_dir = find_resume_point(resume, output_dir)
    if resume_dir is None:
        return None
    changed = check_compatible(yaml.safe_load((resume_dir / "config.yaml").read_text()), config,
                               where=f"checkpoint {resume_dir}")
    return resume_dir, torch.load(resume_dir / "driver.pt", weights_only=False), changed
