"""The real-vLLM tier (`-m vllm`): one engine per module, on vLLM's CPU build when installed
(`scripts/vllm_tier.sh` makes its venv). Skipped with the reason when vLLM does not import."""

from __future__ import annotations

import pytest


def _vllm_import_error() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the tier cannot run
        return f"vllm is not importable here ({type(exc).__name__}: {exc}); run scripts/vllm_tier.sh"
    return None


@pytest.fixture(scope="session")
def vllm_available() -> None:
    reason = _vllm_import_error()
    if reason:
        pytest.skip(reason)
