"""polyrl: reinforcement-learning post-training for language models, laptop to cluster.

    import polyrl
    summary = polyrl.train("my_job.yaml")        # or a dict of dotted keys, or a JobConfig
    summary = polyrl.sft({"trainer.total_steps": 10})

Importing polyrl has no side effects: no environment writes, no logging set-up, no device probes,
and no torch or Ray import: `train`, `sft` and the error types load on first access
(polyrl/api.py, docs/python_api.md).
"""

import sys
import types

__version__ = "0.1.0"

_LAZY = {
    "train": "polyrl.api",
    "JobConfig": "polyrl.job",
    "SFTConfig": "polyrl.sft.config",
    "ConfigError": "polyrl.config",
    "TrainingInterrupted": "polyrl.trainer.interrupts",
    "StartupInterrupted": "polyrl.trainer.interrupts",
}
"""Public name -> the module that defines it, imported when the name is first used."""

__all__ = ["__version__", "sft", *_LAZY]


class _SFTPackage(types.ModuleType):
    """The polyrl.sft package, callable: `polyrl.sft(config)` runs SFT (polyrl/api.py `sft`)
    while `polyrl.sft.config` and the other submodules stay where they are. The function and the
    package share the name, and importing any polyrl.sft submodule binds the package to it."""

    def __call__(self, config=None, overrides=None):
        from polyrl.api import sft

        return sft(config, overrides)


class _Polyrl(types.ModuleType):
    def __setattr__(self, name, value):
        # the import system binds polyrl.sft here when the package is first imported
        if name == "sft" and type(value) is types.ModuleType:
            value.__class__ = _SFTPackage
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Polyrl


def __getattr__(name: str):
    if name == "sft":  # the package (callable): importing it binds it through _Polyrl
        import importlib

        return importlib.import_module("polyrl.sft")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polyrl' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted([*globals(), "sft", *_LAZY])
