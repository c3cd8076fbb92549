"""Imports point down (docs/architecture.md, "Layers"): a module imports only modules of its own
layer or below, at module level and inside functions alike, with no exemption. Config modules
(`*/config.py`, `*_config.py`) are leaves: at module level they import, from polyrl, only the
config machinery (polyrl.config) and other config modules, so any layer can read a config class
without importing what it configures."""

from __future__ import annotations

import ast
from pathlib import Path

import polyrl

ROOT = Path(polyrl.__file__).parent
LAYERS = [
    {"config", "registry", "builtin", "modeling", "backends"},
    {"platform"},
    {"envplan"},
    {"distributed", "placement"},
    {"data", "rewards"},
    {"algorithms"},
    {"batch"},
    {"weights"},
    {"rollout"},
    {"agents"},
    {"training"},
    {"job"},
    {"workers"},
    {"topology"},
    {"trainer", "sft"},
    {"cli", "api"},
]


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "polyrl" or len(parts) < 2:
        return None
    top = parts[1]
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def is_config_leaf(module: str) -> bool:
    last = module.split(".")[-1]
    return last == "config" or last.endswith("_config")


def module_level_imports(tree: ast.Module) -> list[str]:
    """Imports executed when the module is imported (not inside functions or TYPE_CHECKING)."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                out.append(sub.module)
            elif isinstance(sub, ast.Import):
                out += [a.name for a in sub.names]
    return out


def all_imports(tree: ast.Module) -> list[str]:
    """Every import in the module, wherever it runs (module level, functions, TYPE_CHECKING)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def polyrl_modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        module = "polyrl." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out.append((module, ast.parse(path.read_text())))
    return out


def test_imports_point_down():
    wrong = []
    for module, tree in polyrl_modules():
        own = layer(module)
        if own is None:
            continue
        for target in all_imports(tree):
            theirs = layer(target)
            if theirs is not None and theirs > own:
                wrong.append(f"{module} imports {target}")
    assert not wrong, ("imports pointing up (a config module counts in its package's layer: what a "
                       "lower layer must read, e.g. job.py validating a topology, belongs in a lower "
                       "layer):\n" + "\n".join(wrong))


def test_config_modules_are_leaves():
    wrong = []
    for module, tree in polyrl_modules():
        if not is_config_leaf(module):
            continue
        for target in module_level_imports(tree):
            if (target.startswith("polyrl.") and target.split(".")[:2] != ["polyrl", "config"]
                    and not is_config_leaf(target)):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "config modules importing more than configs:\n" + "\n".join(wrong)


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert not {p for p in packages if layer(f"polyrl.{p}") is None}
