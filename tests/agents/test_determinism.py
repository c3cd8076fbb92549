"""Same seeds, same trajectories - bit for bit, log-probs included - whatever the timing of the
tools and environments.

The native engine's log-probs depend (by ~1e-6) on which sequences it batches together. Without
lockstep turns a trajectory's next turn joined the engine whenever its tool returned, so two
same-seed runs of the calculator recipe drifted apart (grad norm 1e-7 relative at first, 2e-4 by
step 9; issue 27). With `agent.lockstep_turns` (the default) every turn k enters the engine
together, in trajectory order (docs/agents.md, determinism). Real native engine, random
checkpoint, byte-level and SentencePiece-style tokenizers."""

from __future__ import annotations

import threading

from conftest import native
from polyrl.agents import ENVIRONMENTS, AgentConfig, Environment, run_trajectories_sync
from test_environments import rows, sampling


class WatchedEngine:
    """The real engine, plus a condition to wait on: all first turns served and nothing running."""

    def __init__(self, engine, first_turns: int):
        self.engine, self.first_turns = engine, first_turns
        self.served = self.running = 0
        self.changed = threading.Condition()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt_ids, sampling, request_id=None):
        with self.changed:
            self.running += 1
        try:
            return await self.engine.generate(prompt_ids, sampling, request_id)
        finally:
            with self.changed:
                self.running -= 1
                self.served += 1
                self.changed.notify_all()

    def wait_until_idle_after_first_turns(self) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.served >= self.first_turns and self.running == 0)


HOLD: dict = {}
"""What the "test_held" environment waits for: {"row": index, "engine": WatchedEngine}."""


@ENVIRONMENTS.register("test_held")
class Held(Environment):
    """Three steps; the steps of row HOLD["row"] return only once every first turn is served and
    the engine is idle. Without lockstep that row's later turns then run alone (the others' are
    over by then); with it, every later turn waits for that row's, and the batches are the same."""

    def reset(self, row):
        self.index, self.k = row.index, 0
        return None

    def step(self, action_text):
        if HOLD.get("row") == self.index:
            HOLD["engine"].wait_until_idle_after_first_turns()
        self.k += 1
        return f"step {self.k}", 0.0, self.k >= 3


def rollout(tokenizer, model_dir, hold: int | None, lockstep: bool = True):
    data = rows(tokenizer, ["test_held"] * 6)
    sp = sampling(tokenizer, n=4)
    engine = WatchedEngine(native(model_dir, tokenizer), len(data) * sp.n)
    HOLD.clear()
    HOLD.update({"row": hold, "engine": engine})
    cfg = AgentConfig(max_turns=4, max_response_tokens=200, lockstep_turns=lockstep)
    return run_trajectories_sync(engine, tokenizer, data, sp, cfg, seeds=[1, 2, 3, 4, 5, 6])


def test_step_timing_does_not_change_same_seed_trajectories(tokenizer, random_dir):
    """(With lockstep_turns=false this fails in every run tried: log-probs differ by ~1e-6.)"""
    free = rollout(tokenizer, random_dir, hold=None)
    held = rollout(tokenizer, random_dir, hold=2)
    assert sum(t.stats.turns for t in free.trajectories) > len(free.trajectories)  # later turns ran
    assert held.batch.response_ids.values.tolist() == free.batch.response_ids.values.tolist()
    assert held.batch.loss_mask.values.tolist() == free.batch.loss_mask.values.tolist()
    assert held.batch.rollout_logprobs.values.tolist() == free.batch.rollout_logprobs.values.tolist()
