"""`AlgorithmConfig`: which advantage estimator, policy loss, KL and entropy terms, and the DAPO
batch shaping (dynamic sampling, overlong treatment).

GRPO, Dr. GRPO (`norm_adv_by_std=False`), RLOO, REINFORCE++ with a group baseline, PPO with a
critic (`adv_estimator=gae`), GSPO (`policy_loss=gspo|gspo_token`) and DAPO (clip-higher via
`clip_ratio_high`, `dynamic_sampling`, `overlong`, `loss_agg_mode="token-mean"`).
Combinations that cannot run are rejected at start; docs/algorithms.md lists every choice.
The estimator and the policy loss are registry keys: a built-in name, one a package registers by
entry point, or a user's function by import path (docs/plugins.md), checked here, when the
config is built, by importing it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from polyrl.algorithms.off_policy_config import OffPolicyConfig
from polyrl.algorithms.overlong_config import OverlongConfig
from polyrl.config import Config

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
"""Estimators whose baseline is computed from the other samples of the same prompt."""

VALUE_ESTIMATORS = ("gae",)
"""Estimators whose baseline is a learned critic's values (they need a critic)."""

GSPO_LOSSES = ("gspo", "gspo_token")
"""Policy losses on GSPO's sequence-level ratio (their clip range is gspo_clip_ratio_*)."""

GSPO_MAX_CLIP = 0.05
"""A GSPO clip range at or above this is on the token-level scale (PPO's 0.2): GSPO's ratio is a
geometric mean over the response, which moves ~1/|y| as much, so such a range never binds."""


class AlgorithmConfig(Config):
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo (group mean/std), rloo (leave-one-out mean), reinforce_pp
    (REINFORCE++ with group-mean baseline, then whitened over the whole batch), gae (PPO with a
    critic: generalized advantage estimation from the critic's values; needs a critic), one
    registered in the polyrl.advantage_estimators entry-point group, or your own function as
    package.module:function or /path/to/file.py:function (docs/plugins.md)."""

    gamma: float = Field(1.0, ge=0, le=1)
    """gae only: discount per policy token (tool output inside a response is not a step)."""

    lam: float = Field(1.0, ge=0, le=1)
    """gae only: GAE's lambda; 1 gives Monte-Carlo returns minus the value baseline, 0 one-step
    TD errors (lower variance, more critic bias)."""

    whiten_advantages: bool = True
    """gae only: standardise the advantages over the batch's valid tokens (mean 0, std 1)."""

    value_clip_range: float | None = Field(0.5, gt=0)
    """gae only: the critic's loss clips its new values to within this of the values the
    advantages were computed with (PPO's value clipping); null for the plain squared error."""

    norm_adv_by_std: bool = True
    """GRPO only: divide by the group's reward std. False gives Dr. GRPO (arXiv:2503.20783),
    which removes the difficulty bias that std normalisation introduces."""

    adv_eps: float = Field(1e-6, gt=0)
    """Added to the std before dividing, so a near-tied group does not blow up."""

    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""

    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO clip: the ratio is clipped above at 1 + clip_ratio_high. DAPO's clip-higher uses 0.28."""

    dual_clip_c: float | None = None
    """Dual-clip constant (arXiv:1912.09729): for negative advantages the loss is bounded by
    -A * c. None disables; must be > 1 (typical 3)."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How the [B, T] loss matrix becomes a scalar. token-mean weighs every token equally (DAPO);
    seq-mean-token-mean is the original GRPO; seq-mean-token-sum is Dr. GRPO's."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of KL(policy || reference) per token (http://joschu.net/blog/kl-approx.html).
    k3 is unbiased and low variance; it is what GRPO's KL loss uses."""

    use_kl_in_reward: bool = False
    """Subtract kl_coef * sum_t KL_t from each sequence's reward before computing advantages."""

    use_kl_loss: bool = False
    """Add kl_coef * KL (aggregated like the policy loss) to the actor loss (GRPO's choice)."""

    kl_coef: float = Field(0.001, ge=0)
    """Weight of the KL term (reward penalty or loss, whichever is on)."""

    entropy_coeff: float = Field(0.0, ge=0)
    """Weight of an entropy bonus in the actor loss (loss -= entropy_coeff * entropy). 0 = off;
    entropy is still reported as a metric."""

    filter_tied_groups: bool = False
    """Drop groups whose samples all got the same reward (their group-baseline advantages are
    zero, they only dilute the batch) without generating replacements; dynamic_sampling refills."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling (arXiv:2503.14476 sec. 3.2): drop tied groups and generate further
    rounds of prompts until the step has data.train_batch_size groups whose rewards differ."""

    max_sampling_rounds: int = Field(3, ge=1)
    """dynamic_sampling only: at most this many generation rounds per step; a step that is still
    short trains on the informative groups it has and counts the shortfall."""

    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """DAPO's overlong reward shaping and filtering (polyrl/algorithms/overlong.py)."""

    policy_loss: str = "ppo_clip"
    """Policy loss: ppo_clip, gspo (sequence-level ratio), gspo_token (GSPO-token: sequence ratio
    value, per-token gradient and advantages), one registered in the polyrl.policy_losses
    entry-point group, or your own function as package.module:function or
    /path/to/file.py:function (docs/plugins.md)."""

    gspo_clip_ratio_low: float = Field(3e-4, ge=0, lt=1)
    """gspo / gspo_token: the sequence ratio is clipped below at 1 - gspo_clip_ratio_low (GSPO
    paper sec. 5.1: 3e-4). Must be below 0.05 (token-level ranges never bind)."""

    gspo_clip_ratio_high: float = Field(4e-4, ge=0)
    """gspo / gspo_token: the sequence ratio is clipped above at 1 + gspo_clip_ratio_high (GSPO
    paper sec. 5.1: 4e-4). Must be below 0.05."""

    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    """Correction for the gap between the rollout engine's policy (its log-probs travel with each
    sample) and the trainer's pre-update policy: truncated importance sampling and/or masking
    (see polyrl/algorithms/off_policy.py and docs/async.md)."""

    @model_validator(mode="after")
    def _check_combinations(self) -> "AlgorithmConfig":
        if self.use_kl_in_reward and self.use_kl_loss:
            raise ValueError(
                "use_kl_in_reward and use_kl_loss are both true, which penalises KL twice; "
                "set algorithm.use_kl_loss=false (reward penalty) or "
                "algorithm.use_kl_in_reward=false (KL loss)"
            )
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(
                f"dual_clip_c={self.dual_clip_c} must be > 1 (the bound -A*c must lie above the "
                "clipped loss); set algorithm.dual_clip_c=3 or null to disable"
            )
        self._check_gspo()
        self._check_value_estimator()
        return self

    @field_validator("adv_estimator")
    @classmethod
    def _resolve_estimator(cls, name: str) -> str:
        """Registered, or an import path that imports to a callable; the error lists the choices."""
        if name in VALUE_ESTIMATORS:
            return name
        # lazy: the registries' modules import this one, and config modules import no others
        from polyrl.algorithms.advantages import ADV_ESTIMATORS

        return _resolve(ADV_ESTIMATORS, name, extra_choices=VALUE_ESTIMATORS)

    @field_validator("policy_loss")
    @classmethod
    def _resolve_policy_loss(cls, name: str) -> str:
        from polyrl.algorithms.losses import POLICY_LOSSES

        return _resolve(POLICY_LOSSES, name)

    def _check_gspo(self) -> None:
        for key in ("gspo_clip_ratio_low", "gspo_clip_ratio_high"):
            value = getattr(self, key)
            if value >= GSPO_MAX_CLIP:
                raise ValueError(
                    f"{key}={value} is a token-level clip range; GSPO clips a length-normalised "
                    f"sequence ratio that moves ~1/|y| as much, so it must be below "
                    f"{GSPO_MAX_CLIP}: set algorithm.{key}="
                    f"{'3e-4' if key.endswith('low') else '4e-4'} (GSPO paper sec. 5.1)")
        if self.policy_loss not in GSPO_LOSSES:
            return
        if self.loss_agg_mode != "seq-mean-token-mean":
            raise ValueError(
                f"policy_loss={self.policy_loss} averages per response (GSPO eq. 5: 1/G sum_i); "
                f"loss_agg_mode={self.loss_agg_mode} would weigh responses by length: set "
                "algorithm.loss_agg_mode=seq-mean-token-mean")
        if self.dual_clip_c is not None:
            raise ValueError(
                f"dual_clip_c applies to policy_loss=ppo_clip only, not {self.policy_loss}; set "
                "algorithm.dual_clip_c=null")
        if self.policy_loss == "gspo" and self.adv_estimator in VALUE_ESTIMATORS:
            raise ValueError(
                "policy_loss=gspo needs one advantage per response, but adv_estimator=gae gives "
                "one per token; set algorithm.policy_loss=gspo_token (GSPO-token, sec. 4.3)")

    def _check_value_estimator(self) -> None:
        if self.adv_estimator not in VALUE_ESTIMATORS:
            return
        for key in ("dynamic_sampling", "filter_tied_groups"):
            if getattr(self, key):
                raise ValueError(
                    f"{key}=true drops groups with tied rewards because a group baseline gives "
                    f"them zero advantage; with adv_estimator={self.adv_estimator} the critic's "
                    f"baseline still gives them signal: set algorithm.{key}=false")

    @property
    def plugin_specs(self) -> list[str]:
        """The keys naming a user's code by import path (their directories must reach every Ray
        worker: polyrl/envplan/code_paths.py)."""
        from polyrl.config.targets import is_import_path

        return [s for s in (self.adv_estimator, self.policy_loss) if is_import_path(s)]

    @property
    def uses_reference(self) -> bool:
        """Whether a reference policy's log-probs are needed at all."""
        return (self.use_kl_in_reward or self.use_kl_loss) and self.kl_coef > 0

    @property
    def uses_critic(self) -> bool:
        """Whether the advantages need a critic's values (adv_estimator=gae)."""
        return self.adv_estimator in VALUE_ESTIMATORS

    @property
    def drops_tied_groups(self) -> bool:
        """Whether groups with all-equal rewards leave the batch (filtered or dynamic sampling)."""
        return self.filter_tied_groups or self.dynamic_sampling


def _resolve(registry, name: str, extra_choices: tuple[str, ...] = ()) -> str:
    """`name` if `registry` resolves it to a callable (importing an import path), else a
    ValueError of one line: the valid choices, or why the import path did not load."""
    from polyrl.config.targets import IMPORT_PATH_FORMS, is_import_path
    from polyrl.registry import RegistryError

    try:
        obj = registry.get(name)
    except RegistryError as exc:
        if name in registry or is_import_path(name):  # registered or an import path: it failed to load
            raise ValueError(str(exc)) from None
        choices = ", ".join([*registry.names(), *extra_choices])
        raise ValueError(f"{name!r} is not one of {choices}, or {IMPORT_PATH_FORMS}") from None
    except Exception as exc:  # noqa: BLE001 - an entry point's module failed to import
        raise ValueError(f"{registry.kind} '{name}': loading it raised {type(exc).__name__}: "
                         f"{(str(exc).strip().splitlines() or [''])[0]}") from None
    if not callable(obj):
        raise ValueError(f"{registry.kind} '{name}' names a {type(obj).__name__}, not a function "
                         "(docs/plugins.md has the signature)")
    return name


def check_samples_per_prompt(cfg: AlgorithmConfig, n: int) -> None:
    """Raise if `n` samples per prompt cannot form the estimator's group baseline, or cannot
    ever differ within a group (which dropping tied groups needs)."""
    if cfg.drops_tied_groups and n < 2:
        key = "dynamic_sampling" if cfg.dynamic_sampling else "filter_tied_groups"
        raise ValueError(
            f"algorithm.{key}=true keeps only groups whose rewards differ, and a group of "
            f"rollout.n={n} sample never differs; set rollout.n=8 (or any value >= 2)")
    if cfg.adv_estimator in GROUP_ESTIMATORS and n < 2:
        name = {"grpo": "GRPO", "rloo": "RLOO", "reinforce_pp": "REINFORCE++ (group baseline)"}
        raise ValueError(
            f"{name[cfg.adv_estimator]} needs rollout.n >= 2 samples per prompt to form a group "
            f"baseline, got rollout.n={n}; set rollout.n=8 (or any value >= 2)"
        )


def check_rollout(cfg: AlgorithmConfig, *, n: int, response_length: int) -> None:
    """Every check of the algorithm against the rollout section (rollout.n, response_length)."""
    check_samples_per_prompt(cfg, n)
    buffer = cfg.overlong.buffer_length
    if cfg.overlong.shaping and buffer is not None and buffer >= response_length:
        raise ValueError(
            f"algorithm.overlong.buffer_length={buffer} must be below rollout.response_length="
            f"{response_length} (the ramp ends at the limit); set algorithm.overlong."
            f"buffer_length={max(1, response_length // 5)} (a fifth, as in DAPO)")


def check_critic(cfg: AlgorithmConfig, has_critic: bool) -> None:
    """Raise if a critic is configured without an estimator that uses it, or the other way round.

    `has_critic`: whether the job configures a critic (the critic section is the trainer's).
    """
    if has_critic and not cfg.uses_critic:
        raise ValueError(
            f"a critic section is configured but algorithm.adv_estimator={cfg.adv_estimator} "
            "never reads its values (only gae does); set algorithm.adv_estimator=gae or remove "
            "the critic section")
    if cfg.uses_critic and not has_critic:
        raise ValueError(
            f"algorithm.adv_estimator={cfg.adv_estimator} needs a critic's values; add a critic "
            "section, or pick an estimator with a group baseline (algorithm.adv_estimator=grpo)")
