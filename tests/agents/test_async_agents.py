"""Agents in async mode (trainer.mode=async): every turn goes through the replica's WeightGate
(`GatedEngine`), so a weight update that aborts a turn mid-way is continued from its tokens so far;
the trajectory stays token-exact, masked as before, and records both policy versions. The slow
test trains 2 steps with the calculator tool on a scripted tiny model (async) and with a
black-box agent (async and sync)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conftest import USER, native
from polyrl.agents import AgentConfig, run_trajectories_sync
from polyrl.agents.chat import ChatDelta
from polyrl.data import PromptSample
from polyrl.rollout.base import SamplingParams
from polyrl.workers.partial_rollout import GatedEngine, WeightGate
from weight_gate_hooks import publish_mid_turn


def policy_weights(model_dir):
    from transformers import AutoModelForCausalLM

    return {k: v for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
            if k != "lm_head.weight"}  # tied to the embedding


@pytest.mark.parametrize("tokenizer", ["byte_level"], indirect=True)  # ids only: one tokenizer
@pytest.mark.parametrize("policy", ["abort", "wait"])
def test_a_weight_update_mid_turn_keeps_the_trajectory_exact(tokenizer, random_dir, policy):
    engine = native(random_dir, tokenizer)
    gate = WeightGate(engine, policy)
    publisher, updated, _ = publish_mid_turn(engine.engine, gate, policy_weights(random_dir), after_decode_steps=5)
    row = PromptSample(0, "arithmetic", ChatDelta(tokenizer).prompt_ids(USER), "", USER, "5", {})
    sampling = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)
    cfg = AgentConfig(environment="tools", max_turns=2, max_response_tokens=500)
    rollout = run_trajectories_sync(GatedEngine(engine, gate), tokenizer, [row], sampling, cfg, seeds=[3])
    publisher.join(120)
    assert updated.is_set() and engine.weight_version == 1
    traj, batch = rollout.trajectories[0], rollout.batch
    # the turn ran to its max_tokens whatever the update did (a length stop ends the episode)
    assert traj.stats.turns == 1 and traj.turn_spans == [(0, 200)]
    versions = (int(batch.min_version[0]), int(batch.max_version[0]))
    assert versions == ((0, 1) if policy == "abort" else (0, 0))  # wait: the update waited for the turn
    response = traj.response_ids
    sampled = [0.0] * len(response)
    pos = 0
    for prompt, out in engine.calls:  # each piece continued exactly the ids before it
        start = len(prompt) - len(traj.prompt_ids)
        assert prompt == traj.prompt_ids + response[:start]
        assert response[start:start + len(out.token_ids)] == out.token_ids
        assert batch.rollout_logprobs.row(0)[start:start + len(out.token_ids)].tolist() == \
            pytest.approx(out.logprobs)
        sampled[start:start + len(out.token_ids)] = [1.0] * len(out.token_ids)
        pos = max(pos, start + len(out.token_ids))
    assert pos == len(response) and batch.loss_mask.row(0).tolist() == sampled == [1.0] * 200
    assert len(engine.calls) == (2 if policy == "abort" else 1)  # abort: the turn came in two pieces


B, N = 2, 2
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
ANSWER = "The answer is 5."


@pytest.fixture(scope="module")
def calc_run(tmp_path_factory):
    """A scripted model that calls the calculator then answers, and its data."""
    from agent_models import build_scripted_model, byte_level_tokenizer

    tokenizer = byte_level_tokenizer([CALL, ANSWER])
    header = ChatDelta(tokenizer).prompt_ids(USER)[-1]
    root = tmp_path_factory.mktemp("calc")
    model = build_scripted_model(root / "model", tokenizer, header, CALL, ANSWER)
    row = {"data_source": "arithmetic", "prompt": USER, "reward_model": {"ground_truth": "5"}}
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps({**row, "extra_info": {"i": i}}) for i in range(8)))
    return model, data


@pytest.mark.slow
@pytest.mark.parametrize("agent, mode", [("tools", "async"), ("black_box", "async"), ("black_box", "sync")])
def test_training_with_agents(ray_session, calc_run, tmp_path, agent, mode):
    """2 steps; sync runs colocated (the engine sleeps between rollouts, its server stays up)."""
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    model, data = calc_run
    agent_keys = (["agent.tools=[polyrl.agents.calculator:calculator]", "agent.tools_in_prompt=false"]
                  if agent == "tools" else [f"agent.black_box={Path(__file__).parent / 'calc_agent.py'}:solve"])
    out = tmp_path / "out"
    cfg = load_config(JobConfig, overrides=[
        f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        f"data.train_batch_size={B}", f"rollout.n={N}", "rollout.response_length=8", "actor.lr=1e-6",
        "agent.max_turns=3", "agent.max_response_tokens=64", *agent_keys,
        "trainer.total_steps=2", "trainer.val_every=2", "trainer.val_before_train=false",
        "trainer.progress_bar=false", "trainer.save_at_end=false", "actor.num_cpus_per_worker=1",
        f"trainer.output_dir={out}", "logging.plot_at_end=false",
        *(["rollout.placement=standalone", "trainer.mode=async", "async.groups_per_request=1"]
          if mode == "async" else [])])
    Trainer(cfg).fit()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "agent/turns_mean" in r and "actor/grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["agent/turns_mean"] == 2.0 and r["agent/env_errors"] == 0 and r["agent/prefix_mismatch"] == 0
        assert 0 < r["response/masked_token_frac"] < 1  # the tool turn is in the response, masked
        assert r.get("async/staleness_max", 0) <= 1 and ("async/staleness_max" in r) == (mode == "async")
        if agent == "tools":
            assert r["agent/tool_calls_mean"] == 1.0 and r["agent/tool_errors"] == 0
        else:
            assert r["agent/env_reward_mean"] == 1.0


@pytest.mark.parametrize("tokenizer", ["byte_level"], indirect=True)
def test_a_turn_cancelled_while_an_update_holds_the_gate_does_not_hold_it(tokenizer, random_dir):
    """A turn waiting at the gate while an update runs is cancelled (its trajectory closed, its
    client gone): once the update is over the gate must not count it as generating, or the next
    update would wait for it forever."""
    import asyncio

    engine = native(random_dir, tokenizer)
    gate = WeightGate(engine, "wait")
    entering, entered = threading.Event(), threading.Event()
    enter = gate._enter

    def observed_enter():  # the thread a coroutine waits on at the gate
        entering.set()
        enter()
        entered.set()

    gate._enter = observed_enter
    with gate._cond:  # an update is being applied
        gate._paused = True

    async def scenario() -> bool:
        turn = asyncio.ensure_future(GatedEngine(engine, gate).generate([1, 2, 3], SamplingParams(max_tokens=2)))
        await asyncio.to_thread(entering.wait, 60)  # the turn waits at the gate
        turn.cancel()
        with gate._cond:  # the update is over
            gate._paused = False
            gate._cond.notify_all()
        await asyncio.to_thread(entered.wait, 60)
        with pytest.raises(asyncio.CancelledError):
            await turn
        # the next update must find nobody generating (without the fix: active stays 1)
        return await asyncio.to_thread(_nobody_generating, gate)

    assert asyncio.run(scenario()) and engine.calls == []


def _nobody_generating(gate) -> bool:
    with gate._cond:
        return gate._cond.wait_for(lambda: gate._active == 0, timeout=30)


async def two_turn_chat_agent(base_url, row, trajectory_id):
    """An ordinary chat loop: echo the reply as the server returned it, add a message, ask again."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as llm:
        messages = list(row.raw_prompt)
        for turn in range(2):
            reply = await llm.chat.completions.create(model="policy", messages=messages)
            messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": f"more {turn}"}]


@pytest.mark.parametrize("tokenizer", ["byte_level"], indirect=True)
def test_a_black_box_turn_continued_across_an_update_still_chains(tokenizer, random_dir):
    """A weight update aborts the agent's first turn mid-way; the turn is continued (its text is the
    decode of both pieces) and the agent's next request, which echoes that text, still extends it:
    the trajectory is token-exact, not a prefix mismatch."""
    from polyrl.agents.black_box import stop_servers

    engine = native(random_dir, tokenizer)
    gate = WeightGate(engine, "abort")
    publisher, updated, _ = publish_mid_turn(engine.engine, gate, policy_weights(random_dir), after_decode_steps=3)
    row = PromptSample(0, "arithmetic", ChatDelta(tokenizer).prompt_ids(USER), "", USER, "5", {})
    cfg = AgentConfig(black_box=f"{__name__}:two_turn_chat_agent", max_turns=2, max_response_tokens=200)
    try:
        rollout = run_trajectories_sync(GatedEngine(engine, gate), tokenizer, [row],
                                        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), cfg, seeds=[3])
    finally:
        stop_servers()
    publisher.join(120)
    traj, batch = rollout.trajectories[0], rollout.batch
    assert updated.is_set() and len(engine.calls) == 3  # turn 1 in two pieces, turn 2 in one
    assert traj.stats.prefix_mismatch == 0 and traj.stats.env_errors == 0 and traj.stats.turns == 2
    assert (int(batch.min_version[0]), int(batch.max_version[0])) == (0, 1)
    response = traj.response_ids
    for prompt, out in engine.calls:  # each piece continued exactly the ids before it
        start = len(prompt) - len(traj.prompt_ids)
        assert prompt == traj.prompt_ids + response[:start]
        assert response[start:start + len(out.token_ids)] == out.token_ids
    assert [end - start for start, end in traj.turn_spans] == [12, 12]
    assert batch.loss_mask.row(0).sum() == 24 and len(response) > 24  # the user message is masked


@pytest.mark.parametrize("tokenizer", ["byte_level"], indirect=True)
def test_turns_waiting_at_the_gate_leave_the_engine_its_threads(tokenizer, random_dir):
    """wait mode: an update waits for the running turn while more turns wait at the gate. The
    waiting turns must not hold the event loop's executor threads, which the engine steps on: with
    more waiting turns than threads the running turn could never finish (a deadlock)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    engine = native(random_dir, tokenizer)
    gate = WeightGate(engine, "wait")
    publisher, updated, paused = publish_mid_turn(engine.engine, gate, policy_weights(random_dir), after_decode_steps=3)
    gated, prompt = GatedEngine(engine, gate), [1, 2, 3]

    async def scenario():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        running = asyncio.ensure_future(gated.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
        await asyncio.get_running_loop().run_in_executor(None, paused.wait, 60)  # the update waits for it
        waiting = [asyncio.ensure_future(gated.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
                   for _ in range(3)]
        return await running, await asyncio.gather(*waiting)

    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(out=asyncio.run(scenario())), daemon=True)
    thread.start()
    thread.join(120)
    publisher.join(120)
    assert not thread.is_alive() and updated.is_set(), "the update and the turns waited for each other"
    first, rest = box["out"]
    assert first[0].weight_version == 0 and len(first[0].token_ids) == 30  # the update waited for it
    assert [outs[0].weight_version for outs in rest] == [1, 1, 1]  # the waiting turns ran after it


@pytest.mark.parametrize("tokenizer", ["byte_level"], indirect=True)
def test_a_continued_turn_keeps_one_set_of_top_logprobs_per_token(tokenizer, random_dir):
    """The pieces of a turn that a weight update aborted are merged with their top log-probs too,
    so each token keeps its own alternatives (a server formats them token by token)."""
    import asyncio

    engine = native(random_dir, tokenizer)
    gate = WeightGate(engine, "abort")
    publisher, updated, _ = publish_mid_turn(engine.engine, gate, policy_weights(random_dir), after_decode_steps=3)
    sampling = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5, top_logprobs=2)
    [out] = asyncio.run(GatedEngine(engine, gate).generate([1, 2, 3], sampling))
    publisher.join(120)
    assert updated.is_set() and len(engine.calls) == 2  # the turn came in two pieces
    first, rest = (o for _, o in engine.calls)
    assert out.top_logprobs == first.top_logprobs + rest.top_logprobs and len(out.top_logprobs) == 12


@pytest.mark.parametrize("tokenizer", ["byte_level"], indirect=True)
def test_a_stop_string_across_the_abort_point_ends_the_turn(tokenizer, random_dir):
    """A stop string whose first characters were sampled before a weight update aborted the turn
    and whose last ones after it: each piece alone does not hold it, the uninterrupted turn would
    have stopped there, so the continued turn stops there too (ids up to the token completing it,
    text before it)."""
    import asyncio

    def turn(stop=()):
        engine = native(random_dir, tokenizer)
        gate = WeightGate(engine, "abort")
        publisher, updated, _ = publish_mid_turn(engine.engine, gate, policy_weights(random_dir), after_decode_steps=3)
        sampling = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5, stop=stop)
        [out] = asyncio.run(GatedEngine(engine, gate).generate([1, 2, 3], sampling))
        publisher.join(120)
        assert updated.is_set()
        return out, [o.token_ids for _, o in engine.calls]

    _, (before, after) = turn()  # the pieces without a stop string
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    head = decode(before)
    # the first token after the abort that completes a character, and a stop string made of the
    # last two characters before the abort and the first one after it
    m = next(m for m in range(1, len(after) + 1) if len(decode(before + after[:m]).rstrip("\ufffd")) > len(head))
    joined = decode(before + after[:m])
    stop = joined[len(head) - 2:len(head) + 1]
    assert joined.startswith(head) and len(stop) == 3 and "\ufffd" not in stop
    assert stop not in head and stop not in decode(after)  # neither piece holds it alone

    out, pieces = turn((stop,))
    assert pieces[0] == before and pieces[1][:m] == after[:m]  # the same turn, now with the stop string
    assert out.token_ids == before + after[:m] and out.stop_reason == "stop"
    assert out.text == head[:-2] and len(out.logprobs) == len(out.token_ids)
