"""`reward.model`: a local Hugging Face sequence-classification reward model, batched.

`RewardModelRunner` loads the model and scores (prompt, response) pairs; it runs inside a Ray
reward worker (`RewardModelWorker`) with a CPU / device share of its own
(`reward_worker_options`, which the launch plan reads too), or in the driver with
`reward.model.in_process=true`. `ModelScorer` is the driver's side: it starts the worker on first
use (Ray is up by then; the manager is built before `ray.init`), sends a batch, and turns a
timeout or a dead worker into scores of 0 that are counted, like any other failed scorer.

Each pair is rendered as a chat, [prompt messages..., {"role": "assistant", "content": response}],
with the reward model's own chat template: reward models are trained on their template, not the
policy's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from polyrl.modeling import load_tokenizer, torch_dtype
from polyrl.rewards.config import ModelRewardConfig
from polyrl.rewards.outcome import Outcome

if TYPE_CHECKING:
    from polyrl.platform import Platform
    from polyrl.rewards.manager import RewardRequest

logger = logging.getLogger(__name__)


class RewardModelError(ValueError):
    """A reward model that cannot be used; the message names reward.model.<key> and the fix."""


def check_model_dir(path: str) -> Path:
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise RewardModelError(f"reward.model.path: {path} is not a Hugging Face model directory "
                               "(no config.json); give a local sequence-classification model")
    return directory


def conversation(prompt: Any, response: str) -> list[dict[str, Any]]:
    """The chat the reward model reads: the prompt's messages (a plain prompt becomes one user
    message), then the response as the assistant's turn."""
    if prompt is None:
        messages: list[dict[str, Any]] = []
    elif isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:  # parquet structs give every message every field; drop the unset ones
        messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
    return [*messages, {"role": "assistant", "content": response}]


class RewardModelRunner:
    def __init__(self, cfg: ModelRewardConfig, device: torch.device | None = None):
        from transformers import AutoModelForSequenceClassification

        directory = check_model_dir(cfg.path)
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.tokenizer = load_tokenizer(directory, cfg.trust_remote_code)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RewardModelError(f"reward.model.path: the tokenizer in {directory} has no chat "
                                   "template; add one (tokenizer_config.json chat_template) so "
                                   "prompt and response render as the reward model was trained")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"  # keep the response end: the head reads the last token
        self.tokenizer.padding_side = "right"
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                str(directory), dtype=torch_dtype(cfg.dtype, "reward.model.dtype"),
                trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise RewardModelError(f"reward.model.path: cannot load {directory} as a sequence-"
                                   f"classification model: {exc}") from None
        if model.config.num_labels != 1:
            raise RewardModelError(f"reward.model.path: {directory} has num_labels="
                                   f"{model.config.num_labels}; a reward model has one score head "
                                   "(num_labels=1)")
        if model.config.pad_token_id is None:  # the head finds each row's last token by padding
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self.device).eval()

    def render(self, prompt: Any, response: str) -> str:
        return self.tokenizer.apply_chat_template(conversation(prompt, response), tokenize=False)

    @torch.inference_mode()
    def score(self, pairs: Sequence[tuple[Any, str]]) -> list[float]:
        """One float per (prompt, response), computed in batches of similar length."""
        texts = [self.render(p, r) for p, r in pairs]
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # less padding per batch
        scores = [0.0] * len(texts)
        for start in range(0, len(order), self.cfg.batch_size):
            rows = order[start:start + self.cfg.batch_size]
            enc = self.tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.cfg.max_length,
                                 add_special_tokens=False)  # the template placed its own
            logits = self.model(**enc.to(self.device)).logits[:, 0].float().cpu()
            for i, value in zip(rows, logits.tolist()):
                scores[i] = value
        return scores


class RewardModelWorker:
    """The Ray reward worker's body (made an actor by `ModelScorer`, so importing this module
    starts nothing)."""

    def __init__(self, cfg: dict[str, Any], platform_name: str | None):
        cfg_ = ModelRewardConfig.model_validate(cfg)
        device = None
        if cfg_.num_devices > 0:
            from polyrl.platform import get_platform

            device = get_platform(platform_name).claim_device()  # made current, too
        self.runner = RewardModelRunner(cfg_, device)

    def score(self, pairs: list[tuple[Any, str]]) -> list[float]:
        return self.runner.score(pairs)


_planned_options: dict[str, Any] | None = None


def use_planned_options(options: dict[str, Any] | None) -> None:
    """The `.options(...)` the run's launch planned for the reward worker (its resources, runtime
    env and, with devices, its placement-group bundle: polyrl/topology/launch_plan.py); the
    worker is started with them. None: back to `reward_worker_options` alone."""
    global _planned_options
    _planned_options = options


def reward_worker_options(cfg: ModelRewardConfig, platform: "Platform") -> dict[str, Any] | None:
    """The Ray actor options (resources) of the reward worker; None when none is started
    (in_process). The launch plan and the placement planner add these to the job's needs."""
    if cfg.in_process:
        return None
    if cfg.num_devices > 0:
        return platform.ray_actor_options(cfg.num_devices, cfg.num_cpus)
    return {"num_cpus": cfg.num_cpus}


class ModelScorer:
    def __init__(self, cfg: ModelRewardConfig, platform_name: str | None = None):
        check_model_dir(cfg.path)  # a wrong path fails at start, not at the first step
        self.cfg = cfg
        self.platform_name = platform_name
        self._runner: RewardModelRunner | None = None
        self._actor: Any = None
        self._warned_no_prompt = False

    def _pairs(self, requests: Sequence["RewardRequest"]) -> list[tuple[Any, str]]:
        if not self._warned_no_prompt and any(r.prompt is None for r in requests):
            self._warned_no_prompt = True
            logger.warning("reward.model: requests carry no prompt; the reward model sees the "
                           "response alone (pass RewardRequest.prompt)")
        return [(r.prompt, r.solution_str) for r in requests]

    def submit(self, requests: Sequence["RewardRequest"]) -> Any:
        """Start scoring; `collect` gives the outcomes. In process, scoring happens in collect."""
        pairs = self._pairs(requests)
        if self.cfg.in_process:
            return pairs
        import ray

        if self._actor is None:
            from polyrl.platform import get_platform

            if not ray.is_initialized():
                raise RuntimeError("reward.model needs Ray running (the trainer starts it); "
                                   "outside a run set reward.model.in_process=true")
            options = _planned_options or reward_worker_options(self.cfg, get_platform(self.platform_name))
            actor_cls = ray.remote(RewardModelWorker)
            self._actor = actor_cls.options(name=None, **options).remote(
                self.cfg.model_dump(), self.platform_name)
        return self._actor.score.remote(pairs)

    def collect(self, handle: Any, n: int) -> list[Outcome]:
        if self.cfg.in_process:
            try:
                if self._runner is None:
                    self._runner = RewardModelRunner(self.cfg)
                return [Outcome(s, float(s > 0)) for s in self._runner.score(handle)]
            except RewardModelError:
                raise  # a model that cannot be used is a setup error, not a bad sample
            except Exception as exc:  # noqa: BLE001 - the batch scores 0, counted
                return [Outcome(error=exc) for _ in range(n)]
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            scores = ray.get(handle, timeout=self.cfg.timeout_s)
        except GetTimeoutError:
            ray.cancel(handle)
            return [Outcome(timed_out=True) for _ in range(n)]
        except Exception as exc:  # noqa: BLE001 - worker died or raised: scores 0, counted
            return [Outcome(error=exc) for _ in range(n)]
        return [Outcome(s, float(s > 0)) for s in scores]

    def close(self) -> None:
        if self._actor is not None:
            import ray

            ray.kill(self._actor)
            self._actor = None
