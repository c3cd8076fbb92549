"""The rollout backends: the one list every other place derives from.

Config validation (`rollout.backend`, `rollout.engine_kwargs`), the engine factory, the
missing-package hints, the environment plan and `polyrl doctor` all read `ROLLOUT_BACKENDS`,
so a backend is added in one place: here for the built-in ones, or from a separate package
through the `polyrl.rollout_backends` entry-point group (`name = "module:EngineClass"`), loaded
in every process that asks (Ray workers included), or in-process with `register_backend`. A
config may also name a backend by import path (`rollout.backend: mypkg.engine:MyEngine`): it is
imported and checked in whichever process first asks for it (the driver's config check, the
Ray worker that builds the engine), valid without being listed among the names.

Each backend declares what its engine can do (`EngineCapabilities`: tensor parallelism, sleep,
log-prob numerics, partial rollout, ...) as data, so the trainer, its pre-flight and `polyrl
doctor` ask the capabilities rather than the backend's name, and none of them has to import an
engine to know. A plugin declares its own: a `capabilities` class attribute on its
engine class, or a `RolloutBackend` spec it exports (docs/engine_plugins.md).

It also holds what polyrl supports of each engine package: the version range (`supported`),
checked by `polyrl doctor` and before an engine starts (`check_engine_version`), and the names
each adapter calls in it (`ENGINE_CONTRACTS`), which the contract tests
(tests/rollout/engines/test_contract_*.py) look up in the real packages' sources.

This module sits below rollout, envplan and config users on purpose: it imports nothing heavy
(engine classes are dotted paths, imported when first built).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from polyrl.config.targets import IMPORT_PATH_FORMS, is_file_target, is_import_path
from polyrl.registry import PluginLoadError, Registry, load_plugin

ENTRY_POINT_GROUP = "polyrl.rollout_backends"

DTYPE_NAMES = frozenset({"float32", "bfloat16", "float16"})
"""The dtype names `rollout.dtype` and the actor's dtypes take (polyrl/modeling.py)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What a rollout engine can do, declared as data. Every field defaults to the conservative
    answer (the engine cannot), so an engine that declares nothing still trains correctly: the
    loop recomputes old log-probs and the pre-flight refuses layouts it cannot serve."""

    tensor_parallel: bool = False
    """One replica may span several devices (rollout.tensor_parallel_size > 1)."""
    sleep: bool = False
    """`sleep()` frees device memory (KV cache, ...) while the trainer works; without it the
    call keeps everything resident (still callable)."""
    trainer_logprob_dtypes: frozenset[str] = frozenset()
    """The dtypes in which the engine's log-probs are the trainer's own numerics (same weights,
    same forward, same precision), so rollout log-probs can serve as PPO's old log-probs
    (actor.old_logprobs=auto) when rollout.dtype, actor.param_dtype and actor.compute_dtype
    are all one of them. Empty: always recompute."""
    partial_rollout: bool = False
    """`abort_all()` returns each request's tokens so far (stop_reason="aborted") and a request
    resubmitted with them continues it: async.partial_rollout=abort."""
    lora_adapters: bool = False
    """Serves a LoRA adapter sent on its own (rollout.lora_mode=adapter)."""
    fp8: bool = False
    """Serves block-FP8 weights (rollout.quantization=fp8)."""
    batch_invariant: bool = False
    """Has the trainer's batch-invariant forward (rollout.batch_invariant=true)."""
    images: bool = False
    """Serves image prompts of a vision-language model (`images=` of generate; docs/vision.md)."""
    routed_experts: bool = False
    """Returns the experts a mixture-of-experts model routed each generated token to
    (`TokenOutput.extra["routed_experts"]`), for actor.router_replay=R3 (docs/moe.md)."""
    unavailable: tuple[tuple[str, str, str], ...] = ()
    """(capability, platform, why): a declared capability the engine's build for that platform
    (polyrl's `Platform.name`) lacks, refused there in one line naming why
    (`feature_platform_problem`): vLLM's CPU build returns no routed experts."""
    since: tuple[tuple[str, str], ...] = ()
    """Version floors: (capability, the lowest engine package version that serves it), for a
    capability that needs a newer engine than the backend's supported range starts at (a dict
    is accepted). Pre-flight, the engine factory and `polyrl doctor` refuse the capability below
    its floor (`feature_version_problem`); the contract tests check the names it needs at the
    floor (`EngineUse.feature`). Absent: the whole supported range serves it."""

    def __post_init__(self):
        dtypes = frozenset(self.trainer_logprob_dtypes)
        if not dtypes <= DTYPE_NAMES:
            raise ValueError(f"EngineCapabilities.trainer_logprob_dtypes: {sorted(dtypes - DTYPE_NAMES)} "
                             f"not among {sorted(DTYPE_NAMES)}")
        object.__setattr__(self, "trainer_logprob_dtypes", dtypes)  # a list or set is accepted
        since = tuple(sorted(dict(self.since).items()))
        flags = {f.name for f in dataclasses.fields(self) if f.type in (bool, "bool")}
        for capability, floor in since:
            if capability not in flags:
                raise ValueError(f"EngineCapabilities.since: {capability!r} is not a capability "
                                 f"({', '.join(sorted(flags))})")
            _release(floor, f"EngineCapabilities.since[{capability!r}]")
        object.__setattr__(self, "since", since)
        unavailable = tuple(tuple(entry) for entry in self.unavailable)
        for entry in unavailable:
            if len(entry) != 3 or entry[0] not in flags:
                raise ValueError(f"EngineCapabilities.unavailable: {entry!r} is not (capability, platform, why) "
                                 f"with a capability of {', '.join(sorted(flags))}")
        object.__setattr__(self, "unavailable", unavailable)

    def minimum_version(self, capability: str) -> str | None:
        """The lowest engine version that serves `capability` (None: any supported one)."""
        return dict(self.since).get(capability)

    def unavailable_on(self, capability: str, platform: str) -> str | None:
        """Why the engine's build for `platform` lacks `capability` (None: it has it)."""
        return next((why for c, p, why in self.unavailable if c == capability and p == platform), None)

    def logprobs_match_trainer(self, rollout_dtype: str, param_dtype: str, compute_dtype: str) -> bool:
        """Whether the engine's log-probs equal the trainer's for these dtypes: all three the
        same, and one the engine declares."""
        return rollout_dtype == param_dtype == compute_dtype and rollout_dtype in self.trainer_logprob_dtypes

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["trainer_logprob_dtypes"] = sorted(self.trainer_logprob_dtypes)
        out["since"] = dict(self.since)
        out["unavailable"] = [list(entry) for entry in self.unavailable]
        return out


def _release(version: str, what: str) -> Any:
    """`version` as a packaging Version of its release (a local or dev build counts as it)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        raise ValueError(f"{what}: {version!r} is not a version") from None


@dataclass(frozen=True)
class RolloutBackend:
    name: str
    engine: str
    """The engine class as a dotted path, "module:Class" (imported on first use)."""
    package: str | None = None
    """Import name of the third-party package the engine needs (None: nothing beyond polyrl)."""
    extra: str | None = None
    """The polyrl extra that installs `package` (`pip install "polyrl[extra]"`)."""
    engine_processes: bool = False
    """The engine runs in worker processes of its own on devices its host hands them (the GPU
    engines), rather than inside the polyrl process; the environment plan treats such hosts
    specially (`polyrl/envplan/plan.py`)."""
    supported: str | None = None
    """The engine package's versions the adapter is written for, as a PEP 440 specifier
    (">=0.5.10,<0.6"); None: any."""
    distribution: str | None = None
    """The package's name on the index when it differs from the import name (tensorrt-llm)."""
    capabilities: EngineCapabilities = EngineCapabilities()
    """What the engine can do (see `EngineCapabilities`); read without importing the engine."""

    def engine_class(self) -> type:
        return load_plugin(self.engine, "polyrl_user_backend_")


class BackendError(ValueError):
    """A backend named by import path or entry point that cannot be used, as one line."""


ENGINE_MEMBERS = ("abort_all", "eos_token_ids", "from_model", "generate", "generate_batch", "health",
                  "sleep", "update_weights", "wake_up")
"""What the `RolloutEngine` protocol (polyrl/rollout/base.py, a layer above this one) requires
of an engine class; a plugin's class is checked against it.
tests/rollout/test_engine_capabilities.py keeps it equal to the protocol's members."""


class _Backends(Registry[RolloutBackend]):
    """The registered backends (built-in, `register_backend`, entry points) plus those named by
    import path. Entry-point plugins are loaded first, whatever is asked; each one's target, and
    each import path, is imported and checked the first time it is asked for (`load_backend`).
    `names()` lists the registered ones only: an import path is valid without being listed."""

    def __init__(self, kind: str):
        super().__init__(kind, entry_point_group=ENTRY_POINT_GROUP)
        self._paths: dict[str, RolloutBackend] = {}

    def get(self, name: str) -> RolloutBackend:
        if Registry.__contains__(self, name):  # loads the entry points first
            entry = self._entries[name]
            if isinstance(entry, str):  # an entry point's "module:attr", resolved on first use
                self._entries[name] = load_backend(name, entry)
            return super().get(name)
        if isinstance(name, str) and is_import_path(name):
            if name not in self._paths:
                self._paths[name] = load_backend(name, name)
            return self._paths[name]
        return super().get(name)  # RegistryError listing the valid names

    def __contains__(self, name: object) -> bool:
        try:
            self.get(name)  # type: ignore[arg-type]
        except (KeyError, ValueError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


ROLLOUT_BACKENDS: _Backends = _Backends("rollout backend")


def register_backend(name: str, engine: str, *, package: str | None = None, extra: str | None = None,
                     engine_processes: bool = False, supported: str | None = None,
                     distribution: str | None = None,
                     capabilities: EngineCapabilities = EngineCapabilities()) -> RolloutBackend:
    """Add a rollout backend; `engine` is the engine class's dotted path ("module:Class")."""
    if ":" not in engine:
        raise ValueError(f"rollout backend '{name}': engine must be a dotted path 'module:Class', "
                         f"got {engine!r}")
    return ROLLOUT_BACKENDS.register(name, RolloutBackend(name, engine, package, extra, engine_processes,
                                                          supported, distribution, capabilities))


def load_backend(name: str, target: str) -> RolloutBackend:
    """The backend `target` ("module:attr" or "/path/file.py:attr") points at, under `name`.

    `attr` is either a `RolloutBackend` spec (its engine stays a dotted path, imported when an
    engine is built, so its capabilities are read without importing the engine) or an engine
    class, checked against the `RolloutEngine` protocol, whose `capabilities` class attribute
    (its own, not inherited: a subclass may change what its base did) is its declaration;
    none declared: `EngineCapabilities()`. Raises BackendError (one line)."""
    if not is_import_path(target):
        raise BackendError(f"{target!r} is not 'package.module:Name' or '/path/to/file.py:Name'")
    try:
        obj = load_plugin(target, "polyrl_user_backend_")
    except PluginLoadError as exc:
        raise BackendError(_load_error(target, exc)) from None
    if isinstance(obj, RolloutBackend):
        if not is_import_path(obj.engine):
            raise BackendError(f"{target!r}: its engine must be a dotted path 'module:Class', got {obj.engine!r}")
        _check_capabilities(obj.capabilities, target)
        return dataclasses.replace(obj, name=name)
    if not isinstance(obj, type):
        raise BackendError(f"{target!r} is {type(obj).__name__}, not a rollout engine class or a "
                           "RolloutBackend (polyrl.backends)")
    _check_engine_class(obj, target)
    declared = vars(obj).get("capabilities", EngineCapabilities())
    _check_capabilities(declared, target)
    return RolloutBackend(name, target, capabilities=declared)


def _load_error(target: str, exc: PluginLoadError) -> str:
    """The one line for what `load_plugin` could not do with a backend's import path."""
    module_name, cause = exc.target, exc.cause
    if exc.stage == "file":
        return f"{target!r}: no file {cause}"
    if exc.stage == "attribute":
        return f"{target!r}: {module_name} has no attribute {exc.attr!r}"
    if (isinstance(cause, ModuleNotFoundError) and not is_file_target(module_name) and cause.name
            and (module_name + ".").startswith(cause.name + ".")):
        return (f"{target!r}: no module {cause.name!r} here; put the directory that holds it on "
                "PYTHONPATH, or pip install its package (docs/engine_plugins.md)")
    # anything but a missing module: the plugin's own module failed while it was imported
    fix = "" if isinstance(cause, ModuleNotFoundError) else "; fix the module"
    return f"{target!r}: importing {module_name} raised {_one_line(cause)}{fix}"  # type: ignore[arg-type]


def _one_line(exc: BaseException) -> str:
    """"Type: message (at file, line N)" of the innermost frame."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" (at {tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})" if tb is not None else ""
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {message}{where}"


def _check_engine_class(cls: type, target: str) -> None:
    missing = [n for n in ENGINE_MEMBERS if not hasattr(cls, n)]
    if missing:
        raise BackendError(f"{target!r} is not a rollout engine: {cls.__name__} lacks {', '.join(missing)} "
                           "(the RolloutEngine protocol, polyrl/rollout/base.py); subclass "
                           "polyrl.rollout.native.engine:NativeEngine or implement them")


def _check_capabilities(capabilities: Any, target: str) -> None:
    if not isinstance(capabilities, EngineCapabilities):
        raise BackendError(f"{target!r}: capabilities must be an EngineCapabilities (polyrl.backends), "
                           f"got {type(capabilities).__name__}")


# The ranges: the lowest version whose API has everything the adapter calls (ENGINE_CONTRACTS),
# below the next minor release, which nobody has checked yet. vLLM: `abort(list)` since 0.10.1,
# finish reasons through 0.33. SGLang: `async_generate(rid=...)` since 0.5.6; `Engine` built off
# the main thread since 0.5.10 (older ones register a signal handler, allowed only there: the
# adapter then builds it on the calling thread, which must be the main one); the weight-update
# session of 0.5.21+ is opened and closed around every update.
# TensorRT-LLM: `AsyncLLM` with its placement arguments and `enable_sleep` (1.1, 1.2).
# Capabilities: the built-in engine computes log-probs with the trainer's forward, equal in
# float32 (bf16 / fp16 round differently in its fused kernels; docs/native_engine.md); the GPU
# engines use kernels of their own in every dtype. Every engine's abort_all returns partial
# outputs (polyrl/workers/partial_rollout.py continues them).
register_backend("native", "polyrl.rollout.native.engine:NativeEngine", capabilities=EngineCapabilities(
    sleep=True, trainer_logprob_dtypes=frozenset({"float32"}), partial_rollout=True, batch_invariant=True,
    images=True, routed_experts=True))
_GPU_ENGINE = EngineCapabilities(tensor_parallel=True, sleep=True, partial_rollout=True, fp8=True)
VLLM_FP8_RELOAD_SINCE = "0.16.0"
"""vLLM's own layerwise weight reload (`model_loader.reload`), which FP8 updates go through:
before it, FP8 post-processing (0.10.1's `Fp8LinearMethod`) replaces each weight with a plain
parameter without a weight loader, and the next load asserts."""
VLLM_IMAGES_SINCE = "0.17.0"
"""`AsyncLLM.generate` takes an already-processed multimodal input (the trainer's ids and pixels
unchanged); `MultiModalKwargsItems` is new in 0.10.2, `MultiModalFieldConfig.batched(
keep_on_cpu=)` in 0.13."""
VLLM_ROUTED_EXPERTS_SINCE = "0.14.0"
"""The engine argument `enable_return_routed_experts` and `CompletionOutput.routed_experts` are
new in 0.14.0 (0.13.0 has neither)."""
VLLM_CPU_NO_ROUTES = "vLLM's CPU build cannot return routed experts (Model Runner V2 needs Triton)"
"""Why: vLLM 0.32's CPU build refuses `enable_return_routed_experts` ("AuxOutput Connector
requires Model Runner V2"), and with VLLM_USE_V2_MODEL_RUNNER=1 "Model Runner V2 requires
Triton", which the CPU build has not (measured, docs/moe.md "vLLM")."""
register_backend("vllm", "polyrl.rollout.engines.vllm:VLLMEngine", package="vllm", extra="vllm",
                 engine_processes=True, supported=">=0.10.1,<0.34",
                 capabilities=dataclasses.replace(
                     _GPU_ENGINE, lora_adapters=True, images=True, routed_experts=True,
                     since={"fp8": VLLM_FP8_RELOAD_SINCE, "images": VLLM_IMAGES_SINCE,
                            "routed_experts": VLLM_ROUTED_EXPERTS_SINCE},
                     unavailable=(("routed_experts", "cpu", VLLM_CPU_NO_ROUTES),)))
ROUTES_LAUNCH_ARGUMENT: dict[str, str] = {"vllm": "enable_return_routed_experts",
                                          "sglang": "enable_return_routed_experts"}
"""backend -> the launch argument that makes its engine record routes (vLLM's engine argument,
SGLang's server argument; recording costs memory and a copy per step, so it is off unless asked).
actor.router_replay=R3 sets it in `rollout.engine_kwargs` (polyrl/job.py)."""
SGLANG_ROUTED_EXPERTS_SINCE = "0.5.9"
"""`Engine.async_generate(return_routed_experts=...)`, the request flag the adapter sends, is new
in 0.5.9; the server flag (`ServerArgs.enable_return_routed_experts`) and the synchronous
`generate`'s request flag came in 0.5.7, but 0.5.7 and 0.5.8's `async_generate` cannot ask."""
register_backend("sglang", "polyrl.rollout.engines.sglang:SGLangEngine", package="sglang",
                 extra="sglang", engine_processes=True, supported=">=0.5.6,<0.6",
                 capabilities=dataclasses.replace(_GPU_ENGINE, routed_experts=True,
                                                  since={"routed_experts": SGLANG_ROUTED_EXPERTS_SINCE}))
register_backend("trtllm", "polyrl.rollout.engines.trtllm:TRTLLMEngine", package="tensorrt_llm",
                 extra="trtllm", engine_processes=True, supported=">=1.1,<1.3",
                 distribution="tensorrt-llm", capabilities=_GPU_ENGINE)


def backend_names() -> list[str]:
    """The registered backends' names (import-path backends are valid without being listed)."""
    return ROLLOUT_BACKENDS.names()


def check_backend(name: str) -> str:
    """`name` if it is a registered backend or the import path of a usable one (imported and
    checked here), else a one-line ValueError: the valid names, or what is wrong with the
    plugin (BackendError)."""
    if is_import_path(name) or name in backend_names():
        ROLLOUT_BACKENDS.get(name)
        return name
    hint = f"; a plugin by import path is {IMPORT_PATH_FORMS}" if "." in str(name) or "/" in str(name) else ""
    raise ValueError(f"{name!r} is not one of {', '.join(backend_names())}{hint}")


def capabilities(name: str) -> EngineCapabilities:
    """What backend `name`'s engine can do (a registered name or an import path); built-in
    backends' are data here, so asking imports no engine."""
    return ROLLOUT_BACKENDS.get(name).capabilities


def engines_that(capability: str) -> list[str]:
    """The registered backends whose engine declares `capability` (an `EngineCapabilities`
    field), for an error that names the choices: `engines_that("fp8")`."""
    if capability not in {f.name for f in dataclasses.fields(EngineCapabilities)}:
        raise ValueError(f"{capability!r} is not an EngineCapabilities field")
    return list(BackendView(lambda b: bool(getattr(b.capabilities, capability))))


class BackendView(Mapping[str, Any]):
    """A live read-only view of the backends: `select` keeps some, `value` maps each one. Live,
    so a plugin registered after import is seen wherever the view is used."""

    def __init__(self, select: Callable[[RolloutBackend], bool] = lambda b: True,
                 value: Callable[[RolloutBackend], Any] = lambda b: b):
        self._select, self._value = select, value

    def _chosen(self) -> dict[str, RolloutBackend]:
        out = {}
        for name in ROLLOUT_BACKENDS.names():
            try:
                backend = ROLLOUT_BACKENDS.get(name)
            except BackendError:  # a broken plugin is no choice; naming it says what is wrong
                continue
            if self._select(backend):
                out[name] = backend
        return out

    def __getitem__(self, name: str) -> Any:
        """Any backend, an import path included (iteration lists the registered ones)."""
        try:
            backend = ROLLOUT_BACKENDS.get(name)
        except (KeyError, ValueError):
            raise KeyError(name) from None
        if not self._select(backend):
            raise KeyError(name)
        return self._value(backend)

    def __iter__(self) -> Iterator[str]:
        return iter(self._chosen())

    def __len__(self) -> int:
        return len(self._chosen())

    def __repr__(self) -> str:
        return f"BackendView({list(self)})"


ENGINE_PROCESS_BACKENDS = BackendView(lambda b: b.engine_processes)
"""Backends whose engine runs in processes of its own (the GPU engines)."""
PACKAGED_BACKENDS = BackendView(lambda b: b.package is not None, lambda b: (b.package, b.extra))
"""backend -> (import name, polyrl extra) for the backends that need a third-party package."""


# --- supported versions ---------------------------------------------------------------------------

def installed_engine_version(name: str) -> str | None:
    """The installed version of backend `name`'s engine package (None: built in, or absent)."""
    from importlib.metadata import PackageNotFoundError, version

    backend = ROLLOUT_BACKENDS.get(name)
    if backend.package is None:
        return None
    for dist in filter(None, (backend.distribution, backend.package)):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def version_problem(name: str, installed: str | None) -> str | None:
    """One line naming the fix when `installed` (backend `name`'s engine package version) is
    outside the range polyrl supports; None when it is inside, unknown or unconstrained."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    backend = ROLLOUT_BACKENDS.get(name)
    if installed is None or backend.supported is None:
        return None
    try:
        # a local or dev build of a supported release counts as that release
        release = Version(Version(installed).base_version)
    except InvalidVersion:
        return None
    spec = SpecifierSet(backend.supported)
    if release in spec:
        return None
    dist = backend.distribution or backend.package
    return (f"rollout.backend={name}: {dist} {installed} is outside the versions polyrl supports "
            f"({dist}{backend.supported}): pip install \"{dist}{backend.supported}\"")


def feature_version_problem(name: str, capability: str, installed: str | None,
                            setting: str | None = None) -> str | None:
    """One line naming the fix when backend `name`'s engine at version `installed` is below the
    floor its capabilities declare for `capability` (`EngineCapabilities.since`); None when it
    is at or above it, or either is unknown. `setting`: what asks for it (a config key)."""
    from packaging.specifiers import SpecifierSet

    backend = ROLLOUT_BACKENDS.get(name)
    floor = backend.capabilities.minimum_version(capability)
    if floor is None or installed is None:
        return None
    try:
        release = _release(installed, "installed")
    except ValueError:
        return None
    if release >= _release(floor, capability):
        return None
    dist = backend.distribution or backend.package or name
    upper = [str(s) for s in SpecifierSet(backend.supported or "") if s.operator in ("<", "<=")]
    pin = ",".join([f">={floor}", *upper])
    return (f"{setting or capability}: rollout.backend={name} serves {capability} from {dist} {floor} on, "
            f"{installed} is installed: pip install \"{dist}{pin}\"")


def feature_platform_problem(name: str, capability: str, platform: str | None,
                             setting: str | None = None, fix: str = "") -> str | None:
    """One line naming why when backend `name`'s engine build for `platform` (polyrl's platform
    name) lacks `capability` although the engine declares it (`EngineCapabilities.unavailable`),
    then `fix`; None where it has it or the platform is unknown."""
    why = ROLLOUT_BACKENDS.get(name).capabilities.unavailable_on(capability, platform or "")
    if why is None:
        return None
    return f"{setting or capability}: {why}" + (f"; {fix}" if fix else "")


def features_below_floor(name: str, installed: str | None) -> list[tuple[str, str]]:
    """(capability, floor) of every capability backend `name` declares that `installed` is
    below the floor of (for `polyrl doctor`)."""
    caps = ROLLOUT_BACKENDS.get(name).capabilities
    return [(c, floor) for c, floor in caps.since
            if getattr(caps, c) and feature_version_problem(name, c, installed)]


def check_engine_version(name: str, installed: str | None = None) -> None:
    """Raise ValueError (one line, naming the pip command) when the installed engine of backend
    `name` is outside its supported range. `installed`: the version to judge (default: the
    installed package's). Called before an engine starts (`polyrl/rollout/factory.py`) and by
    the trainer's pre-flight."""
    problem = version_problem(name, installed if installed is not None else installed_engine_version(name))
    if problem:
        raise ValueError(problem)


# --- what each adapter calls in its engine package ------------------------------------------------

@dataclass(frozen=True)
class EngineUse:
    """One name an adapter (or the launch arguments it passes on) uses in its engine package.

    `target` is "module:Name" (a class or function importable from that module) or
    "module:Class.member" (a method, or an attribute the class sets or declares, its bases
    included). `keywords`: keyword arguments passed to the call (for a class: its constructor,
    whose fields count). `versions`: the engine versions the use applies to (a specifier;
    empty: all supported)."""

    target: str
    keywords: tuple[str, ...] = ()
    versions: str = ""
    feature: str = ""
    """The capability this use serves when it has a version floor (`EngineCapabilities.since`):
    its `versions` then start at the floor (">=floor", or a later bound where the name moved),
    and the contract tests check it at the floor."""


SGLANG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop",
                        "ignore_eos", "sampling_seed")
"""Keys of the `sampling_params` dicts the SGLang adapter sends (`sglang_sampling_params`)."""
SGLANG_LAUNCH_KEYS = ("model_path", "dtype", "tp_size", "mem_fraction_static", "context_length",
                      "max_running_requests", "disable_radix_cache", "disable_cuda_graph",
                      "attention_backend", "load_format", "enable_memory_saver", "log_level",
                      "quantization", "json_model_override_args")
"""`ServerArgs` fields polyrl's launch arguments may set (`launch_args.sglang_args`)."""
SGLANG_WEIGHT_SESSION_SINCE = "0.5.21"
"""From this SGLang version on, weights load only between begin_/end_weight_update."""
SGLANG_ANY_THREAD_SINCE = "0.5.10"
"""From this SGLang version on, `Engine` may be built off the main thread."""

TRTLLM_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "stop",
                        "ignore_eos", "seed", "logprobs")
"""Keywords of the `SamplingParams` the TRT-LLM adapter builds (`trtllm_sampling_kwargs`)."""
TRTLLM_LAUNCH_KEYS = ("model", "backend", "dtype", "tensor_parallel_size", "max_seq_len",
                      "max_batch_size", "kv_cache_config", "load_format", "enable_sleep",
                      "orchestrator_type", "ray_worker_extension_cls", "allreduce_strategy",
                      "model_kwargs")
"""`TorchLlmArgs` fields polyrl's launch arguments may set (`launch_args.trtllm_args`)."""
TRTLLM_PLACEMENT_KEYS = ("placement_groups", "placement_bundle_indices", "per_worker_gpu_share")
"""`AsyncLLM`'s own placement arguments (the adapter fills the first two at start)."""

VLLM_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "stop",
                      "ignore_eos", "logprobs", "seed", "output_kind")
"""Keywords of the `SamplingParams` the vLLM adapter builds (`vllm_sampling_kwargs`)."""
VLLM_LAUNCH_KEYS = ("model", "dtype", "tensor_parallel_size", "distributed_executor_backend",
                    "gpu_memory_utilization", "max_model_len", "max_num_seqs", "enable_prefix_caching",
                    "enforce_eager", "load_format", "enable_lora", "enable_sleep_mode",
                    "worker_extension_cls", "quantization", "hf_overrides")
"""`AsyncEngineArgs` fields polyrl's launch arguments may set (`launch_args.vllm_args`)."""

ENGINE_CONTRACTS: dict[str, tuple[EngineUse, ...]] = {
    "vllm": (
        EngineUse("vllm:AsyncEngineArgs", VLLM_LAUNCH_KEYS),
        EngineUse("vllm:SamplingParams", VLLM_SAMPLING_KEYS),
        EngineUse("vllm.sampling_params:RequestOutputKind.FINAL_ONLY"),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.from_engine_args"),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.generate", ("lora_request",)),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.abort"),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.sleep", ("level",)),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.wake_up", ("tags",)),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.reset_prefix_cache"),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", ("args",)),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.add_lora"),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.remove_lora"),
        EngineUse("vllm.v1.engine.async_llm:AsyncLLM.shutdown"),
        EngineUse("vllm.lora.request:LoRARequest", ("lora_name", "lora_int_id", "lora_path")),
        EngineUse("vllm.model_executor.model_loader.utils:process_weights_after_loading"),
        # FP8 updates go through vLLM's own layerwise reload (engines/vllm_worker.py)
        EngineUse("vllm.model_executor.model_loader.reload:initialize_layerwise_reload",
                  versions=f">={VLLM_FP8_RELOAD_SINCE}", feature="fp8"),
        EngineUse("vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
                  versions=f">={VLLM_FP8_RELOAD_SINCE}", feature="fp8"),
        # image prompts as an already-processed multimodal input (engines/vllm.py:vllm_image_prompt)
        EngineUse("vllm.multimodal.inputs:MultiModalKwargsItems.from_hf_inputs",
                  versions=f">={VLLM_IMAGES_SINCE}", feature="images"),
        EngineUse("vllm.multimodal.inputs:MultiModalFieldConfig.batched", ("keep_on_cpu",),
                  versions=f">={VLLM_IMAGES_SINCE}", feature="images"),
        EngineUse("vllm.multimodal.inputs:MultiModalFieldConfig.flat_from_sizes",
                  versions=f">={VLLM_IMAGES_SINCE}", feature="images"),
        EngineUse("vllm.multimodal.inputs:PlaceholderRange", ("offset", "length"),
                  versions=f">={VLLM_IMAGES_SINCE}", feature="images"),
        # routes for actor.router_replay=R3 (engines/vllm.py, engines/routed_experts.py); the CPU
        # build, which cannot serve them, is told apart by vLLM's own platform
        EngineUse("vllm:AsyncEngineArgs", ("enable_return_routed_experts",),
                  versions=f">={VLLM_ROUTED_EXPERTS_SINCE}", feature="routed_experts"),
        EngineUse("vllm.outputs:CompletionOutput.routed_experts",
                  versions=f">={VLLM_ROUTED_EXPERTS_SINCE}", feature="routed_experts"),
        EngineUse("vllm.platforms.interface:Platform.is_cpu"),
    ),
    "sglang": (
        EngineUse("sglang:Engine"),
        EngineUse("sglang.srt.entrypoints.engine:Engine.async_generate",
                  ("input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "rid")),
        EngineUse("sglang.srt.entrypoints.engine:Engine.tokenizer_manager"),
        EngineUse("sglang.srt.entrypoints.engine:Engine.shutdown"),
        # ServerArgs: a dataclass, then (0.5.20) a struct assembled from field namespaces
        EngineUse("sglang.srt.server_args:ServerArgs", SGLANG_LAUNCH_KEYS, versions="<0.5.20"),
        EngineUse("sglang.srt.arg_groups.fields:*", SGLANG_LAUNCH_KEYS, versions=">=0.5.20"),
        EngineUse("sglang.srt.sampling.sampling_params:SamplingParams", SGLANG_SAMPLING_KEYS),
        EngineUse("sglang.srt.managers.io_struct:UpdateWeightsFromTensorReqInput",
                  ("serialized_named_tensors", "load_format", "flush_cache")),
        EngineUse("sglang.srt.managers.io_struct:ReleaseMemoryOccupationReqInput", ("tags",)),
        EngineUse("sglang.srt.managers.io_struct:ResumeMemoryOccupationReqInput", ("tags",)),
        EngineUse("sglang.srt.managers.tokenizer_manager:TokenizerManager.update_weights_from_tensor"),
        EngineUse("sglang.srt.managers.tokenizer_manager:TokenizerManager.flush_cache"),
        EngineUse("sglang.srt.managers.tokenizer_manager:TokenizerManager.release_memory_occupation"),
        EngineUse("sglang.srt.managers.tokenizer_manager:TokenizerManager.resume_memory_occupation"),
        EngineUse("sglang.srt.managers.tokenizer_manager:TokenizerManager.abort_request", ("abort_all",)),
        EngineUse("sglang.srt.utils:MultiprocessingSerializer.serialize"),
        EngineUse("sglang.srt.managers.io_struct:BeginWeightUpdateReqInput",
                  versions=f">={SGLANG_WEIGHT_SESSION_SINCE}"),
        EngineUse("sglang.srt.managers.io_struct:EndWeightUpdateReqInput",
                  versions=f">={SGLANG_WEIGHT_SESSION_SINCE}"),
        EngineUse("sglang.srt.managers.tokenizer_manager:TokenizerManager.begin_weight_update",
                  versions=f">={SGLANG_WEIGHT_SESSION_SINCE}"),
        EngineUse("sglang.srt.managers.tokenizer_manager:TokenizerManager.end_weight_update",
                  versions=f">={SGLANG_WEIGHT_SESSION_SINCE}"),
        # routes for actor.router_replay=R3 (engines/sglang.py, engines/routed_experts.py): the
        # server flag (a ServerArgs field, in the field namespaces from 0.5.20) and the request flag
        EngineUse("sglang.srt.server_args:ServerArgs", ("enable_return_routed_experts",),
                  versions=f">={SGLANG_ROUTED_EXPERTS_SINCE},<0.5.20", feature="routed_experts"),
        EngineUse("sglang.srt.arg_groups.fields:*", ("enable_return_routed_experts",),
                  versions=">=0.5.20", feature="routed_experts"),
        EngineUse("sglang.srt.entrypoints.engine:Engine.async_generate", ("return_routed_experts",),
                  versions=f">={SGLANG_ROUTED_EXPERTS_SINCE}", feature="routed_experts"),
    ),
    "trtllm": (
        EngineUse("tensorrt_llm:AsyncLLM"),
        EngineUse("tensorrt_llm:SamplingParams", TRTLLM_SAMPLING_KEYS),
        EngineUse("tensorrt_llm.llmapi:KvCacheConfig", ("enable_block_reuse", "free_gpu_memory_fraction")),
        EngineUse("tensorrt_llm.llmapi.llm_args:TorchLlmArgs", TRTLLM_LAUNCH_KEYS),
        EngineUse("tensorrt_llm._torch.async_llm:AsyncLLM", TRTLLM_PLACEMENT_KEYS),
        EngineUse("tensorrt_llm._torch.async_llm:AsyncLLM.generate_async", ("sampling_params",)),
        EngineUse("tensorrt_llm._torch.async_llm:AsyncLLM.collective_rpc", ("args", "unique_reply_rank")),
        EngineUse("tensorrt_llm._torch.async_llm:AsyncLLM.release", ("tags",)),
        EngineUse("tensorrt_llm._torch.async_llm:AsyncLLM.resume", ("tags",)),
        EngineUse("tensorrt_llm._torch.async_llm:AsyncLLM.shutdown"),
        EngineUse("tensorrt_llm.llmapi.rlhf_utils:WorkerExtension.update_weights"),
        # polyrl's extension (engines/trtllm_worker.py) reloads a VLM without partial loading
        EngineUse("tensorrt_llm._torch.pyexecutor.model_loader:ModelLoader.reload", ("allow_partial_loading",)),
        EngineUse("tensorrt_llm._torch.utils:get_device_uuid"),
    ),
}
"""Backend -> every name its adapter calls in the engine package, for the contract tests."""
