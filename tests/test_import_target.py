"""polyrl.registry.import_target: a user's file loaded by several threads at once (agent runs) is
executed once, and no thread sees it half-executed."""

from __future__ import annotations

import sys
import threading

from polyrl.registry import import_target


def test_concurrent_loads_of_one_file_see_the_whole_module(tmp_path):
    gate, entered = threading.Event(), threading.Event()
    hooks = sys.modules["polyrl_test_gate"] = type(sys)("polyrl_test_gate")
    hooks.gate, hooks.entered, hooks.runs = gate, entered, 0
    agent = tmp_path / "agent.py"
    agent.write_text("import polyrl_test_gate as g\ng.runs += 1\ng.entered.set()\nassert g.gate.wait(30)\n"
                     "def solve():\n    return 7\n")
    results: list = []

    def load():
        try:
            results.append(import_target(str(agent), "polyrl_test_agent_").solve())
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            results.append(exc)

    first = threading.Thread(target=load)
    first.start()
    assert entered.wait(30)  # the first loader is executing the file
    others = [threading.Thread(target=load) for _ in range(3)]
    for t in others:
        t.start()
    for t in others:  # a loader that saw the half-executed module would be done by now
        t.join(1)
    gate.set()
    for t in [first, *others]:
        t.join(30)
    del sys.modules["polyrl_test_gate"]
    assert results == [7, 7, 7, 7] and hooks.runs == 1
