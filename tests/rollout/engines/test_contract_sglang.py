"""The SGLang adapter against the real SGLang releases, without a GPU: every name it calls
(`ENGINE_CONTRACTS["sglang"]` in polyrl/backends.py) must exist in each release checked, and the
two version boundaries the adapter acts on are read from the releases' own source.

Releases: the lowest supported, the last before each boundary and the first after it, and the
newest checked. Wheels come from the package index (`pip download --no-deps`) into a cache
(test_contract_inspect.engine_source); ~110 MB the first time, seconds with a warm cache.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from polyrl.backends import (
    ENGINE_CONTRACTS,
    ROLLOUT_BACKENDS,
    SGLANG_ANY_THREAD_SINCE,
    SGLANG_WEIGHT_SESSION_SINCE,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_contract_inspect import contract_gaps, engine_source  # noqa: E402

LOWEST = "0.5.6"
BEFORE_ANY_THREAD, ANY_THREAD = "0.5.9", SGLANG_ANY_THREAD_SINCE
BEFORE_SESSION, SESSION = "0.5.20", SGLANG_WEIGHT_SESSION_SINCE
NEWEST = "0.5.23"
CHECKED = (LOWEST, BEFORE_ANY_THREAD, ANY_THREAD, BEFORE_SESSION, SESSION, NEWEST)

slow = pytest.mark.slow  # downloads wheels on a cold cache


def source(version: str) -> Path:
    return engine_source("sglang", "sglang", version)


def test_the_checked_releases_span_the_supported_range():
    spec = SpecifierSet(ROLLOUT_BACKENDS.get("sglang").supported)
    assert all(v in spec for v in CHECKED)
    assert "0.5.5" not in spec  # the release below LOWEST lacks async_generate(rid=...)


@slow
@pytest.mark.parametrize("version", CHECKED)
def test_every_name_the_adapter_calls_exists(version):
    assert contract_gaps(source(version), ENGINE_CONTRACTS["sglang"], version) == []


@slow
def test_the_release_below_the_range_is_missing_what_the_adapter_calls():
    # the check can fail: 0.5.5's async_generate takes no rid, which the adapter passes
    gaps = contract_gaps(source("0.5.5"), ENGINE_CONTRACTS["sglang"], "0.5.5")
    assert gaps == ["sglang.srt.entrypoints.engine:Engine.async_generate: no keyword(s) rid"]


def _session_guard(root: Path) -> bool:
    """Whether the scheduler refuses update_weights_from_tensor outside a weight-update session."""
    updater = root / "sglang/srt/managers/scheduler_components/weight_updater.py"
    return updater.is_file() and "begin_weight_update() and end_weight_update()" in updater.read_text()


@slow
def test_weights_load_only_inside_a_session_from_the_declared_version():
    assert not _session_guard(source(BEFORE_SESSION))
    assert _session_guard(source(SESSION)) and _session_guard(source(NEWEST))


def _signal_off_main_thread(root: Path) -> bool:
    """Whether Engine start-up may call signal.signal outside a main-thread check."""
    tree = ast.parse((root / "sglang/srt/entrypoints/engine.py").read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "main_thread" in ast.unparse(node.test):
            guarded.update(id(n) for n in ast.walk(node))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == "signal.signal"]
    return any(id(c) not in guarded for c in calls)


@slow
def test_engine_start_registers_signals_off_the_main_thread_until_the_declared_version():
    assert _signal_off_main_thread(source(BEFORE_ANY_THREAD))
    assert not _signal_off_main_thread(source(ANY_THREAD))
    assert not _signal_off_main_thread(source(NEWEST))


# --- what the adapter does at the boundaries --------------------------------------------------------

def test_the_adapter_acts_on_the_boundaries():
    from polyrl.rollout.engines.sglang import starts_on_main_thread_only, uses_weight_session

    assert [uses_weight_session(v) for v in ("0.5.20", "0.5.21", "0.5.23.post1", None)] == [
        False, True, True, True]
    assert [starts_on_main_thread_only(v) for v in ("0.5.6", "0.5.9", "0.5.10", None)] == [
        True, True, False, False]


class SessionTokenizerManager:
    """SGLang >= 0.5.21's rules as its scheduler applies them (weight_updater.py): tensors load
    only inside an open session, one session at a time. Records every call. SGLang itself needs
    a GPU; its rules are checked against its source above."""

    def __init__(self, fail_piece: int | None = None):
        self.calls: list[str] = []
        self.open = False
        self.fail_piece = fail_piece
        self.pieces = 0

    async def begin_weight_update(self, obj, request):
        self.calls.append("begin")
        if self.open:
            return False, "a weight-update session is already open"
        self.open = True
        return True, ""

    async def end_weight_update(self, obj, request):
        self.calls.append("end")
        ok = self.open
        self.open = False
        return ok, "" if ok else "no weight-update session is open"

    async def update_weights_from_tensor(self, obj, request):
        self.calls.append(f"update {len(obj.serialized_named_tensors)}")
        self.pieces += 1
        if not self.open:
            return False, ("update_weights_from_tensor must run between begin_weight_update() and "
                           "end_weight_update()")
        if self.pieces == self.fail_piece:
            return False, "shape mismatch"
        return True, ""

    async def flush_cache(self):
        self.calls.append("flush")


def _io():
    from types import SimpleNamespace

    class Req:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    return SimpleNamespace(UpdateWeightsFromTensorReqInput=Req, BeginWeightUpdateReqInput=Req,
                           EndWeightUpdateReqInput=Req, serialize=lambda piece: repr(piece).encode())


def _pieces(n):
    import torch

    return [[(f"w{i}", torch.zeros(2))] for i in range(n)]


def test_weights_go_in_inside_one_session_then_the_cache_is_flushed():
    import asyncio

    from polyrl.rollout.engines.sglang import push_weight_pieces

    tm = SessionTokenizerManager()
    sent = push_weight_pieces(asyncio.run, tm, _pieces(3), tp_size=2, session=True, io=_io())
    assert sent == 3 and tm.calls == ["begin", "update 2", "update 2", "update 2", "end", "flush"]
    # the adapter before issue 28 sent no session: SGLang >= 0.5.21 refuses the first piece
    with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
        push_weight_pieces(asyncio.run, SessionTokenizerManager(), _pieces(1), tp_size=1,
                           session=False, io=_io())


def test_a_failed_piece_still_closes_the_session_so_the_next_update_can_open_one():
    import asyncio

    from polyrl.rollout.engines.sglang import push_weight_pieces

    tm = SessionTokenizerManager(fail_piece=2)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        push_weight_pieces(asyncio.run, tm, _pieces(3), tp_size=1, session=True, io=_io())
    assert tm.calls == ["begin", "update 1", "update 1", "end"] and not tm.open
    tm.fail_piece = None
    push_weight_pieces(asyncio.run, tm, _pieces(1), tp_size=1, session=True, io=_io())
    assert tm.calls[-4:] == ["begin", "update 1", "end", "flush"]


# --- logprob_start_len: 0.5.6 aborts at >= the input length, 0.5.7 on at > (issue 39) -------------

def _abort_rule(root: Path) -> str:
    """The comparison the scheduler aborts a request's logprob_start_len with: ">=" or ">"."""
    text = (root / "sglang/srt/managers/scheduler.py").read_text()
    if "logprob_start_len >= len(" in text:
        return ">="
    assert "logprob_start_len > len(req.origin_input_ids)" in text
    return ">"


@slow
def test_the_lowest_release_aborts_a_logprob_start_at_the_input_length():
    assert _abort_rule(source(LOWEST)) == ">="
    assert _abort_rule(source("0.5.7")) == ">"


# --- routes (actor.router_replay=R3, issue 44): the floor, and the rows the releases return ---------

def _route_uses(**drop):
    import dataclasses

    uses = [u for u in ENGINE_CONTRACTS["sglang"] if u.feature == "routed_experts"]
    return tuple(dataclasses.replace(u, **drop) for u in uses)


@slow
def test_the_routes_floor_is_the_first_release_whose_async_generate_asks_for_them():
    from polyrl.backends import capabilities

    floor = capabilities("sglang").minimum_version("routed_experts")
    assert floor == "0.5.9" and contract_gaps(source(floor), _route_uses(), floor) == []
    # 0.5.8 has the server flag and the synchronous generate's request flag, not async_generate's
    below = [u for u in _route_uses(versions="") if "arg_groups" not in u.target]
    assert contract_gaps(source("0.5.8"), tuple(below), "0.5.8") == [
        "sglang.srt.entrypoints.engine:Engine.async_generate: no keyword(s) return_routed_experts"]


def _release_function(path: Path, name: str):
    """Function `name` (a method too) of a release's module, compiled on its own, with the module's
    `pybase64` as the standard base64 (same output) and its annotations dropped."""
    import base64

    tree = ast.parse(path.read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    fn.decorator_list, fn.returns = [], None
    for arg in (*fn.args.args, *fn.args.kwonlyargs):
        arg.annotation = None
    namespace: dict = {"pybase64": base64}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), str(path), "exec"), namespace)
    return namespace[name], fn.args.args[0].arg == "self"


# release: (module of the row gather, the gather, module sizing the layer axis, detokenizer encoder)
ROUTE_SOURCES = {
    "0.5.9": ("sglang/srt/layers/moe/routed_experts_capturer.py", "[: seqlen - 1]",
              "sglang/srt/layers/moe/routed_experts_capturer.py", "_extract_routed_experts"),
    NEWEST: ("sglang/srt/state_capturer/base.py", "[start_len : seqlen - 1]",
             "sglang/srt/state_capturer/routed_experts.py", "_b64_encode_per_request"),
}


@slow
@pytest.mark.parametrize("version", sorted(ROUTE_SOURCES))
def test_the_releases_return_every_token_but_the_last_as_base64_int32(version):
    """What polyrl/rollout/engines/routed_experts.py decodes, read from the release: rows of the
    int32 host buffer for tokens [0, seqlen - 1) of every decoder layer, base64 of their bytes
    by the detokenizer's own code, which decodes back to the same rows."""
    import types

    import numpy as np
    import torch

    from polyrl.rollout.engines.routed_experts import RouteLayout, sglang_rows

    root = source(version)
    rows_file, gather, layers_file, encoder = ROUTE_SOURCES[version]
    capturer = (root / rows_file).read_text()
    assert gather in capturer and "dtype=torch.int32" in capturer
    assert "num_layers = model_config.hf_text_config.num_hidden_layers" in (root / layers_file).read_text() or \
        "self.num_hidden_layers = model_config.hf_text_config.num_hidden_layers" in capturer
    encode, method = _release_function(root / "sglang/srt/managers/detokenizer_manager.py", encoder)
    rows = torch.randint(0, 6, (7, 3, 2), dtype=torch.int32)
    if encoder == "_extract_routed_experts":  # 0.5.9: a method reading the batch's field
        (encoded,) = encode(None, types.SimpleNamespace(routed_experts=[rows]))
    else:
        (encoded,) = encode(None, [rows]) if method else encode([rows])
    decoded = sglang_rows({"routed_experts": encoded}, RouteLayout(3, (0, 2), 6, 2))
    assert np.array_equal(decoded, rows.numpy())
