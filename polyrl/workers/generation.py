"""Turn engine outputs into training samples; shared by colocated and standalone rollout."""

from __future__ import annotations

from typing import Any, Sequence

from polyrl.rollout.base import SamplingParams, TokenOutput
from polyrl.workers.batch import Sample


def sampling_params(sampling: dict, seeds: Sequence[int | None] | None, count: int) -> list[SamplingParams]:
    """One validated SamplingParams per prompt; a seed per prompt makes rollouts reproducible
    whatever else shares the batch."""
    return [SamplingParams(**sampling, seed=seed).validate() for seed in (seeds or [None] * count)]


def generate_samples(engine: Any, tokenizer: Any, prompts: list[list[int]], sampling: dict,
                     seeds: list[int] | None, group_offset: int) -> list[Sample]:
    """n samples for each prompt; samples of prompt i get group `group_offset + i`."""
    outputs = engine.generate_batch(prompts, sampling_params(sampling, seeds, len(prompts)))
    groups = [group_offset + i for i in range(len(prompts))]
    return to_samples(tokenizer, engine.eos_token_ids, prompts, outputs, groups)


def to_samples(tokenizer: Any, eos_token_ids: Sequence[int], prompts: Sequence[Sequence[int]],
               outputs: Sequence[Sequence[TokenOutput]], groups: Sequence[int]) -> list[Sample]:
    eos = set(eos_token_ids)
    samples = []
    for prompt, outs, group in zip(prompts, outputs, groups):
        for out in outs:
            samples.append(Sample(
                prompt_ids=list(prompt), response_ids=list(out.token_ids),
                rollout_logprobs=list(out.logprobs), weight_version=out.weight_version,
                min_version=out.extra.get("min_weight_version", out.weight_version),
                max_version=out.extra.get("max_weight_version", out.weight_version),
                group=group, stop_reason=out.stop_reason,
                finished_with_eos=out.stop_reason == "stop" and bool(out.token_ids)
                and out.token_ids[-1] in eos,
                text=tokenizer.decode(out.token_ids, skip_special_tokens=True),
                extra={"continuations": out.extra["continuations"]} if "continuations" in out.extra else {},
            ))
    return samples
