"""Vision-language models in the trainer: Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

What differs from a causal LM, and nothing else:

- loading: transformers' `AutoModelForCausalLM` does not map these models; a directory whose
  config has a `vision_config` loads through `AutoModelForImageTextToText` (`load_vlm`), with the
  vision tower frozen unless `model.train_vision_tower`;
- the forward of a micro-batch with images (`image_forward`, called by
  polyrl/training/logprobs.py): the vision tower encodes the micro-batch's images in one call,
  each prompt's once however many of its samples are there (GRPO's group shares them), their
  embeddings replace every such sample's image placeholders, and the M-RoPE positions come from
  the model's own rope-index function (`get_rope_index`) per sample, from the ids and the image
  grids, never shipped in the batch. A packed row (polyrl/batch/packed.py) gets each sample's
  positions computed on its own segment and concatenated: M-RoPE positions depend only on the
  sample's tokens, and the packed attention (training/varlen.py) attends per segment, so the
  packed forward is the per-sample forward;
- Qwen3-VL's deep stack: its tower also returns features of intermediate vision blocks, which
  the language model adds to the image tokens' hidden states after its first decoder layers
  (`visual_pos_masks`, `deepstack_visual_embeds`, as transformers' `Qwen3VLModel.forward` hands
  them over). `image_forward` therefore calls the language model itself, with the embeddings,
  positions and deep-stack features it made, for every family;
- LoRA's `all-linear` leaves the vision tower out unless it trains (`lora_excluded`);
- FSDP2: the vision blocks are units of their own (transformers lists them in
  `_no_split_modules`, which polyrl/training/fsdp2.py shards by). Every rank must then run the
  tower in every forward, since its all-gathers are collectives: a micro-batch without images
  runs it on one blank placeholder image whose output is added times zero (`image_forward`).

A response token is text whatever its id: only placeholders inside the prompt take image
embeddings, as a rollout engine embeds the tokens it sampled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Model types whose vision tower, placeholders and rope index this module drives."""


class VLMError(ValueError):
    """A vision-language model polyrl cannot train; the message names the key and the fix."""


# --- recognising and loading ------------------------------------------------------------------------
def is_vlm_config(config: Any) -> bool:
    """A transformers config (or its dict) with a vision tower."""
    if isinstance(config, dict):
        return config.get("vision_config") is not None
    return getattr(config, "vision_config", None) is not None


def is_vlm_dir(directory: str | Path) -> bool:
    """The model directory's config.json describes a vision-language model."""
    path = Path(directory) / "config.json"
    try:
        return is_vlm_config(json.loads(path.read_text()))
    except (OSError, ValueError):
        return False


def check_supported(config: Any) -> None:
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise VLMError(f"model.path: a {model_type} vision-language model; polyrl trains "
                       f"{', '.join(SUPPORTED_MODEL_TYPES)} (docs/vision.md)")


def model_class(config: Any):
    """The transformers auto class that builds this config's model (its pre-flight too: LoRA's
    layer check builds it on the meta device)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM


def load_vlm(directory: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False, *,
             train_vision_tower: bool = False) -> torch.nn.Module:
    """The vision-language model of `directory` on the CPU, SDPA attention (what the packed
    attention switches from), its vision tower frozen unless `train_vision_tower`."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    check_supported(AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code))
    model = AutoModelForImageTextToText.from_pretrained(str(directory), dtype=dtype,
                                                        trust_remote_code=trust_remote_code,
                                                        attn_implementation="sdpa")
    set_vision_training(model, train_vision_tower)
    return model


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's vision encoder (`model.model.visual`), None for a text-only model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(getattr(base, "base_model", base), "visual", None)


def set_vision_training(model: torch.nn.Module, train: bool) -> None:
    """Freeze the vision tower (the default: RL tunes the language model) or let it train."""
    tower = vision_tower(model)
    if tower is not None:
        tower.requires_grad_(train)


def lora_excluded(model: torch.nn.Module, train_vision_tower: bool) -> set[str]:
    """Linear-layer names LoRA's all-linear leaves out: the vision tower's, unless it trains."""
    tower = vision_tower(model)
    if tower is None or train_vision_tower:
        return set()
    inside = {id(m) for m in tower.modules()}
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside}


# --- the forward of image micro-batches -------------------------------------------------------------
def runs_tower_every_forward(model: torch.nn.Module) -> bool:
    """Under FSDP2 the vision blocks are units whose all-gathers every rank must join: then each
    forward runs the tower, with or without images."""
    tower = vision_tower(model)
    if tower is None:
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in tower.modules())


def image_forward(model: torch.nn.Module, mb: Any, kwargs: dict) -> torch.Tensor:
    """The last hidden states [b, L, H] (packed: [1, T, H]) of micro-batch `mb` with its images.
    `kwargs`: the packed layout's attention arguments (training/varlen.py); they reach the
    language model only, never the vision tower, whose attention is per image."""
    base = model.base_model
    if vision_tower(model) is None:
        raise VLMError(f"the batch's prompts have images but {type(model).__name__} has no vision tower: give "
                       "a vision-language model (model.path, or the distillation teacher) or text-only data")
    if getattr(mb, "sequence_shard", None) is not None:
        raise VLMError("actor.sequence_parallel_size > 1 does not split rows with images yet; set it to 1")
    if getattr(mb, "position_ids", None) is not None and getattr(mb, "cu_seq_lens", None) is None:
        raise VLMError("images need padded micro-batches or packed ones with segment boundaries, not the "
                       "dense-mask packed layout (collate_packed(varlen=False))")
    embeds = base.get_input_embeddings()(mb.input_ids)
    kwargs = dict(kwargs)
    if mb.images is not None:
        image_mask = _image_positions(mb, base.config.image_token_id)
        # each distinct prompt's images encoded once, then handed to every row of that prompt
        encoded = base.get_image_features(mb.images.pixel_values, mb.images.image_grid_thw)
        rows = _row_images(mb)
        order = [j for images in rows for j in images]  # the rows' images in placeholder order
        features = torch.cat([encoded.pooler_output[j] for j in order])
        if int(image_mask.sum()) != features.shape[0]:
            raise VLMError(f"a micro-batch's prompts hold {int(image_mask.sum())} image placeholder tokens but "
                           f"their images make {features.shape[0]}: the prompt ids were not expanded by "
                           "this model's processor")
        embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), features.to(embeds.dtype))
        deep_stack = getattr(encoded, "deepstack_features", None)
        if deep_stack:  # Qwen3-VL: per layer, one feature row per image token, in the same order
            kwargs["visual_pos_masks"] = image_mask
            kwargs["deepstack_visual_embeds"] = [torch.cat([layer[j] for j in order]).to(embeds.dtype)
                                                 for layer in deep_stack]
        grids = [mb.images.image_grid_thw[images] for images in rows]
        kwargs["position_ids"] = mrope_positions(base, mb, image_mask, grids)
    else:  # FSDP2 (runs_tower_every_forward): the tower's collectives, nothing of its output
        embeds = embeds + _blank_image_features(base).sum().to(embeds.dtype) * 0
    # the language model itself, as the multimodal model's forward would call it: that forward
    # cannot take the deep-stack features from outside (it passes its own to the language model)
    out = base.language_model(input_ids=None, inputs_embeds=embeds, attention_mask=mb.attention_mask,
                              use_cache=False, **kwargs)
    return out.last_hidden_state


def _image_positions(mb: Any, image_token_id: int) -> torch.Tensor:
    """[b, L] (packed: [1, T]) bool: the prompt's image placeholders (not a response token that
    happens to have the placeholder's id)."""
    ids = mb.input_ids
    prompt = mb.prompt_lengths.to(ids.device)
    if getattr(mb, "cu_seq_lens", None) is not None:  # packed: positions restart per sample
        fed = (mb.cu_seq_lens[1:] - mb.cu_seq_lens[:-1]).to(ids.device, torch.long)
        limit = torch.repeat_interleave(prompt, fed).unsqueeze(0)
        in_prompt = mb.position_ids < limit
    else:
        in_prompt = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < prompt.unsqueeze(1)
    return (ids == image_token_id) & in_prompt


def _row_images(mb: Any) -> list[list[int]]:
    """Per row, the indices of its images among the micro-batch's distinct ones (`mb.images`)."""
    first = [0, *torch.cumsum(mb.image_objects, 0).tolist()]
    return [[] if k < 0 else list(range(first[k], first[k + 1])) for k in mb.image_index.tolist()]


def mrope_positions(base: torch.nn.Module, mb: Any, image_mask: torch.Tensor,
                    grids: list[torch.Tensor]) -> torch.Tensor:
    """[3, b, L] (packed: [3, 1, T]) M-RoPE position ids from the model's `get_rope_index`, given
    each row's image grids: on the padded rows at once, or on each packed sample's segment."""
    types = image_mask.to(torch.int32)
    if getattr(mb, "cu_seq_lens", None) is None:
        return base.get_rope_index(mb.input_ids, types, image_grid_thw=torch.cat(grids),
                                   attention_mask=mb.attention_mask)[0]
    bounds = mb.cu_seq_lens.tolist()
    parts = []
    for (s, e), grid in zip(zip(bounds[:-1], bounds[1:]), grids):
        if len(grid) == 0:  # text only: the rope index is the plain count
            parts.append(torch.arange(e - s, device=mb.input_ids.device).view(1, 1, -1).expand(3, 1, -1))
        else:
            parts.append(base.get_rope_index(mb.input_ids[:, s:e], types[:, s:e], image_grid_thw=grid)[0])
    return torch.cat(parts, dim=2)


def _blank_image_features(base: torch.nn.Module) -> torch.Tensor:
    """The tower's outputs for the smallest image it takes (one merge window of zero pixels),
    flattened: the merged features and, for Qwen3-VL, each deep-stack layer's, so that every
    tower parameter that a real image reaches gets a (zero) gradient here too; FSDP2 reduces a
    unit's gradients together and every rank must bring the same ones."""
    vision = base.config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    weight = next(base.visual.parameters())
    grid = torch.tensor([[1, merge, merge]], device=weight.device)
    pixels = torch.zeros(merge * merge, patch_dim, device=weight.device, dtype=weight.dtype)
    encoded = base.get_image_features(pixels, grid)
    outputs = [*encoded.pooler_output]
    for layer in getattr(encoded, "deepstack_features", None) or ():
        outputs.extend(layer)
    return torch.cat([x.reshape(-1) for x in outputs])
