"""Where the user's plugins import from, so every Ray worker can import them too.

A config names plugins by import path (`algorithm.adv_estimator: mypkg.est:my_adv`,
docs/plugins.md). The driver finds `mypkg` on its sys.path: your PYTHONPATH, or the directory
`polyrl train` runs in. A Ray worker on another node inherits neither, so the environment plan
gives every process a PYTHONPATH made of your PYTHONPATH (entries made absolute: a worker does
not run in your directory) and the directories the config's plugins import from
(`plugin_dirs`), each with its provenance (`python_path_entry` in plan.py).
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Mapping

from polyrl.config.targets import is_file_target, split_import_path

PYTHONPATH = "PYTHONPATH"

RAY_JOB_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set for a `ray job submit` driver: the job's runtime env (working_dir, py_modules) already puts
the job's code on every worker's path, and Ray writes PYTHONPATH for it itself."""


def python_path_dirs(user_env: Mapping[str, str]) -> list[str]:
    """The entries of your PYTHONPATH, absolute, in order, without repeats."""
    raw = user_env.get(PYTHONPATH, "")
    return _unique(os.path.abspath(p) for p in raw.split(os.pathsep) if p)


def plugin_dirs(specs: Iterable[str | None]) -> list[str]:
    """The directories the plugins named by `specs` ("package.module:name") import from, where
    that is neither an installed location (site-packages, the standard library) nor polyrl
    itself. Found with `importlib.util.find_spec` on the top-level package, which executes
    nothing; a package found nowhere on sys.path is looked for in the directory this process
    runs in, as the registry's loader does (polyrl/registry.py `import_module`). Files
    ("/path/to/file.py:name") travel by their path and add nothing."""
    dirs = []
    for spec in specs:
        target = split_import_path(spec or "")[0]
        if not target or is_file_target(target):
            continue
        top = target.partition(".")[0]
        if top == "polyrl":
            continue
        root = _module_root(top)
        if root is not None and not _installed(root):
            dirs.append(root)
    return _unique(dirs)


def _module_root(top: str) -> str | None:
    found = importlib.util.find_spec(top)
    if found is None:
        run_dir = Path.cwd()
        if (run_dir / f"{top}.py").is_file() or (run_dir / top).is_dir():
            return str(run_dir)
        return None
    if found.submodule_search_locations:  # a package: the directory holding it
        return str(Path(list(found.submodule_search_locations)[0]).parent)
    if found.origin and found.origin not in ("built-in", "frozen"):
        return str(Path(found.origin).parent)
    return None


def _installed(directory: str) -> bool:
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= set(getattr(site, "getsitepackages", lambda: [])())
    paths.add(getattr(site, "getusersitepackages", lambda: None)())
    paths.add(os.path.dirname(os.__file__))
    resolved = Path(directory).resolve()
    return any(p and (resolved == Path(p).resolve() or Path(p).resolve() in resolved.parents)
               for p in paths) or resolved == Path(sys.prefix).resolve()


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
