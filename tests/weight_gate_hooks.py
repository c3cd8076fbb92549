"""Landing a weight update mid-generation deterministically: a hook on the native engine's decode
step starts the update and holds the step until the update has paused the WeightGate
(polyrl/workers/partial_rollout.py), so no test paces or polls the engine with sleeps."""

from __future__ import annotations

import threading


def publish_mid_turn(inner, gate, weights, after_decode_steps, version=1):
    """Publish `weights` as `version` through `gate` once the native engine `inner` has made
    `after_decode_steps` decode steps in all: the engine's next step waits until the update has paused the
    gate (and, with abort, aborted the turn), so it lands mid-turn however fast or busy the machine.
    Returns the publishing thread (joined by the caller), an event set once the update applied and
    one set once it paused the gate."""
    applied, paused = threading.Event(), threading.Event()

    class ObservedCondition(threading.Condition):
        def wait_for(self, predicate, timeout=None):  # the publisher waits: the gate is paused
            if threading.current_thread() is publisher:
                paused.set()
            return super().wait_for(predicate, timeout)

    def publish():
        gate.update_weights(weights, version)
        applied.set()

    publisher = threading.Thread(target=publish, name="publisher")
    gate._cond = ObservedCondition()
    step = inner._step

    def step_after_publishing():
        if inner.stats["decode_steps"] >= after_decode_steps and not publisher.is_alive() and not applied.is_set():
            publisher.start()
            assert paused.wait(60)
        step()

    inner._step = step_after_publishing
    return publisher, applied, paused
