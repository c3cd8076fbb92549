"""Adapters that drive vLLM, SGLang and TensorRT-LLM behind `polyrl.rollout.base.RolloutEngine`.

One module per engine; each imports its engine only when an adapter is constructed, so this
package imports on a machine without any of them (the registry names them by dotted path).
Shared pieces: `common` (the event-loop thread every adapter runs its engine's async API on,
stop-reason mapping, prompt checks) and `weight_flush` (byte-budget flushing, gathering weight
handles to the replica leader, partial-loading negotiation), both testable on CPU.
"""
