"""docs/architecture.md is where the code's references lead: every requirement a comment cites
(R1-R5) has its section, nothing points at a document outside the repository, and every file
the page names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
CITED = re.compile(r"\bR([1-9])\b")


def sources() -> dict[str, str]:
    """Repository path -> text of every .py / .md file under polyrl, docs and tests (a file
    that disappears while this reads, moved by a concurrent edit, is left out)."""
    out = {}
    for path in (p for d in ("polyrl", "docs", "tests") for p in (ROOT / d).rglob("*")):
        if path.suffix in (".py", ".md") and path != Path(__file__).resolve():
            try:
                out[path.relative_to(ROOT).as_posix()] = path.read_text()
            except (FileNotFoundError, IsADirectoryError):
                continue
    return out


def headings() -> list[str]:
    return [line.lstrip("#").strip() for line in DOC.read_text().splitlines() if line.startswith("#")]


def test_every_cited_requirement_has_a_section():
    sections = {m.group(1) for h in headings() if (m := re.match(r"R([1-9]) — ", h))}
    assert sections == {"1", "2", "3", "4", "5"}
    cited = {(path, n) for path, text in sources().items() for n in CITED.findall(text)}
    missing = sorted(c for c in cited if c[1] not in sections)
    assert not missing, f"cited requirements without a section in docs/architecture.md: {missing}"


def test_nothing_cites_a_design_document_outside_the_repository():
    outside = "DESIGN" + ".md"  # spelled in two parts so this file does not cite it either
    offenders = [path for path, text in sources().items() if outside in text]
    assert not offenders


def test_the_files_the_page_names_exist():
    named = set(re.findall(r"`((?:polyrl|tests|docs|benchmarks)/[\w/.]+\.(?:py|md))`", DOC.read_text()))
    assert named, "the page names no file: the pattern is wrong"
    assert not sorted(n for n in named if not (ROOT / n).exists())


def test_the_sections_the_conventions_test_cites_exist():
    assert {"Layers", "Contracts", "Conventions", "The environment-plan rules", "Topologies",
            "The batch", "Training engines"} <= set(headings())


# --- "Topologies": where topology is decided -----------------------------------------------------

import ast  # noqa: E402

TOPOLOGY_TABLE = "polyrl/distributed/topologies.py"
PENDING_READS: dict[str, str] = {}
"""Modules that still read the keys directly, each to read `cfg.topology` instead (the change is
written down for their owners); the test fails once one stops, so the list only shrinks."""


def topology_key_reads(tree: ast.AST) -> list[int]:
    """Lines reading `<x>.rollout.placement`, `<x>.trainer.mode` or `<x>.distill.placement`
    (also on names `rollout` / `trainer` / `distill`)."""
    keys = {"placement": ("rollout", "distill"), "mode": ("trainer",)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in keys:
            base = node.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if name in keys[node.attr]:
                lines.append(node.lineno)
    return lines


def test_topology_is_decided_in_one_place():
    """Only the topology table reads rollout.placement, trainer.mode and distill.placement; the
    rest of polyrl reads the spec it returns (`cfg.topology`, `teacher_placement_of`) or an
    actor's `RolePlan`."""
    reads = {path: topology_key_reads(ast.parse(text)) for path, text in sources().items()
             if path.startswith("polyrl/") and path.endswith(".py")}
    readers = {path for path, lines in reads.items() if lines}
    assert TOPOLOGY_TABLE in readers, "the pattern is wrong: the table itself reads the keys"
    assert readers - {TOPOLOGY_TABLE} - set(PENDING_READS) == set(), {
        p: reads[p] for p in readers - {TOPOLOGY_TABLE} - set(PENDING_READS)}
    assert set(PENDING_READS) <= readers, f"no longer reads the keys: drop from PENDING_READS: {set(PENDING_READS) - readers}"
    assert "topology_of" in DOC.read_text() and TOPOLOGY_TABLE in DOC.read_text()


def test_each_topology_class_is_one_entry_of_the_table():
    from polyrl.distributed.topologies import TOPOLOGY_SPECS
    from polyrl.topology import TOPOLOGIES

    assert TOPOLOGIES.names() == list(TOPOLOGY_SPECS)
    for name, spec in TOPOLOGY_SPECS.items():
        assert TOPOLOGIES.get(name).spec is spec


def test_workers_act_on_their_role_plan():
    """The actors are constructed with a `RolePlan` (polyrl/distributed/role.py), the page's
    claim, and the replica engine is built in one place for both replica kinds."""
    import inspect

    from polyrl.distributed.role import RolePlan
    from polyrl.workers.policy import PolicyWorker
    from polyrl.workers.rollout_worker import RolloutWorker
    from polyrl.workers.streaming_replica import StreamingReplica

    for cls in (PolicyWorker, RolloutWorker, StreamingReplica):
        assert inspect.signature(cls).parameters["role"].annotation in (RolePlan, "RolePlan")
    builders = [path for path, text in sources().items() if path.startswith("polyrl/")
                and path.endswith(".py") and "build_disaggregated_engine(" in text
                and not path.startswith("polyrl/rollout/factory.py")]
    # the replica engine in one place; the other builder loads another model (the distillation
    # teacher's validation engine, polyrl/workers/teacher.py)
    assert sorted(builders) == ["polyrl/workers/rollout_worker.py", "polyrl/workers/teacher.py"]
    assert "RolePlan" in DOC.read_text()


# --- "Topologies": the run's plan is computed once ------------------------------------------------

PLANNER = {"polyrl/topology/run_plan.py", "polyrl/topology/launch_plan.py"}
"""The planner (`resolve`, `plan_launch`): the only code that builds a `ParallelDims`, besides the
class itself (polyrl/training/mesh.py)."""
def mesh_builds(tree: ast.AST) -> list[int]:
    """Lines calling `ParallelDims(...)`, `ParallelDims.of(...)` or `ParallelDims.from_actor(...)`."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id == "ParallelDims") or (
                isinstance(f, ast.Attribute) and f.attr in ("of", "from_actor")
                and isinstance(f.value, ast.Name) and f.value.id == "ParallelDims"):
            lines.append(node.lineno)
    return lines


def test_the_mesh_is_built_by_the_planner_only():
    """Every other holder of a `ParallelDims` (the policy group's batch sharding, the process-group
    plan, the dry run, each rank's training engines) is handed the plan's."""
    builds = {path: mesh_builds(ast.parse(text)) for path, text in sources().items()
              if path.startswith("polyrl/") and path.endswith(".py") and path != "polyrl/training/mesh.py"}
    builders = {path for path, lines in builds.items() if lines}
    assert PLANNER <= builders, "the pattern is wrong: the planner itself builds the mesh"
    outside = builders - PLANNER
    assert not outside, {p: builds[p] for p in outside}
    # an engine outside a run (polyrl sft, tests) lays its own out (training/mesh.py
    # `unplanned_mesh`); inside a run every training engine is handed the plan's
    unplanned = sorted(path for path, text in sources().items()
                       if path.startswith("polyrl/") and "unplanned_mesh(" in text and path != "polyrl/training/mesh.py")
    assert unplanned == ["polyrl/training/ddp.py"], unplanned
    workers = sources()
    assert "mesh=role.mesh" in workers["polyrl/workers/policy.py"]
    assert "mesh=role.mesh" in workers["polyrl/workers/teacher.py"]
    assert "RunPlan" in DOC.read_text() and "polyrl/topology/run_plan.py" in DOC.read_text()
