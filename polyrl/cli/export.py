"""`polyrl export CHECKPOINT --output DIR [--dtype bfloat16] [--adapter-only]`: a Hugging Face model
directory from a training checkpoint, or with `--adapter-only` the LoRA adapter alone.

Every checkpoint carries the policy in Hugging Face format under `policy/` (DDP: rank 0's
save_pretrained; FSDP2: gathered tensor by tensor, training/checkpoint_io.py), so export reads
that, never the sharded optimizer files: tensors are streamed one at a time (optionally cast),
written as safetensors files of at most 2 GiB, with config, generation config and tokenizer. The
result loads in transformers and serves with `polyrl serve --model DIR`.

A LoRA run's checkpoint also holds its adapter in peft's format (`policy_adapter/`:
adapter_config.json + adapter_model.safetensors); `--adapter-only` writes that directory, which
`peft.PeftModel.from_pretrained(base_model, DIR)` loads onto the base model (`model.path`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from polyrl.cli.common import CLIError

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a Hugging Face model directory from a training checkpoint",
                       description="Read CHECKPOINT (a checkpoints/step_NNNNNN directory of a run, DDP "
                       "or FSDP2, or its policy/ directory) and write a model directory that "
                       "transformers and `polyrl serve --model DIR` load.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="outputs/<run>/checkpoints/step_NNNNNN")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="new directory to write")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="cast floating-point weights (default: keep the checkpoint's dtype)")
    p.add_argument("--adapter-only", action="store_true",
                   help="write only the LoRA adapter (peft format: adapter_config.json + "
                   "adapter_model.safetensors) of a checkpoint trained with model.lora_rank > 0")
    p.set_defaults(func=run)


def policy_dir(checkpoint: Path) -> Path:
    """The Hugging Face directory inside `checkpoint` (or `checkpoint` itself if it is one)."""
    if not checkpoint.is_dir():
        raise CLIError(f"CHECKPOINT: {checkpoint} is not a directory; give a run's "
                       "checkpoints/step_NNNNNN directory")
    check_complete(checkpoint)
    for candidate in (checkpoint / "policy", checkpoint):
        if (candidate / "config.json").is_file() and any(candidate.glob("*.safetensors")):
            return candidate
    raise CLIError(f"CHECKPOINT: {checkpoint} has no policy/ directory with config.json and "
                   "*.safetensors; give a run's checkpoints/step_NNNNNN directory")


def check_complete(checkpoint: Path) -> None:
    """A checkpoint the run was still writing (trainer/checkpoint.py writes `.tmp-step_N` and
    renames it once `driver.pt` is in) is refused, naming the last complete one."""
    from polyrl.trainer.checkpoint import PREFIX, TMP_PREFIX

    step = checkpoint.parent if checkpoint.name == "policy" else checkpoint
    in_a_run = step.parent.name == "checkpoints"
    written = step.name.startswith(TMP_PREFIX) or (
        in_a_run and step.name.startswith(PREFIX) and not (step / "driver.pt").is_file())
    if written:
        raise CLIError(f"CHECKPOINT: {step} is an incomplete checkpoint (the run stopped while "
                       f"writing it); {_last_complete(step.parent.parent)}")


def _last_complete(output_dir: Path) -> str:
    """`export the last complete checkpoint, P` (readable) for the run in `output_dir`."""
    from polyrl.trainer.checkpoint import checkpoint_damage, complete_checkpoints

    for path in reversed(complete_checkpoints(output_dir)):
        if checkpoint_damage(path) is None:
            return f"export the last complete one: {path}"
    return f"{output_dir} holds no complete checkpoint to export"


def check_readable(checkpoint: Path, source: Path) -> None:
    """Truncated or corrupted files of `source` (the policy or adapter directory) are one line
    naming the file, the same check a resume makes (trainer/checkpoint.py `checkpoint_damage`)."""
    from polyrl.trainer.checkpoint import checkpoint_damage

    damage = checkpoint_damage(source)
    if damage is not None:
        step = checkpoint.parent if checkpoint.name == "policy" else checkpoint
        fix = (_last_complete(step.parent.parent) if step.parent.name == "checkpoints"
               else "export another checkpoint")
        raise CLIError(f"CHECKPOINT: {source} is damaged ({damage}); {fix}")


def _config_model(checkpoint: Path) -> dict:
    """The `model` section of the config that wrote the checkpoint ({} when it has none)."""
    step = checkpoint.parent if checkpoint.name == "policy" else checkpoint
    config = step / "config.yaml"
    if not config.is_file():
        return {}
    import yaml

    return (yaml.safe_load(config.read_text()) or {}).get("model", {}) or {}


def _tokenizer_source(checkpoint: Path, policy: Path) -> str:
    """The policy directory when the checkpoint saved its tokenizer there (PolicyWorker does),
    else the tokenizer of the config that wrote the checkpoint."""
    if (policy / "tokenizer_config.json").is_file():
        return str(policy)
    model = _config_model(checkpoint)
    source = model.get("tokenizer_path") or model.get("path")
    if source:
        from polyrl.builtin import resolve

        return str(resolve(source))
    raise CLIError(f"CHECKPOINT: {checkpoint} holds no tokenizer (policy/tokenizer_config.json) and "
                   "no config.yaml naming model.path; copy the tokenizer files into policy/")


def _tensors(policy: Path):
    """The checkpoint's tensors as a weight stream: specs from the safetensors headers, each
    tensor read when the writer asks for it."""
    from safetensors import safe_open

    from polyrl.training.checkpoint_io import SAFETENSORS_DTYPES
    from polyrl.weights.base import WeightStream

    files = sorted(policy.glob("*.safetensors"))
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    specs = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                specs.append((name, tuple(piece.get_shape()), dtypes[piece.get_dtype()]))

    def read():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
    return WeightStream(specs, read())


def adapter_dir(checkpoint: Path) -> Path:
    """The peft adapter directory inside `checkpoint` (or `checkpoint` itself if it is one)."""
    from polyrl.training.lora import ADAPTER_DIR, ADAPTER_FILE

    if not checkpoint.is_dir():
        raise CLIError(f"CHECKPOINT: {checkpoint} is not a directory; give a run's "
                       "checkpoints/step_NNNNNN directory")
    check_complete(checkpoint)
    for candidate in (checkpoint / ADAPTER_DIR, checkpoint):
        if (candidate / "adapter_config.json").is_file() and (candidate / ADAPTER_FILE).is_file():
            return candidate
    raise CLIError(f"--adapter-only: {checkpoint} holds no LoRA adapter ({ADAPTER_DIR}/adapter_config.json "
                   f"+ {ADAPTER_FILE}); it was not trained with model.lora_rank > 0. Drop --adapter-only "
                   "to export the model")


def export(checkpoint: Path, output: Path, dtype: str | None = None, adapter_only: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from polyrl.training.checkpoint_io import write_hf_dir

    source = adapter_dir(checkpoint) if adapter_only else policy_dir(checkpoint)
    check_readable(checkpoint, source)
    if output.exists() and any(output.iterdir()):
        raise CLIError(f"--output: {output} exists and is not empty; choose a new directory")
    # written beside the target and renamed: an interrupted export leaves no half directory
    tmp = output.parent / f".{output.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    if adapter_only:
        _write_adapter(source, tmp, getattr(torch, dtype) if dtype else None)
    else:
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_source(checkpoint, source))
        config = AutoConfig.from_pretrained(str(source))
        try:
            generation = GenerationConfig.from_pretrained(str(source))
        except OSError:  # a checkpoint without one: what transformers derives from the config
            generation = GenerationConfig.from_model_config(config)
        write_hf_dir(tmp, _tensors(source), config, generation,
                     dtype=getattr(torch, dtype) if dtype else None)
        tokenizer.save_pretrained(str(tmp))
        _copy_processor(checkpoint, source, tmp)
    if output.exists():
        output.rmdir()
    tmp.rename(output)
    return output


def _copy_processor(checkpoint: Path, policy: Path, out: Path) -> None:
    """A vision-language model's image processor files (preprocessor_config.json, ...): the
    policy directory's, else those of the model the run started from (model.path in its
    config.yaml; checkpoints written before policy/ carried them). Without them the export
    cannot take images ("has no image processor")."""
    from polyrl.data.vision import copy_processor_files

    if copy_processor_files(policy, out) or "vision_config" not in (out / "config.json").read_text():
        return
    base = _config_model(checkpoint).get("path")
    if base:
        from polyrl.builtin import resolve

        try:
            base_dir = Path(resolve(base)).expanduser()
        except FileNotFoundError:
            base_dir = None
        if base_dir is not None and copy_processor_files(base_dir, out):
            return
    print(f"warning: {checkpoint} is a vision-language model but neither its policy/ nor model.path "
          "holds preprocessor_config.json; copy it into the export from the model's original "
          "repository before training or serving images with it", file=sys.stderr, flush=True)


def _write_adapter(source: Path, out: Path, dtype) -> None:
    """peft's adapter files as the checkpoint holds them (cast with `dtype`)."""
    from safetensors.torch import load_file, save_file

    from polyrl.training.lora import ADAPTER_FILE

    out.mkdir(parents=True)
    shutil.copy2(source / "adapter_config.json", out / "adapter_config.json")
    if dtype is None:
        shutil.copy2(source / ADAPTER_FILE, out / ADAPTER_FILE)
        return
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(source / ADAPTER_FILE)).items()}
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})


def run(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    adapter_only = getattr(args, "adapter_only", False)
    try:
        out = export(Path(args.checkpoint).expanduser(), Path(args.output).expanduser(), args.dtype,
                     adapter_only)
    except (OSError, SafetensorError) as exc:  # damage `check_readable` cannot see from sizes
        raise CLIError(f"export failed: {exc}") from None
    if adapter_only:
        print(f"wrote {out} (a LoRA adapter: peft.PeftModel.from_pretrained(base_model, '{out}'))", flush=True)
    else:
        print(f"wrote {out} (load with transformers, or `polyrl serve --model {out}`)", flush=True)
    return 0
