"""One set of names for where an engine lives (polyrl/config/vocabulary.py, docs/architecture.md
"Vocabulary"): colocated / disaggregated in config, code, docs and messages; the earlier config
values load as their names; nothing compares against the earlier ones."""

from __future__ import annotations

import ast
import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from polyrl.algorithms.distill_config import DistillConfig
from polyrl.config import ConfigError, load_config, parse_overrides, to_yaml
from polyrl.config import vocabulary
from polyrl.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
OLD = ("hybrid", "standalone")


@pytest.mark.parametrize("overrides,rollout,teacher", [
    (["rollout.placement=hybrid"], "colocated", "colocated"),
    (["rollout.placement=standalone"], "disaggregated", "colocated"),
    (["distill.placement=standalone", "distill.teacher=/t", "distill.world_size=2"], "colocated", "disaggregated"),
    (["rollout.placement=disaggregated", "distill.placement=disaggregated"], "disaggregated", "disaggregated"),
])
def test_earlier_values_load_as_their_names(overrides, rollout, teacher, tmp_path):
    cfg = load_config(JobConfig, overrides=overrides)
    assert (cfg.rollout.placement, cfg.distill.placement) == (rollout, teacher)
    # the resolved config (what --dry-run prints and the run saves) holds the name, and reloads
    saved = tmp_path / "resolved.yaml"
    saved.write_text(to_yaml(cfg))
    assert not any(f"placement: {old}" in saved.read_text() for old in OLD)
    again = load_config(JobConfig, files=[saved])
    assert (again.rollout.placement, again.distill.placement) == (rollout, teacher)
    # the same values from a YAML file
    written = tmp_path / "old.yaml"
    written.write_text(yaml.safe_dump(parse_overrides(overrides)))
    from_file = load_config(JobConfig, files=[written])
    assert (from_file.rollout.placement, from_file.distill.placement) == (rollout, teacher)


def test_an_alias_is_logged_once_and_the_topology_follows(monkeypatch, caplog):
    monkeypatch.setattr(vocabulary, "_announced", set())
    with caplog.at_level(logging.WARNING, logger=vocabulary.__name__):
        first = load_config(JobConfig, overrides=["rollout.placement=standalone"])
        load_config(JobConfig, overrides=["rollout.placement=standalone"])
    assert [r.getMessage() for r in caplog.records] == ["rollout.placement=standalone is now called disaggregated"]
    assert first.topology.name == "disaggregated" and first.topology.placement == "disaggregated"
    assert load_config(JobConfig, overrides=["rollout.placement=hybrid"]).topology.name == "colocated"


def test_an_alias_is_the_keys_own_and_an_unknown_value_names_the_choices():
    with pytest.raises(ConfigError, match="distill.placement: 'hybrid' is not one of colocated, disaggregated"):
        load_config(JobConfig, overrides=["distill.placement=hybrid"])  # never a teacher placement
    with pytest.raises(ConfigError, match="rollout.placement: 'remote' is not one of colocated, disaggregated"):
        load_config(JobConfig, overrides=["rollout.placement=remote"])
    assert DistillConfig(placement="standalone").placement == "disaggregated"


def test_no_source_compares_against_an_earlier_name():
    """Only the alias table spells the earlier values: code compares against the vocabulary's
    constants or the topology's fields, so a value the config did not normalize cannot pass as
    another placement."""
    offenders = []
    for path in sorted((ROOT / "polyrl").rglob("*.py")):
        if path == Path(vocabulary.__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in OLD:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "earlier placement names as values:\n" + "\n".join(offenders)


VALUE = re.compile(r"placement\W{1,3}(hybrid|standalone)\b|\b(hybrid|standalone) placement\b"
                   r"|\|\s*(hybrid|standalone)\s*\|", re.IGNORECASE)


def vocabulary_section(text: str) -> str:
    """docs/architecture.md's "Vocabulary" section: the one place that lists the aliases."""
    match = re.search(r"^## Vocabulary\n(.*?)(?=^## )", text, re.M | re.S)
    return match.group(0) if match else ""


def test_docs_and_configs_use_the_names():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").glob("*.yaml")),
             *sorted((ROOT / "polyrl" / "configs").glob("*.yaml"))]
    arch = (ROOT / "docs" / "architecture.md").read_text()
    assert "hybrid" in vocabulary_section(arch) and "standalone" in vocabulary_section(arch)
    offenders = []
    for path in files:
        text = path.read_text()
        if path.name == "architecture.md":
            text = text.replace(vocabulary_section(text), "")
        offenders += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                      for m in VALUE.finditer(text)]
    assert not offenders, "earlier placement names in docs or configs:\n" + "\n".join(offenders)


def test_an_alias_plans_the_same_run(capsys):
    """`--dry-run` under an earlier spelling prints the plan of the name, byte for byte (on a
    simulated H100 with vLLM: the disaggregated-only NCCL rule and engine host included)."""
    from polyrl.cli.main import main

    plans = []
    for spelling in ("standalone", "disaggregated"):
        assert main(["train", "--dry-run", "--json", "--platform", "h100", "rollout.backend=vllm",
                     "rollout.num_replicas=2", "rollout.tensor_parallel_size=2", "rollout.max_model_len=128",
                     f"rollout.placement={spelling}"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0] == plans[1]
    assert plans[0]["config"]["rollout"]["placement"] == "disaggregated"
    assert plans[0]["placement"]["placement"] == "disaggregated"
    assert plans[0]["job"]["env"]["NCCL_CUMEM_ENABLE"]["source"] == "rule:nccl-cumem-off"


def test_the_plan_consumers_take_the_spec_with_no_default():
    """The environment plan, the transport builder and the doctor are handed the planned
    topology; none falls back to a placement of its own."""
    import dataclasses
    import inspect

    from polyrl.cli.doctor import check_environment, collect
    from polyrl.distributed.ray_launch import plan_for_role
    from polyrl.envplan import PlanContext
    from polyrl.weights import build_transport

    fields = {f.name: f for f in dataclasses.fields(PlanContext)}
    assert fields["placement"].default is dataclasses.MISSING and fields["mode"].default is dataclasses.MISSING
    for fn in (plan_for_role, build_transport, check_environment, collect):
        assert inspect.signature(fn).parameters["topology"].default is inspect.Parameter.empty, fn.__name__


def test_a_checkpoint_written_under_an_earlier_name_resumes_unchanged():
    """A checkpoint's config.yaml from before the rename says placement: hybrid / standalone; the
    resume check reads the name, so the same run shows no changed setting."""
    from polyrl.trainer.checkpoint import check_compatible

    now = load_config(JobConfig, overrides=["rollout.placement=disaggregated"]).model_dump(mode="json")
    saved = {**now, "rollout": {**now["rollout"], "placement": "standalone"}}
    assert check_compatible(saved, now) == []
    other = {**now, "rollout": {**now["rollout"], "placement": "hybrid"}}
    assert check_compatible(other, now) == ["rollout.placement"]  # a real change is still one
