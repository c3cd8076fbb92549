"""`polyrl placement` on bad input: one line naming the fix, exit 2, before Ray starts (in-process
through polyrl.cli.main.main, the function `python -m polyrl` exits with). Its runs against a
live cluster are in tests/placement/test_trtllm_placement.py."""

from __future__ import annotations

import pytest


@pytest.fixture
def polyrl_here(capsys, monkeypatch):
    """`polyrl ARGS` in this process; Ray must not start (ray.init raises if called)."""
    import ray

    from polyrl.cli.main import main

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init was called on bad input")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def run(*args):
        code = main(["placement", *args])
        out = capsys.readouterr()
        return code, out.out, " ".join(out.err.split())  # the console wraps long lines

    return run


@pytest.mark.parametrize("args,message", [
    (["--platform", "cpu"], "polyrl placement checks device placement; platform cpu has no devices: "
                            "run it on the GPU / NPU machines of the job, or pass --platform"),
    (["--platform", "h100", "--timeout", "0"], "--timeout: expected a positive number of seconds, got 0"),
    (["--platform", "h100", "rollout.tensor_parallel_size=2"],
     "rollout.tensor_parallel_size=2 needs a GPU engine"),
    (["--platform", "h100", "rollout.nonsense=1"], "rollout.nonsense"),
])
def test_bad_input_is_one_line_and_exit_2_before_ray(polyrl_here, args, message):
    code, out, err = polyrl_here(*args)
    assert code == 2 and out == ""
    assert err.startswith("error:") and message in err


def test_the_command_is_listed_in_polyrl_help(capsys):
    from polyrl.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "placement" in capsys.readouterr().out
