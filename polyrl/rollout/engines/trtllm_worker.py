"""The TensorRT-LLM worker extension polyrl's TRT-LLM adapter names in `ray_worker_extension_cls`.

TRT-LLM mixes the named class into each of its Ray workers (by dotted path: it imports this
module and reads the attribute) and calls its methods through `collective_rpc`. polyrl's
extension is TRT-LLM's own `tensorrt_llm.llmapi.rlhf_utils.WorkerExtension` plus what it lacks
for vision-language models:

- `supports_partial_loading()`: whether the served model's `load_weights` takes
  `allow_partial_loading` (TRT-LLM's `ModelLoader` passes the argument only to a `load_weights`
  that declares it, and asserts it is False for one that does not). The stock extension has no
  such method: the adapter then answered "no" for every model.
- `update_weights(handles)`: the stock one reloads every flush with `allow_partial_loading=True`,
  which that assertion refuses for a vision-language model whose `load_weights` lacks the
  argument. Here such a model is reloaded without it; the adapter sends it the whole state in
  one flush (polyrl/rollout/engines/weight_flush.py asks `supports_partial_loading` first).

The class itself is built on first access (`__getattr__` below), so importing this module needs
no TRT-LLM: the CPU tests and the docs read it without one.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

EXTENSION_NAME = "PolyrlTRTLLMWorkerExtension"


def accepts_partial_loading(load_weights: Callable[..., Any]) -> bool:
    """Whether a TRT-LLM model's `load_weights` declares `allow_partial_loading` (the test
    `ModelLoader` applies before passing it)."""
    return "allow_partial_loading" in inspect.getfullargspec(load_weights).args


@contextlib.contextmanager
def whole_state_reload(loader: Any) -> Iterator[None]:
    """For the duration, `loader.reload(model, weights, allow_partial_loading=...)` reloads
    without partial loading whatever it is asked: the call the stock extension makes with
    True, for a model that cannot take it. Only the instance's own attribute changes."""
    own = vars(loader).get("reload")
    reload = loader.reload

    def without_partial(model: Any, weights: Any, allow_partial_loading: bool = False) -> Any:
        return reload(model, weights)

    loader.reload = without_partial
    try:
        yield
    finally:
        if own is None:
            del loader.reload
        else:
            loader.reload = own


class PartialLoadingAware:
    """The methods polyrl adds to TRT-LLM's stock extension (mixed in before it)."""

    def supports_partial_loading(self) -> bool:
        return accepts_partial_loading(self.engine.model_engine.model.load_weights)

    def update_weights(self, ipc_handles: dict | None = None):
        if ipc_handles is None or self.supports_partial_loading():
            return super().update_weights(ipc_handles)
        with whole_state_reload(self.engine.model_engine.model_loader):
            return super().update_weights(ipc_handles)


def _build() -> type:
    from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension

    cls = type(EXTENSION_NAME, (PartialLoadingAware, WorkerExtension), {"__module__": __name__})
    globals()[EXTENSION_NAME] = cls  # found by name from now on (pickling included)
    return cls


def __getattr__(name: str) -> Any:
    if name == EXTENSION_NAME:
        return _build()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
