"""Every remote wait has a timeout; on expiry the error names who did not answer and where.

A hang with no message is the field's most expensive failure (R5 in docs/architecture.md): a user waits
hours, then has to guess which rank stalled. Here a wait that expires raises at once with the
names of the missing workers and the phase they were in.
"""

from __future__ import annotations

from typing import Any, Sequence

import ray


class RemoteTimeout(TimeoutError):
    def __init__(self, phase: str, missing: list[str], timeout_s: float):
        self.phase, self.missing = phase, missing
        super().__init__(
            f"{phase}: no answer after {timeout_s:.0f}s from {', '.join(missing)}; they are "
            f"stalled or dead (raise ray.timeout_s if this step is legitimately slow)"
        )


def gather(refs: Sequence[Any], names: Sequence[str], *, phase: str, timeout_s: float) -> list[Any]:
    """`ray.get(refs)` with a deadline; raises RemoteTimeout naming the refs that did not finish."""
    refs = list(refs)
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        pending_set = set(pending)
        missing = [name for ref, name in zip(refs, names) if ref in pending_set]
        raise RemoteTimeout(phase, missing, timeout_s)
    return ray.get(refs)
