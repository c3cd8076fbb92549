"""Real Ray server actors: concurrent generation through one actor, the planned environment inside
it, HTTP from inside the actor, and the router over two actors — spreading, stickiness, and
failover when one actor is killed mid-stream. The kill test runs last: it consumes replica 0."""

from __future__ import annotations

import asyncio

import openai
import pytest

from polyrl.distributed.ray_launch import plan_for_role
from polyrl.distributed.topologies import DISAGGREGATED
from polyrl.platform import current_platform
from polyrl.rollout.base import RolloutInputError
from polyrl.rollout.server import Router, start_rollout_servers

LONG = {"max_tokens": 40, "ignore_eos": True, "temperature": 1.0}
LONGER = {**LONG, "max_tokens": 100}


@pytest.fixture(scope="module")
def servers(ray_session, tiny_model):
    ray = ray_session
    kwargs = dict(engine_kwargs={"max_model_len": 128, "max_num_seqs": 32}, num_cpus=1,
                  ready_timeout_s=180)
    handles = start_rollout_servers(2, tiny_model, **kwargs)
    yield handles
    for h in handles:
        ray.kill(h)


def test_one_actor_serves_concurrent_requests_in_one_batch(ray_session, servers):
    ray, actor = ray_session, servers[0]
    before = ray.get(actor.health.remote(), timeout=60)["stats"]["decode_steps"]
    refs = [actor.generate.remote([3, 4, 5], {**LONG, "seed": i}, f"c{i}") for i in range(8)]
    outs = ray.get(refs, timeout=120)
    assert all(len(o) == 1 and len(o[0].token_ids) == LONG["max_tokens"] for o in outs)
    assert len({tuple(o[0].token_ids) for o in outs}) > 1
    steps = ray.get(actor.health.remote(), timeout=60)["stats"]["decode_steps"] - before
    assert steps < 8 * (LONG["max_tokens"] - 1)  # sequential serving would need every step


def test_actor_environment_matches_its_plan(ray_session, servers):
    plan = plan_for_role(current_platform(), "rollout", topology=DISAGGREGATED, backend="native")
    assert "TOKENIZERS_PARALLELISM" in plan.values()
    seen = ray_session.get(servers[0].environment.remote(list(plan.values())), timeout=60)
    assert seen == plan.values()


def test_actor_input_errors_name_the_field(ray_session, servers):
    ray = ray_session
    with pytest.raises(RolloutInputError, match="temperature"):
        ray.get(servers[0].generate.remote([3, 4], {"temperature": -1}), timeout=60)
    with pytest.raises(RolloutInputError, match="temprature"):
        ray.get(servers[0].generate.remote([3, 4], {"temprature": 0.5}), timeout=60)
    assert ray.get(servers[0].generate.remote([3, 4], {"max_tokens": 2}), timeout=60)


def test_actor_serves_the_openai_api_on_the_same_engine(ray_session, servers):
    url = ray_session.get(servers[1].serve_http.remote(), timeout=60)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="12", max_tokens=3)
    assert r.usage.prompt_tokens == 2 and r.choices[0].finish_reason in ("stop", "length")


def test_router_spreads_load_and_keeps_sessions_sticky(servers):
    async def main():
        router = Router(servers, timeout_s=120)
        await asyncio.gather(*[router.generate([3, 4, 5], {"max_tokens": 8}) for _ in range(8)])
        spread = {n: r["requests"] for n, r in router.metrics()["replicas"].items()}
        for turn in range(4):  # one conversation, several turns
            await router.generate([3, 4, 5 + turn], {"max_tokens": 4}, session_id="conversation-1")
        await asyncio.gather(*[router.generate([3], {"max_tokens": 4}, session_id="conversation-2")
                               for _ in range(3)])
        metrics = router.metrics()
        with pytest.raises(RolloutInputError, match="top_p"):  # a bad request is not a bad replica
            await router.generate([3], {"top_p": 0.0})
        assert router.metrics()["unhealthy"] == [] and router.metrics()["retries"] == 0
        return spread, metrics

    spread, metrics = asyncio.run(main())
    assert sorted(spread.values()) == [4, 4]
    after = [r["requests"] - spread[n] for n, r in metrics["replicas"].items()]
    assert sorted(after) in ([0, 7], [3, 4])  # each conversation stayed on one replica
    assert metrics["retries"] == 0 and metrics["unhealthy"] == [] and metrics["in_flight"] == 0


def test_router_fails_over_when_a_replica_is_killed_mid_stream(ray_session, servers):
    ray = ray_session
    victim, survivor = servers

    async def main():
        router = Router([victim, survivor], timeout_s=120)
        victim_name = list(router.metrics()["replicas"])[0]
        tasks = [asyncio.ensure_future(router.generate([3, 4, 5], {**LONGER, "seed": i}, f"r{i}"))
                 for i in range(12)]
        await asyncio.sleep(0)  # every request is now sent; none can be back yet
        assert router.metrics()["replicas"][victim_name]["in_flight"] == 6
        ray.kill(victim, no_restart=True)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        after = await router.generate([3, 4], {"max_tokens": 2}, "after-the-kill")
        return victim_name, outs, after, router.metrics()

    victim_name, outs, after, metrics = asyncio.run(main())
    assert all(len(o[0].token_ids) == LONGER["max_tokens"] for o in outs)  # every request completed
    assert after and after[0].token_ids
    assert metrics["unhealthy"] == [victim_name]
    assert metrics["retries"] >= 1
    assert metrics["replicas"][victim_name]["failures"] >= 1
    assert metrics["in_flight"] == 0 and metrics["requests"] == 13
