"""reward.judge (polyrl/rewards/judge.py): an LLM judge behind an OpenAI-compatible endpoint. A real
local HTTP judge that answers, times out, writes garbage and answers 500 (each case scores 0, is
counted in the metrics and logged; nothing raises), the parsers, the cache, the weight in a sum,
an unreachable judge at start, and (slow) a real `polyrl serve` process as the judge."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cli_runs import train_here  # noqa: F401  (a fixture)

from polyrl.rewards import RewardManager
from polyrl.rewards.config import RewardConfig
from polyrl.rewards.judge import JudgeUnreachableError, parse_score, render
from polyrl.rewards.judge_config import JudgeRewardConfig
from polyrl.rewards.manager import RewardRequest
from polyrl.rewards.outcome import BadScoreError


class Judge(BaseHTTPRequestHandler):
    """Grades by what the rubric holds: "slow" never answers before the test ends, "garbage"
    answers prose, "crash" answers HTTP 500, anything else the number after "grade:"."""

    release = threading.Event()
    posts: list[str] = []

    def log_message(self, *args):  # keep the test output clean
        pass

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "judge"}]})

    def do_POST(self):
        rubric = json.loads(self.rfile.read(int(self.headers["content-length"])))["messages"][0]["content"]
        self.posts.append(rubric)
        if "slow" in rubric:
            self.release.wait(60)  # until the test is over; the judge's deadline fires first
            return self._send(200, _completion("10"))
        if "crash" in rubric:
            return self._send(500, {"error": "internal"})
        if "garbage" in rubric:
            return self._send(200, _completion("I would rather not say."))
        return self._send(200, _completion(re.search(r"grade:(\S+)", rubric).group(1)))

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the slow answer, after the judge gave up on it
            pass


def _completion(text):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


@pytest.fixture
def judge_url():
    Judge.release.clear()
    Judge.posts.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    Judge.release.set()
    server.shutdown()
    server.server_close()


def request(response, truth="4", source="arithmetic"):
    return RewardRequest(source, response, truth, True, None, prompt=[{"role": "user", "content": "2+2="}])


def test_timeouts_garbage_and_500_are_counted_and_logged_never_raised(judge_url, caplog):
    judge = JudgeRewardConfig(url=judge_url, model="judge", prompt="{prompt} {response}", timeout_s=2.0,
                              retries=2, backoff_s=0.0, max_concurrency=4)
    manager = RewardManager(RewardConfig(judge=judge))
    requests = [request("grade:10"), request("grade:5"), request("grade:10"),  # the third: cached
                request("slow"), request("garbage"), request("crash"), request("grade:11")]
    with caplog.at_level("WARNING"):
        result = manager.score(requests)
    manager.close()
    assert result.scores == [1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.accs == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.failed == [False, False, False, True, True, True, True]
    m = result.metrics
    assert m["reward/timeouts"] == 1 and m["reward/errors"] == 3  # garbage, 500, out of range
    assert m["reward/judge/timeouts"] == 1 and m["reward/judge/unparsed"] == 2
    assert m["reward/judge/http_errors"] == 1 and m["reward/judge/retries"] == 2  # the 500, retried twice
    assert m["reward/judge/requests"] == 2 + 1 + 1 + 3 + 1 and len(Judge.posts) == 8
    assert m["reward/judge/cache_hits"] == 1  # the identical rubric was asked once
    assert "exceeded reward.judge.timeout_s=2" in caplog.text
    assert "reward judge 'judge' for data_source 'arithmetic' failed" in caplog.text
    assert manager.error_summary()["timeouts"] == 1


def test_the_judge_is_a_weighted_term_of_a_sum(judge_url):
    judge = JudgeRewardConfig(url=judge_url, model="judge", prompt="{response} grade:{ground_truth}",
                              score_range=(0, 4), sources=[])
    cfg = RewardConfig(judge=judge, combine={"arithmetic": [{"kind": "function"},
                                                            {"kind": "judge", "weight": 0.5}]})
    manager = RewardManager(cfg)
    result = manager.score([request("4", truth="4"), request("5", truth="2")])
    manager.close()
    # function: exact match (1, 0); judge: the grade in the rubric on 0..4 (1.0, 0.5), weight 0.5
    assert result.scores == [1.0 + 0.5 * 1.0, 0.0 + 0.5 * 0.5]
    assert result.metrics["reward/term/judge"] == 0.75 and result.accs == [1.0, 0.0]


def test_rubric_and_parsers():
    req = RewardRequest("s", "the answer is 7", 7, True, None,
                        prompt=[{"role": "system", "content": "x"}, {"role": "user", "content": "3+4="}])
    assert render('Q: {prompt} A: {response} ref {ground_truth} {"json": 1}', req) == \
        'Q: 3+4= A: the answer is 7 ref 7 {"json": 1}'
    number = JudgeRewardConfig(url="http://h/v1", model="m", score_range=(1, 5))
    assert parse_score(number, "Score: 2 out of 5, final: 4") == 0.75
    with pytest.raises(BadScoreError, match="outside score_range"):
        parse_score(number, "9")
    labels = JudgeRewardConfig(url="http://h/v1", model="m", parser="labels",
                               labels={"CORRECT": 1.0, "INCORRECT": 0.0, "PARTIAL": 0.5})
    assert parse_score(labels, "Verdict: incorrect") == 0.0
    assert parse_score(labels, "first PARTIAL, on reflection Correct.") == 1.0
    with pytest.raises(BadScoreError, match="names none of the labels"):
        parse_score(labels, "CORRECTLY")
    with pytest.raises(ValueError, match="parser=labels needs reward.judge.labels"):
        JudgeRewardConfig(url="http://h/v1", model="m", parser="labels")
    with pytest.raises(ValueError, match="must start with http"):
        JudgeRewardConfig(url="h:8000", model="m")


def test_an_unreachable_judge_is_one_line_before_ray(train_here):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(JudgeUnreachableError, match=f"reward.judge.url={re.escape(url)} is unreachable"):
        RewardManager(RewardConfig(judge=JudgeRewardConfig(url=url, model="judge")))
    out = train_here(f"reward.judge.url={url}", "reward.judge.model=judge")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"reward.judge.url={url} is unreachable" in out.stderr
    assert "starting the actors" not in out.stdout + out.stderr


@pytest.fixture(scope="module")
def served_judge():
    """A real `polyrl serve` process serving the bundled tiny-arith model; its base URL."""
    proc = subprocess.Popen([sys.executable, "-m", "polyrl", "serve", "--model", "builtin:tiny-arith",
                             "--port", "0", "--max-model-len", "64", "--served-model-name", "tiny-judge"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        url = re.search(r"(http://\S+/v1)", line[0] if line else "")
        assert url, (line, proc.poll())
        yield url.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_polyrl_serve_as_the_judge(served_judge):
    """The served tiny-arith model is the judge: its rubric "{response}+0=" asks it to copy the
    response's number, which the number parser reads on 0..99."""
    judge = JudgeRewardConfig(url=served_judge, model="tiny-judge", prompt="{response}+0=",
                              score_range=(0, 99), max_tokens=4, acc_threshold=0.3)
    manager = RewardManager(RewardConfig(judge=judge))  # its check_at_start passes
    answers = ["12", "30", "41", "12"]
    result = manager.score([request(a) for a in answers])
    manager.close()
    assert result.metrics["reward/errors"] == 0 and result.metrics["reward/timeouts"] == 0
    assert result.scores == [int(a) / 99 for a in answers]  # carry-free: the warm start copies them
    assert result.accs == [0.0, 1.0, 1.0, 0.0]
    assert result.metrics["reward/judge/requests"] == 3 and result.metrics["reward/judge/cache_hits"] == 1


@pytest.mark.slow
def test_training_with_the_served_judge_as_a_weighted_term(served_judge, ray_session, tmp_path):
    """Two GRPO steps of the embedded task, rewarded by its verifier plus the served judge at
    weight 0.5: every response is judged, the term is logged, and a reply the parser cannot read
    (the warm start's stuttered answers make numbers beyond the range) is counted, not raised."""
    from polyrl.cli.train import EMBEDDED_DEFAULT
    from polyrl.config import load_config
    from polyrl.job import JobConfig
    from polyrl.trainer.loop import Trainer

    cfg = load_config(JobConfig, files=[EMBEDDED_DEFAULT], overrides=[
        f"reward.judge.url={served_judge}", "reward.judge.model=tiny-judge", 'reward.judge.prompt="{response}+0="',
        "reward.judge.score_range=[0, 199]", "reward.judge.max_tokens=4", "reward.judge.sources=[]",
        'reward.combine={"*": [{kind: function}, {kind: judge, weight: 0.5}]}',
        "trainer.total_steps=2", "trainer.val_every=0", "data.train_batch_size=4", "trainer.progress_bar=false",
        "logging.plot_at_end=false", f"trainer.output_dir={tmp_path}"])
    Trainer(cfg).fit()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/judge/requests" in s and "actor/loss" in s]
    assert len(steps) == 2
    for s in steps:
        assert s["reward/timeouts"] == 0 and s["reward/judge/http_errors"] == 0, s
        assert s["reward/errors"] == s["reward/judge/unparsed"], s  # the function term never fails
        assert s["reward/judge/requests"] + s["reward/judge/cache_hits"] == 4 * 8  # every sample judged
        assert 0.0 <= s["reward/term/judge"] <= 1.0 and "reward/term/function" in s
