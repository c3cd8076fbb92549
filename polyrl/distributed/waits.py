"""Every remote wait has a timeout; on expiry the error names who did not answer and where.

A hang with no message is the field's most expensive failure (R5 in docs/architecture.md): a user waits
hours, then has to guess which rank stalled. Here a wait that expires raises at once with the
names of the missing workers and the phase they were in.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ray.exceptions import RayActorError

# ray is imported where it waits: a rank's watchdog re-exports these names, and the collectives
# and weight sync it guards must run where Ray is not installed (scripts/gpu_check.sh --quick)

WAIT_SLICE_S = 1.0
"""Longest single ray.wait: how long a signal can wait for its handler during a gather."""


class RemoteActorDied(RuntimeError):
    """An actor of the run died while the driver waited on it (its process exited: killed,
    out of memory, or crashed). The message names the actor; callers that know the last
    checkpoint add that rerunning resumes from it."""

    def __init__(self, phase: str, actor: str, reason: str):
        self.phase, self.actor, self.reason = phase, actor, reason
        super().__init__(f"{phase}: {actor} died ({reason})")


class RemoteTimeout(TimeoutError):
    def __init__(self, phase: str, missing: list[str], timeout_s: float):
        self.phase, self.missing = phase, missing
        super().__init__(
            f"{phase}: no answer after {timeout_s:.0f}s from {', '.join(missing)}; they are "
            f"stalled or dead (raise ray.timeout_s if this step is legitimately slow)"
        )


def gather(refs: Sequence[Any], names: Sequence[str], *, phase: str, timeout_s: float) -> list[Any]:
    """`ray.get(refs)` with a deadline; raises RemoteTimeout naming the refs that did not finish
    and RemoteActorDied naming the first whose actor died (not Ray's multi-line traceback)."""
    import ray
    from ray.exceptions import RayActorError

    refs = list(refs)
    deadline = time.monotonic() + timeout_s
    pending = refs
    while pending:
        # in slices: Ray runs Python's signal handlers only when a wait returns, so one long wait
        # on ranks stuck in set-up held a SIGTERM / Ctrl-C for up to ray.timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=min(WAIT_SLICE_S, left))
        except SystemError as exc:
            # a signal handler that raised inside Ray's C wait surfaces as a SystemError with the
            # handler's exception as its context: raise that (KeyboardInterrupt, the trainer's
            # interrupt) so callers see the signal, not Ray's internals
            if exc.__context__ is not None:
                raise exc.__context__ from None
            raise
    if pending:
        pending_set = set(pending)
        missing = [name for ref, name in zip(refs, names) if ref in pending_set]
        raise RemoteTimeout(phase, missing, timeout_s)
    try:
        return ray.get(refs)
    except RayActorError:
        pass
    for ref, name in zip(refs, names):  # all are done: find whose actor died
        try:
            ray.get(ref)
        except RayActorError as exc:
            raise RemoteActorDied(phase, name, death_reason(exc)) from None
    raise AssertionError("unreachable: ray.get raised RayActorError for none of the refs")


def death_reason(exc: RayActorError) -> str:
    """One line of why: Ray's own explanation is its message's last line (after the actor's
    class, id, pid, ... lines)."""
    lines = [line.strip() for line in str(getattr(exc, "error_msg", None) or exc).splitlines()]
    reason = next((line for line in reversed(lines) if line), "no reason given")
    return reason if len(reason) <= 300 else reason[:297] + "..."
