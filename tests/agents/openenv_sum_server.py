"""A real OpenEnv server (openenv-core's `create_app`) for tests/agents/test_openenv.py: "a+b=" with
two tries. reset(a, b, mode) takes the row's arguments; a right answer is reward 1 and ends the
episode, a wrong one asks again until the second try. The modes make one session fail the ways
a real server does: an observation without text, a step that never answers, a process that dies."""

from __future__ import annotations

import os
import threading

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SumAction(Action):
    message: str


class SumObservation(Observation):
    prompt: str | None = None


class SumEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, a=0, b=0, mode="ok", **kwargs):
        self.answer, self.mode, self.tries = str(a + b), mode, 0
        self.question = f"{a}+{b}="
        self._state = State(step_count=0)
        return SumObservation(prompt=self.question)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        self.tries += 1
        if self.mode == "no_text":
            return SumObservation(prompt=None)
        if self.mode == "hang":
            threading.Event().wait()  # never answers: the client's timeout ends the trajectory
        if self.mode == "die":
            os._exit(3)
        if action.message.strip() == self.answer:
            return SumObservation(done=True, reward=1.0)
        return SumObservation(prompt=self.question, done=self.tries >= 2, reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(SumEnvironment, SumAction, SumObservation, env_name="sum", max_concurrent_envs=64)
