"""Routes from the vLLM and SGLang adapters (actor.router_replay=R3, issue 44; docs/moe.md).

Neither engine runs here (SGLang needs a GPU; vLLM's CPU build cannot record routes), so the
responses are built as the engines' sources build them:
- SGLang 0.5.9 to 0.5.23: the scheduler takes `host_cache.buffer[req_to_token[req][: seqlen - 1]]`
  (int32 [tokens, num_hidden_layers, k], indexed by KV slot; `RoutedExpertsCapturer.
  get_routed_experts` / `BaseTopkCapturer.get_topk`), and the detokenizer puts
  `pybase64.b64encode(t.numpy().tobytes()).decode("utf-8")` in `meta_info["routed_experts"]`
  (test_contract_sglang.py runs the releases' own encoder on these rows);
- vLLM 0.14.0 to 0.32.0: `CompletionOutput.routed_experts`, a numpy array of `num_tokens - 1`
  rows [tokens, num_hidden_layers, k] (int32 to 0.17; uint8 for <= 256 experts in 0.32).
What the adapters add is checked on their real loop and request code; the engines' names are
checked in the releases (test_contract_sglang.py, test_contract_vllm.py), and the CPU build's
refusal on the real vLLM (test_vllm_routes.py).
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch
from moe_models import moe_config

from polyrl.backends import capabilities
from polyrl.batch.routes import engine_routes, not_routed
from polyrl.rollout.base import SamplingParams
from polyrl.rollout.engines.routed_experts import (
    ENGINE_FLAG,
    asked_routes,
    response_routes,
    route_layout,
    sglang_rows,
)

LAYERS, EXPERTS, TOP_K = 3, 6, 2  # moe_config: layer 1 is a dense MLP (mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    config = moe_config("qwen3_moe", layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(path)
    return str(path)


def sequence_rows(prompt: int, response: int, seed: int = 0) -> np.ndarray:
    """What an engine holds for a sequence: [prompt + response - 1, layers, k] expert ids, the
    dense layer's rows never written (SGLang's and vLLM's buffers start as zeros / empty)."""
    g = np.random.default_rng(seed)
    rows = g.integers(0, EXPERTS, size=(prompt + response - 1, LAYERS, TOP_K)).astype(np.int32)
    rows[:, 1] = 0
    return rows


def sglang_meta(rows: np.ndarray, seed: int = 1) -> dict:
    """`meta_info` as SGLang builds it: the rows gathered from its host buffer by KV slot, then
    base64 of their int32 bytes."""
    slots = np.random.default_rng(seed).permutation(64)[: len(rows)]  # req_to_token: KV slots
    host = torch.zeros((64, LAYERS, TOP_K), dtype=torch.int32)
    host[torch.from_numpy(slots)] = torch.from_numpy(rows)
    gathered = host[torch.from_numpy(slots)]
    return {"finish_reason": {"type": "length", "length": 4},
            "routed_experts": base64.b64encode(gathered.numpy().tobytes()).decode("utf-8")}


def test_the_model_layout_keeps_the_moe_layers(moe_dir):
    layout = route_layout(moe_dir)
    assert (layout.num_layers, layout.moe_layers, layout.num_experts, layout.top_k) == (3, (0, 2), 6, 2)


def test_response_token_j_is_sequence_row_prompt_plus_j_and_the_last_is_not_routed(moe_dir):
    layout = route_layout(moe_dir)
    rows = sequence_rows(prompt=5, response=4)
    routes = response_routes(rows, 5, 4, layout, "vLLM")
    assert routes.shape == (4, 2, TOP_K) and routes.dtype == torch.uint8
    assert torch.equal(routes[:3].long(), torch.from_numpy(rows[5:8][:, [0, 2]]).long())
    assert bool((routes[3] == not_routed(torch.uint8)).all())  # never fed back
    # vLLM 0.32's compact rows (uint8) read the same
    assert torch.equal(response_routes(rows.astype(np.uint8), 5, 4, layout, "vLLM"), routes)
    # fewer rows than tokens (a dropped stop string's tokens): the rest are not routed
    short = response_routes(rows[:6], 5, 4, layout, "vLLM")
    assert torch.equal(short[0], routes[0]) and bool((short[1:] == 255).all())


def test_sglang_meta_info_decodes_to_the_rows_it_was_built_from(moe_dir):
    layout = route_layout(moe_dir)
    rows = sequence_rows(prompt=3, response=6)
    decoded = sglang_rows(sglang_meta(rows), layout)
    assert decoded.dtype == np.int32 and np.array_equal(decoded, rows)
    assert sglang_rows({"finish_reason": None}, layout) is None  # not asked
    assert sglang_rows({"routed_experts": []}, layout) is None  # 0.5.7's detokenizer for none
    with pytest.raises(RuntimeError, match="not a whole number of tokens"):
        sglang_rows({"routed_experts": base64.b64encode(b"\0" * 12).decode()}, layout)


def test_rows_of_another_model_or_ids_that_are_not_experts_are_one_line(moe_dir):
    layout = route_layout(moe_dir)
    with pytest.raises(RuntimeError, match=r"shape \(4, 2, 2\); expected \[tokens, 3 layers, 2\]"):
        response_routes(np.zeros((4, 2, 2)), 1, 3, layout, "vLLM")
    rows = sequence_rows(2, 3)
    rows[2, 0, 0] = EXPERTS + 3  # a physical id of a redundant expert
    with pytest.raises(RuntimeError, match="expert id 9 .*of 6 experts"):
        response_routes(rows, 2, 3, layout, "SGLang")


def test_routes_are_asked_only_with_the_flag_and_from_the_floor(moe_dir, tmp_path):
    assert asked_routes({}, "sglang", "0.5.6", moe_dir) is None  # R3 off: nothing asked, any version
    assert asked_routes({ENGINE_FLAG: True}, "sglang", "0.5.9", moe_dir).moe_layers == (0, 2)
    with pytest.raises(ValueError) as err:
        asked_routes({ENGINE_FLAG: True}, "sglang", "0.5.8", moe_dir)
    assert str(err.value) == (f"{ENGINE_FLAG}=true: rollout.backend=sglang serves routed_experts from sglang 0.5.9 "
                              "on, 0.5.8 is installed: pip install \"sglang>=0.5.9,<0.6\"")
    with pytest.raises(ValueError, match="vllm>=0.14.0,<0.34"):
        asked_routes({ENGINE_FLAG: True}, "vllm", "0.13.0", moe_dir)
    dense = tmp_path / "dense"
    from transformers import Qwen2Config

    Qwen2Config(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64, architectures=["Qwen2ForCausalLM"]).save_pretrained(dense)
    with pytest.raises(ValueError, match="not a Qwen3-MoE / Qwen2-MoE model"):
        asked_routes({ENGINE_FLAG: True}, "vllm", "0.32.0", str(dense))


def test_the_capabilities_declare_routes_with_floor_and_platform():
    vllm, sglang = capabilities("vllm"), capabilities("sglang")
    assert vllm.routed_experts and vllm.minimum_version("routed_experts") == "0.14.0"
    assert vllm.unavailable_on("routed_experts", "cpu") == ("vLLM's CPU build cannot return routed experts "
                                                           "(Model Runner V2 needs Triton)")
    assert vllm.unavailable_on("routed_experts", "cuda") is None
    assert sglang.routed_experts and sglang.minimum_version("routed_experts") == "0.5.9"
    assert not capabilities("trtllm").routed_experts
    from polyrl.backends import EngineCapabilities

    with pytest.raises(ValueError, match="not \\(capability, platform, why\\)"):
        EngineCapabilities(unavailable=(("speed", "cpu", "no"),))


# --- the adapters ----------------------------------------------------------------------------------

class SGLangWithRoutes:
    """`sglang.Engine.async_generate` of an engine started with enable_return_routed_experts:
    each sample's output carries its sequence's routes in meta_info when the request asks."""

    def __init__(self, rows_of_sample):
        self.rows_of_sample = rows_of_sample
        self.requests: list[dict] = []

    async def async_generate(self, **request):
        self.requests.append(request)
        out = []
        for i, _ in enumerate(request["rid"]):
            rows = self.rows_of_sample(i)
            meta = sglang_meta(rows) if request.get("return_routed_experts") else {
                "finish_reason": {"type": "length", "length": 4}}
            out.append({"output_ids": [7, 8, 9, 10], "text": "", "meta_info": meta})
        return out

    def shutdown(self):
        pass


def _sglang_adapter(moe_dir, launch_args):
    from polyrl.rollout.engines.sglang import SGLangEngine

    engine = SGLangEngine.__new__(SGLangEngine)  # everything but sglang.Engine's own start
    engine._init_adapter({"model_path": moe_dir, **launch_args}, "model_path", False, 0, 1, 30.0)
    engine.version, engine.fp8, engine.tp_size, engine.weight_session = "0.5.23", False, 1, True
    engine._sample_rids, engine._warned_seed = {}, False
    engine.routes = asked_routes(engine.launch_args, "sglang", engine.version, moe_dir)
    rows = [sequence_rows(3, 4, seed=i) for i in range(2)]
    engine.engine = SGLangWithRoutes(lambda i: rows[i])
    return engine, rows


def test_sglang_asks_per_request_and_its_outputs_carry_the_routes_column(moe_dir):
    engine, rows = _sglang_adapter(moe_dir, {ENGINE_FLAG: True})
    try:
        outs = asyncio.run_coroutine_threadsafe(
            engine._tracked([1, 2, 3], SamplingParams(n=2, max_tokens=4, logprobs=False), "r"),
            engine._loop.loop).result(30)
    finally:
        engine.shutdown()
    assert engine.engine.requests[0]["return_routed_experts"] is True
    column = engine_routes(outs)  # what the rollout worker puts in RolloutBatch.routes
    assert column.values.shape == (8, 2, TOP_K) and column.offsets.tolist() == [0, 4, 8]
    for i in range(2):
        assert torch.equal(column.values[4 * i: 4 * i + 3].long(), torch.from_numpy(rows[i][3:6][:, [0, 2]]).long())


def test_sglang_without_the_flag_asks_nothing(moe_dir):
    engine, _ = _sglang_adapter(moe_dir, {})
    try:
        outs = asyncio.run_coroutine_threadsafe(
            engine._tracked([1, 2, 3], SamplingParams(n=1, max_tokens=4, logprobs=False), "r"),
            engine._loop.loop).result(30)
    finally:
        engine.shutdown()
    assert "return_routed_experts" not in engine.engine.requests[0] and engine_routes(outs) is None


def test_vllm_refuses_routes_on_its_cpu_build_in_one_line():
    from polyrl.rollout.engines import vllm as adapter

    with pytest.raises(ValueError) as err:
        adapter.check_routes_platform({ENGINE_FLAG: True}, cpu_build=True)
    assert str(err.value) == (f"{ENGINE_FLAG}=true: vLLM's CPU build cannot return routed experts (Model Runner "
                              "V2 needs Triton); run vLLM's GPU build for actor.router_replay=R3, or "
                              "rollout.backend=native")
    adapter.check_routes_platform({ENGINE_FLAG: True}, cpu_build=False)  # a GPU build: asked
    adapter.check_routes_platform({}, cpu_build=True)  # not asked


# --- pre-flight: R3 on these engines, one line before Ray ------------------------------------------

def _r3_problem(backend, platform="auto"):
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.preflight import check_router_replay

    cfg = load_config(JobConfig, overrides=["actor.router_replay=R3", f"rollout.backend={backend}",
                                            f"platform={platform}"])
    try:
        check_router_replay(cfg, moe_config("qwen3_moe"))
    except ConfigError as err:
        (line,) = err.problems
        assert "\n" not in line
        return line
    return None


def test_preflight_refuses_r3_on_vllm_cpu_and_below_each_floor(monkeypatch):
    import polyrl.backends as backends

    assert _r3_problem("vllm", "cpu") == ("actor.router_replay=R3: vLLM's CPU build cannot return routed experts "
                                          "(Model Runner V2 needs Triton); set actor.router_replay=R2 or off, or "
                                          "rollout.backend=native (docs/moe.md)")
    assert _r3_problem("vllm") == _r3_problem("vllm", "cpu")  # auto on this CPU machine
    versions = {"vllm": "0.13.0", "sglang": "0.5.8"}
    monkeypatch.setattr(backends, "installed_engine_version", lambda name: versions.get(name))
    assert _r3_problem("vllm", "cuda") == ("actor.router_replay=R3: rollout.backend=vllm serves routed_experts "
                                           "from vllm 0.14.0 on, 0.13.0 is installed: pip install "
                                           "\"vllm>=0.14.0,<0.34\"")
    assert _r3_problem("sglang").startswith("actor.router_replay=R3: rollout.backend=sglang serves routed_experts "
                                            "from sglang 0.5.9 on, 0.5.8 is installed")
    versions.update(vllm="0.32.0", sglang="0.5.9")
    assert _r3_problem("vllm", "cuda") is None and _r3_problem("sglang") is None
    assert "declares no routed_experts" in _r3_problem("trtllm")


def test_r3_starts_the_engine_recording_routes():
    """The job sets the launch argument (polyrl/job.py); the launch arguments carry it to the engine."""
    from polyrl.config import ConfigError, load_config
    from polyrl.job import JobConfig
    from polyrl.platform import get_platform
    from polyrl.rollout.launch_args import engine_launch_args

    for backend in ("vllm", "sglang"):
        cfg = load_config(JobConfig, overrides=["actor.router_replay=R3", f"rollout.backend={backend}"])
        assert cfg.rollout.engine_kwargs[backend] == {ENGINE_FLAG: True}
        args = engine_launch_args(cfg.rollout, "/m", get_platform("cpu"), "0.32.0" if backend == "vllm" else "0.5.23",
                                  colocated=False)
        assert args[ENGINE_FLAG] is True
    for replay in ([], ["actor.router_replay=R2"]):  # recording costs memory and a copy per step: R3 only
        assert load_config(JobConfig, overrides=[*replay, "rollout.backend=sglang"]).rollout.engine_kwargs == {}
    with pytest.raises(ConfigError) as err:
        load_config(JobConfig, overrides=["actor.router_replay=R3", "rollout.backend=sglang",
                                          f"rollout.engine_kwargs.sglang.{ENGINE_FLAG}=false"])
    assert err.value.problems == [f"rollout.engine_kwargs.sglang.{ENGINE_FLAG}=false: actor.router_replay=R3 replays "
                                  "the routes the engine records only when started with it; remove the key"]
