"""Black-box agents (level 3): agent programs using the real `openai` client against polyrl's real
HTTP server over the real native engine, with a byte-level and a SentencePiece-style tokenizer.
The ids the trainer sees are the ids the engine sampled, turn by turn; what the agent added between
turns is masked; a chain the agent breaks, an agent that raises, times out or never calls the
server are counted and get no loss; limits reach the agent as a 400 and are counted as limits."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from conftest import ANSWER, CALL, USER, native
from polyrl.agents import AgentConfig, HermesParser, run_trajectories_sync
from polyrl.agents.black_box import stop_servers
from polyrl.agents.chat import ChatDelta
from polyrl.data import PromptSample
from polyrl.rollout.base import RolloutInputError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, n=1)
ONE_TOKENIZER = pytest.mark.parametrize("tokenizer", ["byte_level"], indirect=True)
"""For what does not depend on tokenization (errors, limits, refusals): one tokenizer is enough."""
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6, n=2)


@pytest.fixture(autouse=True)
def _servers():
    yield
    stop_servers()


def rows(tokenizer, count=1):
    ids = ChatDelta(tokenizer).prompt_ids(USER)
    return [PromptSample(i, "arithmetic", ids, "", USER, "5", {}) for i in range(count)]


def run(engine, tokenizer, agent, sampling=GREEDY, count=1, **cfg):
    import sys

    module = sys.modules[__name__]
    setattr(module, agent.__name__, agent)  # agent.black_box names it by dotted path
    cfg = AgentConfig(black_box=f"{__name__}:{agent.__name__}", **cfg)
    return run_trajectories_sync(engine, tokenizer, rows(tokenizer, count), sampling, cfg, seeds=[7] * count)


def client(base_url):
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def tool_agent(base_url, row, trajectory_id):
    """An ordinary agent loop: ask, run the tool calls it finds, append the results, ask again."""
    llm, messages = client(base_url), list(row.raw_prompt)
    for _ in range(4):
        reply = await llm.chat.completions.create(model="anything", messages=messages, temperature=0.7)
        text = reply.choices[0].message.content
        messages.append(reply.choices[0].message.model_dump())  # what clients echo back, None fields too
        parsed = HermesParser().parse(text)
        if not parsed.has_calls:
            return None
        for call in parsed.calls:
            messages.append({"role": "tool", "content": str(call.arguments["a"] + call.arguments["b"])})


async def chatty_agent(base_url, row, trajectory_id):
    """Three turns of arbitrary text (a random model), a user message between them."""
    llm, messages = client(base_url), list(row.raw_prompt)
    for turn in range(3):
        reply = await llm.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"go on {turn}"}]


def assert_exact(engine, rollout, turns):
    """Every sampled span is exactly what the engine sampled from exactly the ids before it (with
    its log-probs); every other response id is masked."""
    batch = rollout.batch
    served = {(tuple(p), tuple(o.token_ids)): o for p, o in engine.calls}
    assert len(engine.calls) == sum(t.stats.turns for t in rollout.trajectories)
    for i, traj in enumerate(rollout.trajectories):
        assert traj.stats.turns == turns and traj.stats.prefix_mismatch == 0
        response, mask = batch.response_ids.row(i).tolist(), batch.loss_mask.row(i).tolist()
        sampled = [0.0] * len(response)
        for start, end in traj.turn_spans:
            out = served[(tuple(traj.prompt_ids + response[:start]), tuple(response[start:end]))]
            assert batch.rollout_logprobs.row(i)[start:end].tolist() == pytest.approx(out.logprobs)
            sampled[start:end] = [1.0] * (end - start)
        assert mask == sampled and 0 < sum(mask) and (sum(mask) < len(mask)) == (turns > 1)


def test_a_chat_tool_agent_is_token_exact_and_masked(tokenizer, scripted_dirs):
    engine = native(scripted_dirs[CALL], tokenizer)
    rollout = run(engine, tokenizer, tool_agent)
    assert_exact(engine, rollout, turns=2)
    traj = rollout.trajectories[0]
    assert [m["role"] for m in traj.messages] == ["assistant", "tool", "assistant"]
    assert rollout.batch.texts == [ANSWER] and rollout.batch.finished_with_eos.tolist() == [True]
    # the whole trajectory is the template's rendering of the conversation, token for token
    convo = USER + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"},
                    {"role": "assistant", "content": ANSWER}]
    rendered = tokenizer(tokenizer.apply_chat_template(convo, tokenize=False), add_special_tokens=False)["input_ids"]
    full = rollout.batch.prompt_ids.row(0).tolist() + rollout.batch.response_ids.row(0).tolist()
    assert full == rendered[: len(full)]
    m = rollout.metrics()
    assert m["agent/turns_mean"] == 2.0 and m["agent/env_errors"] == 0 and m["agent/prefix_mismatch"] == 0


def test_arbitrary_sampled_ids_survive_three_turns(tokenizer, random_dir):
    """A random model samples ids whose text re-encodes differently; the trajectory keeps the ids."""
    engine = native(random_dir, tokenizer)
    rollout = run(engine, tokenizer, chatty_agent, SAMPLED, count=2)
    assert len(rollout.trajectories) == 4
    assert_exact(engine, rollout, turns=3)
    # the trainer's sampling wins over the agent's: a turn is reproducible from the row's seed
    again = run(native(random_dir, tokenizer), tokenizer, chatty_agent, SAMPLED, count=2)
    assert again.batch.response_ids.values.tolist() == rollout.batch.response_ids.values.tolist()


async def token_agent(base_url, row, trajectory_id):
    """Completions on token ids: the agent keeps the ids itself and appends its own."""
    llm, ids = client(base_url), list(row.prompt_ids)
    for _ in range(2):
        reply = await llm.completions.create(model="policy", prompt=ids, max_tokens=4, logprobs=0)
        lp = reply.choices[0].logprobs
        assert lp is not None and len(lp.token_logprobs) == reply.usage.completion_tokens
        choice = reply.choices[0]  # a trajectory's choices carry their ids (vLLM's names)
        assert choice.prompt_token_ids == ids
        ids = ids + choice.token_ids + [5, 6]
    return 0.25


@ONE_TOKENIZER
def test_completions_on_token_ids_and_a_returned_reward(tokenizer, random_dir):
    engine = native(random_dir, tokenizer)
    rollout = run(engine, tokenizer, token_agent)
    assert_exact(engine, rollout, turns=2)
    assert rollout.batch.response_ids.row(0).tolist()[len(engine.calls[0][1].token_ids):][:2] == [5, 6]
    assert rollout.env_rewards.tolist() == [0.25]
    assert rollout.transcripts[0][1] == {"role": "text", "content": tokenizer.decode([5, 6])}  # the agent's ids


async def text_agent(base_url, row, trajectory_id):
    """Completions on text: the agent appends the returned text and its own, and asks again."""
    llm, prompt = client(base_url), "Q: what is 2+3?\nA:"
    for turn in range(3):
        reply = await llm.completions.create(model="policy", prompt=prompt, max_tokens=5)
        prompt += reply.choices[0].text + f" ok {turn}. A:"


def test_text_completions_extend_the_previous_turn(tokenizer, random_dir):
    """A random model's text does not re-encode to its ids; the trajectory keeps the ids and
    encodes only what the agent appended, as a continuation."""
    engine = native(random_dir, tokenizer)
    rollout = run(engine, tokenizer, text_agent, SAMPLED)
    assert_exact(engine, rollout, turns=3)
    assert [m["content"] for m in rollout.trajectories[0].messages if m["role"] == "text"] == [" ok 0. A:", " ok 1. A:"]


async def editing_agent(base_url, row, trajectory_id):
    """Rewrites the first user message before its second turn: the chain breaks."""
    llm = client(base_url)
    reply = await llm.chat.completions.create(model="policy", messages=row.raw_prompt)
    messages = [{"role": "user", "content": "what is 3+2?"}, reply.choices[0].message.model_dump(),
                {"role": "user", "content": "sure?"}]
    await llm.chat.completions.create(model="policy", messages=messages)
    return "5"


def test_a_broken_chain_is_counted_and_gets_no_loss(tokenizer, scripted_dirs):
    rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, editing_agent)
    traj = rollout.trajectories[0]
    assert traj.stats.prefix_mismatch == 1 and rollout.metrics()["agent/prefix_mismatch"] == 1.0
    assert traj.stats.turns == 1 and rollout.batch.loss_mask.row(0).sum() == 0
    assert rollout.batch.texts == ["5"]  # the returned final answer is what gets scored


async def failing_agent(base_url, row, trajectory_id):
    await client(base_url).chat.completions.create(model="policy", messages=row.raw_prompt)
    raise RuntimeError("the agent broke")


async def infinite_reward_agent(base_url, row, trajectory_id):
    await client(base_url).chat.completions.create(model="policy", messages=row.raw_prompt)
    return float("inf")


def idle_agent(base_url, row, trajectory_id):  # a blocking agent that never calls the server
    return None


@ONE_TOKENIZER
def test_an_agent_that_raises_or_never_calls_is_counted_not_fatal(tokenizer, scripted_dirs):
    rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, failing_agent)
    assert rollout.trajectories[0].stats.env_errors == 1 and rollout.batch.loss_mask.row(0).sum() == 0
    assert rollout.trajectories[0].stats.turns == 1
    infinite = run(native(scripted_dirs[CALL], tokenizer), tokenizer, infinite_reward_agent)
    assert infinite.metrics()["agent/env_errors"] == 1.0 and infinite.env_rewards.isnan().all()
    idle = run(native(scripted_dirs[CALL], tokenizer), tokenizer, idle_agent, count=2)
    assert idle.metrics()["agent/env_errors"] == 2.0
    assert idle.batch.response_ids.lengths.tolist() == [0, 0]
    assert idle.batch.prompt_ids.row(0).tolist() == rows(tokenizer)[0].prompt_ids


_release = threading.Event()


def hanging_agent(base_url, row, trajectory_id):
    _release.wait()


@ONE_TOKENIZER
def test_an_agent_past_its_timeout_is_abandoned(tokenizer, scripted_dirs):
    try:
        rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, hanging_agent, black_box_timeout_s=0.05)
    finally:
        _release.set()
    assert rollout.trajectories[0].stats.env_errors == 1


_unblock, _unblocked = threading.Event(), threading.Event()


async def blocking_async_agent(base_url, row, trajectory_id):
    """`async def` around a blocking call (a synchronous client, time.sleep): it holds its event loop."""
    _unblock.wait(60)
    _unblocked.set()


@ONE_TOKENIZER
def test_an_async_agent_that_blocks_its_loop_is_abandoned_at_its_timeout(tokenizer, scripted_dirs):
    """It runs on a loop of its own, so the rollout's loop keeps time: the run ends at the timeout
    while the agent is still blocked (before: the rollout waited for the blocking call)."""
    try:
        rollout = run(native(scripted_dirs[CALL], tokenizer), tokenizer, blocking_async_agent,
                      black_box_timeout_s=0.05)
        still_blocked = not _unblocked.is_set()
    finally:
        _unblock.set()
    assert still_blocked and rollout.trajectories[0].stats.env_errors == 1


async def greedy_agent(base_url, row, trajectory_id):
    """Keeps asking until the server says no more."""
    llm, messages = client(base_url), list(row.raw_prompt)
    while True:
        reply = await llm.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "again"}]


@ONE_TOKENIZER
def test_limits_reach_the_agent_and_are_counted_as_limits(tokenizer, scripted_dirs):
    engine = native(scripted_dirs[CALL], tokenizer)
    rollout = run(engine, tokenizer, greedy_agent, max_turns=2)
    traj = rollout.trajectories[0]
    assert traj.stats.limit == "turns" and traj.stats.env_errors == 0 and traj.stats.turns == 2
    assert rollout.metrics()["agent/limit_turns"] == 1.0 and rollout.batch.loss_mask.row(0).sum() > 0
    short = run(native(scripted_dirs[CALL], tokenizer), tokenizer, greedy_agent, max_response_tokens=12)
    traj = short.trajectories[0]
    assert traj.stats.limit == "response_tokens" and len(traj.response_ids) <= 12
    assert traj.stats.env_errors == 0


async def probing_agent(base_url, row, trajectory_id):
    """What the server refuses, by name; then a streamed turn."""
    llm, refused = client(base_url), {}
    for name, kwargs in (("n", {"n": 2}), ("logit_bias", {"logit_bias": {"1": 5}}),
                         ("presence_penalty", {"presence_penalty": 1.0})):
        try:
            await llm.chat.completions.create(model="policy", messages=row.raw_prompt, **kwargs)
        except openai.BadRequestError as exc:
            refused[name] = exc.body["param"]
    try:
        await client(base_url.replace(trajectory_id, "never-opened")).chat.completions.create(
            model="policy", messages=row.raw_prompt)
    except openai.BadRequestError as exc:
        refused["unknown id"] = exc.body["param"]
    stream = await llm.chat.completions.create(model="policy", messages=row.raw_prompt, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    PROBED.update(refused=refused, text=text)


PROBED: dict = {}


@ONE_TOKENIZER
def test_refused_fields_unknown_ids_and_streaming(tokenizer, scripted_dirs):
    engine = native(scripted_dirs[CALL], tokenizer)
    rollout = run(engine, tokenizer, probing_agent)
    assert PROBED["refused"] == {"n": "n", "logit_bias": "logit_bias", "presence_penalty": "presence_penalty",
                                 "unknown id": "trajectory"}
    assert PROBED["text"] == CALL and rollout.batch.texts == [CALL]
    assert_exact(engine, rollout, turns=1)  # refused requests record nothing


@ONE_TOKENIZER
def test_a_late_request_is_refused_after_the_agent_returned(tokenizer, scripted_dirs):
    urls = []

    async def leaky(base_url, row, trajectory_id):
        urls.append(base_url)
        await client(base_url).chat.completions.create(model="policy", messages=row.raw_prompt)

    leaky.__name__ = "leaky_agent"
    run(native(scripted_dirs[CALL], tokenizer), tokenizer, leaky)
    with pytest.raises(openai.BadRequestError, match="not an open trajectory"):
        openai.OpenAI(base_url=urls[0], api_key="x", max_retries=0).chat.completions.create(
            model="policy", messages=USER)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="agent.black_box 'solve' must look like package.module:function"):
        AgentConfig(black_box="solve")
    with pytest.raises(ValueError, match="agent.black_box: file .*missing.py does not exist"):
        AgentConfig(black_box=f"{tmp_path}/missing.py:solve")
    with pytest.raises(ValueError, match="unset agent.tools"):
        AgentConfig(black_box="pkg.mod:solve", tools=["pkg.mod:add"])
    from polyrl.agents.black_box import load_agent

    with pytest.raises(ValueError, match="agent.black_box 'polyrl.agents:nope': cannot import it"):
        load_agent("polyrl.agents:nope")


@ONE_TOKENIZER
def test_closing_cancels_the_engine_call_in_flight(tokenizer, random_dir):
    """An abandoned agent's request: closing its trajectory cancels the engine call (its slots free
    at once, nothing is recorded, the request is refused naming `trajectory`)."""
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.rollout.server.trajectories import TrajectoryRecorder, TurnRequest

    engine = NativeEngine(random_dir, tokenizer=tokenizer, max_model_len=1024)
    recorder = TrajectoryRecorder()
    recorder.open("t", SamplingParams(temperature=1.0, max_tokens=900, seed=0, ignore_eos=True),
                  seeds=lambda turn: 0, max_turns=2, max_response_tokens=1000)
    result: dict = {}
    decoding, step = threading.Event(), engine._step

    def observed_step():  # the engine's step thread says when the request is decoding
        step()
        if engine.stats["decode_steps"]:
            decoding.set()

    engine._step = observed_step

    def serve() -> None:
        try:
            asyncio.run(recorder.completion_turn("t", engine, [1, 2, 3], None, TurnRequest(), text=str))
        except Exception as exc:  # noqa: BLE001 - inspected below
            result["error"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    assert decoding.wait(60)
    record = recorder.close("t")
    assert record.idle.wait(60)
    thread.join(60)
    assert isinstance(result["error"], RolloutInputError) and result["error"].field == "trajectory"
    assert record.turns == [] and engine.health()["running"] == 0
    assert engine.stats["decode_tokens"] < 899  # cut short, not run to its max_tokens
    with pytest.raises(RolloutInputError, match="not an open trajectory"):
        recorder.get("t")


async def streaming_stop_agent(base_url, row, trajectory_id):
    """Streams a turn cut by its own stop string, echoes the streamed text, asks again."""
    llm, messages = client(base_url), list(row.raw_prompt)
    stream = await llm.chat.completions.create(model="policy", messages=messages, stream=True, stop=['"add"'])
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    STREAMED.append(text)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    await llm.chat.completions.create(model="policy", messages=messages)


STREAMED: list = []


def test_a_streamed_turn_cut_by_a_stop_string_still_chains(tokenizer, scripted_dirs):
    """The streamed text is the reply's text (cut before the stop string, like the non-streamed
    one), so echoing it extends the turn; the stop string's tokens stay in the trajectory as sampled."""
    STREAMED.clear()
    engine = native(scripted_dirs[CALL], tokenizer)
    rollout = run(engine, tokenizer, streaming_stop_agent)
    assert STREAMED == [CALL[:CALL.index('"add"')]]
    assert_exact(engine, rollout, turns=2)


@ONE_TOKENIZER
def test_a_request_queued_behind_a_turn_when_its_trajectory_closes_sets_no_limit(tokenizer, random_dir):
    """A request that waits for its trajectory's running turn and gets in after the trajectory was
    closed (the agent timed out) is refused as closed: it must not record a limit, which would
    excuse the timeout (an agent ending on a limit is not an error and keeps its loss)."""
    from polyrl.rollout.native.engine import NativeEngine
    from polyrl.rollout.server.trajectories import TrajectoryRecorder, TurnRequest

    engine = NativeEngine(random_dir, tokenizer=tokenizer, max_model_len=64)
    recorder = TrajectoryRecorder()
    recorder.open("t", SamplingParams(max_tokens=1, seed=0), seeds=lambda turn: 0, max_turns=1,
                  max_response_tokens=8)

    async def scenario():
        await recorder.completion_turn("t", engine, [1, 2, 3], None, TurnRequest(), text=str)
        record = recorder.get("t")
        async with record.lock:  # a turn of this trajectory is running
            queued = asyncio.ensure_future(recorder.completion_turn("t", engine, [1, 2, 3, 4], None,
                                                                    TurnRequest(), text=str))
            while not record.lock._waiters:  # the request waits for the lock (asyncio-internal, no sleep)
                await asyncio.sleep(0)
            recorder.close("t")
        with pytest.raises(RolloutInputError) as refused:
            await queued
        return record, refused.value

    record, error = asyncio.run(scenario())
    assert error.field == "trajectory" and record.limit is None and len(record.turns) == 1


async def doubled_user_agent(base_url, row, trajectory_id):
    """Sends two user messages in a row after the reply, which its model's template refuses."""
    llm, messages = client(base_url), list(row.raw_prompt)
    reply = await llm.chat.completions.create(model="policy", messages=messages)
    messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "a"},
                 {"role": "user", "content": "b"}]
    try:
        await llm.chat.completions.create(model="policy", messages=messages)
    except openai.APIStatusError as exc:
        PROBED.update(status=exc.status_code, param=(exc.body or {}).get("param"))
    return "5"


@ONE_TOKENIZER
def test_a_template_that_refuses_the_new_messages_is_a_400_naming_messages(tokenizer, scripted_dirs):
    """Extending the turn renders the new messages with the template; a template that raises there
    gets the same answer as a fresh render (HTTP 400 naming `messages`), not a server error."""
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{%- for m in messages %}{%- if not loop.first and m.role == 'user' and "
        "messages[loop.index0 - 1].role == 'user' %}{{ raise_exception('two user messages in a row') }}"
        "{%- endif %}{%- endfor %}" + tokenizer.chat_template)
    PROBED.clear()
    rollout = run(native(scripted_dirs[CALL], strict), strict, doubled_user_agent)
    assert PROBED == {"status": 400, "param": "messages"} and rollout.trajectories[0].stats.turns == 1
