"""The vLLM worker extension polyrl's vLLM adapter names in `worker_extension_cls`.

vLLM mixes this class into each of its GPU workers (so `self.model_runner`, `self.device` and
`self.model_config` are the worker's) and calls its methods through `collective_rpc`; see vLLM's
`examples/offline_inference/rlhf_utils.py` for the pattern. Every tensor-parallel worker gets
the whole HF-named bucket and `load_weights` keeps its own shard. Imported only inside vLLM's
worker processes: nothing here runs on import.
"""

from __future__ import annotations

from typing import Any


class PolyrlWorkerExtension:
    def polyrl_begin_update(self, fp8: bool) -> None:
        """Start a version: FP8 rollout quantizes every bucket here (the receiving side)."""
        self._polyrl_fp8 = bool(fp8)
        self._polyrl_loaded = 0

    def polyrl_load_bucket(self, named: list[tuple[str, Any]]) -> int:
        """Load one bucket of HF-named tensors into the worker's model; returns how many."""
        weights = [(name, tensor.to(self.device, non_blocking=True)) for name, tensor in named]
        if getattr(self, "_polyrl_fp8", False):
            from polyrl.weights.fp8 import quantize_named_tensors

            weights = list(quantize_named_tensors(weights))
        self.model_runner.model.load_weights(weights=weights)
        self._polyrl_loaded = getattr(self, "_polyrl_loaded", 0) + len(weights)
        return len(weights)

    def polyrl_finish_update(self, version: int) -> int:
        """Post-process the loaded weights (FP8 layers repack here); returns tensors loaded."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(self.model_runner.model, self.model_config, self.device)
        self._polyrl_version = version
        return getattr(self, "_polyrl_loaded", 0)
