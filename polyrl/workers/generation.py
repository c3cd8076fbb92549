"""Turn engine outputs into a `RolloutBatch`; shared by colocated and disaggregated rollout."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from polyrl.batch import AGENT_LIMITS, STOP_REASONS, AgentColumns, Ragged, RolloutBatch
from polyrl.batch.routes import engine_routes
from polyrl.rollout.base import SamplingParams, TokenOutput


def sampling_params(sampling: SamplingParams, seeds: Sequence[int | None] | None, count: int) -> list[SamplingParams]:
    """One validated SamplingParams per prompt (the template's fields, each prompt's seed): a
    seed per prompt makes rollouts reproducible whatever else shares the batch."""
    return [dataclasses.replace(sampling, seed=seed).validate() for seed in (seeds or [None] * count)]


def generate_batch(engine: Any, tokenizer: Any, prompts: list[list[int]], sampling: SamplingParams,
                   seeds: list[int] | None, group_offset: int,
                   images: Sequence[Any] | None = None) -> RolloutBatch:
    """n samples for each prompt; samples of prompt i get group `group_offset + i`. `images`: each
    prompt's `ImageInputs` or None (vision-language models); text-only batches pass nothing, so
    an engine without image support is called as before."""
    params = sampling_params(sampling, seeds, len(prompts))
    if images is not None and any(i is not None for i in images):
        outputs = engine.generate_batch(prompts, params, images=list(images))
    else:
        outputs = engine.generate_batch(prompts, params)
    groups = [group_offset + i for i in range(len(prompts))]
    return to_batch(tokenizer, engine.eos_token_ids, prompts, outputs, groups)


def to_batch(tokenizer: Any, eos_token_ids: Sequence[int], prompts: Sequence[Sequence[int]],
             outputs: Sequence[Sequence[TokenOutput]], groups: Sequence[int]) -> RolloutBatch:
    eos = set(eos_token_ids)
    flat = [(prompt, out, group) for prompt, outs, group in zip(prompts, outputs, groups) for out in outs]
    responses = [list(out.token_ids) for _, out, _ in flat]
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    response_ids = Ragged.from_rows(responses, torch.long)
    return RolloutBatch(
        prompt_ids=Ragged.from_rows([list(p) for p, _, _ in flat], torch.long),
        response_ids=response_ids,
        # single-turn: every response token was sampled by the policy and is trained on
        loss_mask=Ragged.full_like(response_ids, 1.0, torch.float32),
        group=long([g for _, _, g in flat]),
        stop_reason=long([STOP_REASONS.index(out.stop_reason) for _, out, _ in flat]),
        finished_with_eos=torch.tensor([out.stop_reason == "stop" and bool(r) and r[-1] in eos
                                        for (_, out, _), r in zip(flat, responses)], dtype=torch.bool),
        weight_version=long([out.weight_version for _, out, _ in flat]),
        min_version=long([out.extra.get("min_weight_version", out.weight_version) for _, out, _ in flat]),
        max_version=long([out.extra.get("max_weight_version", out.weight_version) for _, out, _ in flat]),
        continuations=long([int(out.extra.get("continuations", 0)) for _, out, _ in flat]),
        rollout_logprobs=Ragged.from_rows([list(out.logprobs) for _, out, _ in flat], torch.float32),
        routes=engine_routes([out for _, out, _ in flat]),
        texts=[tokenizer.decode(r, skip_special_tokens=True) for r in responses],
    )


def rollout_rows(engine: Any, tokenizer: Any, rows: Sequence[Any], sampling: SamplingParams,
                 seeds: list[int] | None, group_offset: int, agent_cfg: Any = None) -> RolloutBatch:
    """Samples for data rows (`PromptSample`): single-turn generation, or multi-turn
    trajectories with tools / environments when the job configures an agent (polyrl/agents)."""
    images = [getattr(r, "images", None) for r in rows]
    if agent_cfg is None or not agent_cfg.enabled:
        return generate_batch(engine, tokenizer, [r.prompt_ids for r in rows], sampling, seeds, group_offset,
                              images)
    if any(i is not None for i in images):  # the agent loop's turns carry token ids only
        raise ValueError("agent: multi-turn rollouts of image prompts are not supported yet "
                         "(docs/vision.md); leave agent off for vision-language data")
    from polyrl.agents import run_trajectories_sync

    out = run_trajectories_sync(engine, tokenizer, rows, sampling, agent_cfg, seeds=seeds,
                                group_offset=group_offset)
    stats = out.stats
    column = lambda name, dtype: torch.tensor([getattr(s, name) for s in stats], dtype=dtype)  # noqa: E731
    out.batch.agent = AgentColumns(
        turns=column("turns", torch.long), tool_calls=column("tool_calls", torch.long),
        tool_errors=column("tool_errors", torch.long), tool_timeouts=column("tool_timeouts", torch.long),
        tool_seconds=column("tool_seconds", torch.float32), env_errors=column("env_errors", torch.long),
        limit=torch.tensor([AGENT_LIMITS.index(s.limit or "") for s in stats], dtype=torch.long),
        env_rewards=out.env_rewards, prefix_mismatch=column("prefix_mismatch", torch.long),
        reward_terms=out.reward_terms)
    out.batch.prompts = None  # the driver attaches its own rows
    return out.batch
