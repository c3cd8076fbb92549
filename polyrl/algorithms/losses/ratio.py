"""The one guard on log importance ratios, shared by the policy losses and the off-policy
correction (polyrl/algorithms/off_policy.py)."""

from __future__ import annotations

LOG_RATIO_CLAMP = 20.0
"""exp(20) ~ 5e8: a ratio beyond that carries no information, would overflow in fp16 and, summed
over a response, in products of token ratios; every log-ratio is clamped to +-this first."""
