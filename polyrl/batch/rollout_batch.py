"""The batch of one RL step: what rollout produces, the driver scores, and the trainer trains on.

Columnar and typed: one field per quantity, every per-token field a `Ragged` aligned with
`response_ids` (entry k of row i belongs to response token k of sample i), every per-sequence
field a `[N]` tensor, so a batch crosses Ray as a handful of tensors. Per-sequence quantities
(reward, outcome advantage) are stored once per sequence, not broadcast over its tokens.

Chosen over `tensordict.TensorDict` (verl's choice) because TensorDict wants a shared padded
batch shape: ragged rows would be padded to the longest response, the very cost this type avoids,
and the flat layout is what a packed (varlen) forward reads directly.

Lifecycle (`docs/architecture.md`, "The batch"):
    rollout  -> prompt_ids, response_ids, loss_mask, rollout_logprobs, versions, stop reasons, texts
    driver   -> rewards, acc (scoring); ref_logprobs; advantages or token_advantages
    trainer  -> old_logprobs (proximal, when an update takes several optimizer steps)
Driver-only fields (`texts`, `prompts`) are dropped by `for_training()` before the batch goes to
the policy ranks; the prompts' images stay, as `images` (polyrl/batch/images.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.batch import images as image_column
from polyrl.batch.ragged import Ragged

AGENT_LIMITS = ("", "turns", "response_tokens", "tool_seconds", "context")
"""`AgentColumns.limit` codes: which limit ended a trajectory ("" = none)."""


@dataclass
class AgentColumns:
    """Per-trajectory statistics of multi-turn rollouts (polyrl/agents), each [N]."""

    turns: torch.Tensor
    tool_calls: torch.Tensor
    tool_errors: torch.Tensor
    tool_timeouts: torch.Tensor
    tool_seconds: torch.Tensor
    env_errors: torch.Tensor
    limit: torch.Tensor
    """int64 index into AGENT_LIMITS."""
    env_rewards: torch.Tensor
    """float32: the environment's reward, NaN where no environment gave one."""
    prefix_mismatch: torch.Tensor
    """int64: 1 where a black-box agent's turns did not chain (the trajectory gets no loss)."""
    reward_terms: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """float32 per named reward term a black-box agent returned (a verifiers rubric's weighted
    functions: polyrl/agents/verifiers_env.py), NaN where a trajectory has none; reward/<name>."""

    def select(self, idx: torch.Tensor) -> AgentColumns:
        return AgentColumns(**{f.name: getattr(self, f.name)[idx] for f in dataclasses.fields(self)
                               if f.name != "reward_terms"},
                            reward_terms={k: v[idx] for k, v in self.reward_terms.items()})

    @staticmethod
    def cat(parts: Sequence[AgentColumns]) -> AgentColumns:
        names = sorted({k for p in parts for k in p.reward_terms})
        terms = {k: torch.cat([p.reward_terms.get(k, torch.full((len(p.turns),), math.nan)) for p in parts])
                 for k in names}
        return AgentColumns(**{f.name: torch.cat([getattr(p, f.name) for p in parts])
                               for f in dataclasses.fields(AgentColumns) if f.name != "reward_terms"},
                            reward_terms=terms)

    def metrics(self) -> dict[str, float]:
        n = max(len(self.turns), 1)
        out = {"agent/turns_mean": float(self.turns.sum()) / n,
               "agent/tool_calls_mean": float(self.tool_calls.sum()) / n,
               **{f"agent/{k}": float(getattr(self, k).sum())
                  for k in ("tool_errors", "tool_timeouts", "tool_seconds", "env_errors", "prefix_mismatch")}}
        for code, name in enumerate(AGENT_LIMITS[1:], start=1):
            out[f"agent/limit_{name}"] = float((self.limit == code).sum())
        given = self.env_rewards[~self.env_rewards.isnan()]
        if len(given):
            out["agent/env_reward_mean"] = float(given.mean())
        for name, values in self.reward_terms.items():
            given = values[~values.isnan()]
            if len(given):
                out[f"reward/{name}"] = float(given.mean())
        return out


STOP_REASONS = ("stop", "length", "aborted")
"""`stop_reason` codes (rollout/base.py StopReason): stop = EOS / stop token or string,
length = hit max_tokens, aborted = cut short."""


@dataclass
class RolloutBatch:
    prompt_ids: Ragged
    response_ids: Ragged
    loss_mask: Ragged
    """float, 1 on tokens the policy sampled and trains on; 0 on tokens it did not sample
    (tool / environment output inside a multi-turn response)."""
    group: torch.Tensor
    """[N] int64: index of the prompt a sample answers (its GRPO group)."""
    stop_reason: torch.Tensor
    """[N] int64 index into STOP_REASONS."""
    finished_with_eos: torch.Tensor
    """[N] bool: the response ends with one of the model's EOS tokens."""
    weight_version: torch.Tensor
    """[N] int64: policy version the engine served when the response finished."""
    min_version: torch.Tensor
    """[N] int64: oldest policy version that produced a token of the response (async staleness)."""
    max_version: torch.Tensor
    """[N] int64: newest such version (differs from min_version after a partial rollout)."""
    continuations: torch.Tensor
    """[N] int64: times the response was continued after a weight update (partial rollout)."""
    rollout_logprobs: Ragged | None = None
    """Log-probs the engine computed while sampling (the behaviour policy)."""
    old_logprobs: Ragged | None = None
    """Proximal log-probs: the trainer's pre-update policy, recomputed when an update takes
    several optimizer steps (None: the ratio's old side is rollout_logprobs or the detached
    forward of a single-step update)."""
    ref_logprobs: Ragged | None = None
    values: Ragged | None = None
    """Critic values per response token at rollout time (PPO with a critic)."""
    returns: Ragged | None = None
    """GAE returns per response token: the critic's regression targets."""
    rewards: torch.Tensor | None = None
    """[N] float32 scalar reward per sequence."""
    acc: torch.Tensor | None = None
    """[N] float32 task accuracy per sequence (reward may add shaping; acc does not)."""
    advantages: torch.Tensor | None = None
    """[N] float32: one advantage per sequence (outcome estimators), broadcast over its tokens."""
    token_advantages: Ragged | None = None
    """Per-token advantages (token-level rewards such as KL in the reward); wins over `advantages`."""
    images: list[Any] | None = None
    """Per sample, its prompt's `ImageInputs` (polyrl/data/multimodal.py) or None (text-only);
    None for a batch without images. Set from `prompts` by `for_training()`; the forward feeds
    each micro-batch's samples' images to the model (polyrl/training/vlm.py)."""
    routes: Ragged | None = None
    """Mixture-of-experts models: the expert ids each response token was routed to, per MoE
    layer (polyrl/batch/routes.py), to replay in the trainer (`actor.router_replay`); None
    otherwise."""
    agent: AgentColumns | None = None
    """Multi-turn rollouts: per-trajectory turns, tool calls, errors, limits, environment rewards."""
    texts: list[str] | None = None
    """Decoded responses (driver: scoring and sample logs); multi-turn: the final assistant turn."""
    prompts: list[Any] | None = None
    """The data row (`PromptSample`) each sample answers (driver: scoring and sample logs)."""

    # --- size and rows ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_ids.lengths

    @property
    def lengths(self) -> torch.Tensor:
        """[N] prompt + response tokens per sample."""
        return self.prompt_ids.lengths + self.response_ids.lengths

    @property
    def truncated(self) -> torch.Tensor:
        return self.stop_reason == STOP_REASONS.index("length")

    def stop_reasons(self) -> list[str]:
        return [STOP_REASONS[i] for i in self.stop_reason.tolist()]

    def token_advantage_rows(self) -> Ragged | None:
        """Advantages per response token (the per-sequence ones broadcast)."""
        if self.token_advantages is not None:
            return self.token_advantages
        if self.advantages is None:
            return None
        return self.response_ids.with_values(
            torch.repeat_interleave(self.advantages.float(), self.response_lengths))

    # --- whole-batch operations --------------------------------------------------------------------
    def select(self, indices: Sequence[int] | torch.Tensor) -> RolloutBatch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        rows = idx.tolist()
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif isinstance(v, (Ragged, AgentColumns)):
                out[f.name] = v.select(idx)
            elif isinstance(v, torch.Tensor):
                out[f.name] = v[idx]
            else:
                out[f.name] = [v[i] for i in rows]
        return RolloutBatch(**out)

    @staticmethod
    def cat(parts: Sequence[RolloutBatch]) -> RolloutBatch:
        if not parts:
            raise ValueError("cannot concatenate zero batches")
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            vs = [getattr(p, f.name) for p in parts]
            if f.name == "images" and any(v is not None for v in vs):  # text-only parts: no images
                vs = [[None] * len(p) if v is None else v for p, v in zip(parts, vs)]
            present = [v is not None for v in vs]
            if not any(present):
                out[f.name] = None
            elif not all(present):
                raise ValueError(f"RolloutBatch.cat: field {f.name!r} is set in some parts only")
            elif isinstance(vs[0], (Ragged, AgentColumns)):
                out[f.name] = type(vs[0]).cat(vs)
            elif isinstance(vs[0], torch.Tensor):
                out[f.name] = torch.cat(vs)
            else:
                out[f.name] = [x for v in vs for x in v]
        return RolloutBatch(**out)

    def replace(self, **changes: Any) -> RolloutBatch:
        return dataclasses.replace(self, **changes)

    def for_training(self) -> RolloutBatch:
        """Without the driver-only fields: what the policy ranks need (the prompts' images kept
        as `images`)."""
        images = self.images if self.images is not None else image_column.images_of(self.prompts)
        return self.replace(texts=None, prompts=None, images=images)

    # --- pickling: images as a few numpy arrays (polyrl/batch/images.py) ---------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if state.get("images") is not None:
            state["images"] = _PackedImages(image_column.pack(state["images"]))
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("images"), _PackedImages):
            state["images"] = image_column.unpack(*state["images"].arrays)
        self.__dict__.update(state)


@dataclass
class _PackedImages:
    arrays: tuple


def split_evenly(items: list, parts: int) -> list[list]:
    """Exactly `parts` contiguous chunks (some may be empty), sizes differing by at most one.

    Every rank must run the same number of optimizer steps (each ends in a collective), so a
    chunk list never gets shorter when there are fewer items than parts."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def shard(batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
    """`parts` contiguous shards of `batch` (some may be empty), for the ranks in order."""
    return [batch.select(chunk) for chunk in split_evenly(list(range(len(batch))), parts)]
