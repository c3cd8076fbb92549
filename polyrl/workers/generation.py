"""Turn engine outputs into training samples; shared by colocated and standalone rollout."""

from __future__ import annotations

from typing import Any

from polyrl.rollout.base import SamplingParams
from polyrl.workers.batch import Sample


def generate_samples(engine: Any, tokenizer: Any, prompts: list[list[int]], sampling: dict,
                     seeds: list[int] | None, group_offset: int) -> list[Sample]:
    """n samples for each prompt; samples of prompt i get group `group_offset + i`.

    A seed per prompt makes rollouts reproducible whatever else shares the batch."""
    params = [SamplingParams(**sampling, seed=seed).validate()
              for seed in (seeds or [None] * len(prompts))]
    outputs = engine.generate_batch(prompts, params)
    eos = set(engine.eos_token_ids)
    samples = []
    for i, (prompt, outs) in enumerate(zip(prompts, outputs)):
        for out in outs:
            samples.append(Sample(
                prompt_ids=list(prompt), response_ids=list(out.token_ids),
                rollout_logprobs=list(out.logprobs), weight_version=out.weight_version,
                group=group_offset + i, stop_reason=out.stop_reason,
                finished_with_eos=out.stop_reason == "stop" and bool(out.token_ids)
                and out.token_ids[-1] in eos,
                text=tokenizer.decode(out.token_ids, skip_special_tokens=True),
            ))
    return samples
