"""agent.tools accepts "/path/to/file.py:function" like reward functions and black-box agents,
and `check_agent` (the trainer's pre-flight) reports every tool that cannot load as one line
naming agent.tools - before Ray starts, not as a traceback from a rollout worker."""

from __future__ import annotations

import pytest

from polyrl.agents import AgentConfig, load_tools
from polyrl.agents.preflight import check_agent
from polyrl.config import ConfigError

TOOL_FILE = '''
def word_count(text: str) -> int:
    """Count the words of a text.

    Args:
        text: the text.
    """
    return len(text.split())
'''


def test_a_tool_from_a_file_path(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    spec = f"{path}:word_count"
    tools = load_tools([spec])
    assert tools["word_count"](text="a b c") == 3
    assert tools["word_count"].schema["function"]["parameters"]["properties"]["text"]["description"] == "the text."
    assert AgentConfig(tools=[spec]).tools == [spec]
    check_agent(AgentConfig(tools=[spec, "polyrl.agents.calculator:calculator"]))  # loads: no error


@pytest.mark.parametrize("source, spec, says", [
    (None, "{dir}/missing.py:f", "agent.tools: '{dir}/missing.py:f': file {dir}/missing.py does not exist"),
    (TOOL_FILE, "{path}:nope", "agent.tools: '{path}:nope': '{path}' has no function 'nope'; functions there: word_count"),
    ("import no_such_module_xyz\n", "{path}:f", "agent.tools: '{path}:f': cannot import '{path}': No module named 'no_such_module_xyz'"),
    ("x = 1 / 0\n", "{path}:f", "agent.tools: '{path}:f': importing it raised ZeroDivisionError: division by zero (at {path}, line 1); fix the module"),
    ("def f(:\n", "{path}:f", "agent.tools: '{path}:f': importing it raised SyntaxError"),
    ("def f(x: object) -> str:\n    return ''\n", "{path}:f", "agent.tools: '{path}:f': tool f, argument x: type hint"),
    (None, "polyrl.no_such_module:f", "agent.tools: 'polyrl.no_such_module:f': cannot import 'polyrl.no_such_module'"),
])
def test_tools_that_cannot_load_are_one_line_before_launch(tmp_path, source, spec, says):
    path = tmp_path / "broken_tool.py"
    if source is not None:
        path.write_text(source)
    spec, says = (s.format(dir=tmp_path, path=path) for s in (spec, says))
    cfg = AgentConfig.model_construct(**{**AgentConfig().model_dump(), "tools": [spec]})  # past the file check
    with pytest.raises(ConfigError) as info:
        check_agent(cfg)
    assert len(info.value.problems) == 1 and "\n" not in info.value.problems[0]
    assert info.value.problems[0].startswith(says), info.value.problems[0]


def test_the_config_refuses_a_tool_file_that_does_not_exist(tmp_path):
    with pytest.raises(ValueError, match="agent.tools: file .*missing.py does not exist"):
        AgentConfig(tools=[f"{tmp_path}/missing.py:f"])


def test_a_black_box_agent_that_cannot_load_is_one_line(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text("def solve(base_url, row, trajectory_id):\n    return None\n")
    check_agent(AgentConfig(black_box=f"{path}:solve"))
    with pytest.raises(ConfigError, match="agent.black_box"):
        check_agent(AgentConfig(black_box=f"{path}:other"))


def test_unregistered_environments_are_one_line_before_launch():
    from polyrl.data import PromptSample

    with pytest.raises(ConfigError, match=r"agent.environment=sokoban is not a registered environment; registered: tools"):
        check_agent(AgentConfig(environment="sokoban"))
    row = PromptSample(7, "x", [1], "", "", "", {"agent_name": "sokoban"})
    with pytest.raises(ConfigError, match=r"data row 7 names the environment 'sokoban' in extra_info.agent_name"):
        check_agent(AgentConfig(tools=["polyrl.agents.calculator:calculator"]), [], None, [row])
    check_agent(AgentConfig(), [row])  # single-turn: the rows' names are not read
    check_agent(AgentConfig(tools=["polyrl.agents.calculator:calculator"]),
                [PromptSample(0, "x", [1], "", "", "", {"agent_name": "tools"})])
