"""vLLM 0.33's new finish reasons reach polyrl's three stop reasons (issue 28, fix 5): before,
`map_stop_reason` raised ValueError on them and the whole rollout failed."""

import pytest

from polyrl.rollout.engines.common import map_stop_reason


@pytest.mark.parametrize("raw,mapped", [("repetition", "stop"), ("error", "aborted")])
def test_vllm_033_finish_reasons_map(raw, mapped):
    assert map_stop_reason(raw) == mapped
