"""How the driver shards a batch over the policy mesh (polyrl/topology/worker_group.py), on real
Ray actors that answer with what they were sent: one shard per data-parallel rank, the same
shard to the ranks of a sequence-parallel group, one answer per group gathered."""

from __future__ import annotations

import pytest
import torch

from engine_ranks import make_batch
from polyrl.batch import RolloutBatch
from polyrl.topology.worker_group import PolicyGroup
from polyrl.training.mesh import ParallelDims


@pytest.mark.slow  # a Ray start and four actors: ~1 min on the loaded 2-core machine
@pytest.mark.parametrize("dims", [ParallelDims(dp_shard=2, sp=2), ParallelDims(dp_replicate=4)],
                         ids=["dp2xsp2", "dp4"])
def test_a_batch_is_sharded_over_data_ranks_and_gathered_once_per_sequence_group(ray_session, dims):
    class EchoRank:  # defined here: Ray ships it by value to its workers
        """A policy rank's training calls, answering with the samples it was sent."""

        def __init__(self, rank: int):
            self.rank, self.seen = rank, []

        def logprobs(self, batch: RolloutBatch, which: str):
            self.seen.append(batch.group.tolist())
            return batch.response_ids.with_values(batch.response_ids.values.float())

        def update(self, batch: RolloutBatch, num_mini_batches: int, use_rollout_logprobs: bool) -> dict:
            self.seen.append(batch.group.tolist())
            return {"rank": self.rank}

        def received(self) -> list:
            return self.seen

    ray = ray_session
    workers = [ray.remote(num_cpus=0)(EchoRank).remote(r) for r in range(4)]
    group = PolicyGroup(workers, [f"policy-{r}" for r in range(4)], timeout_s=120, mesh=dims)
    batch = make_batch(1, n=7)
    batch = batch.replace(group=torch.arange(7))  # sample ids, to see who got what
    try:
        out = group.logprobs(batch, "reference")
        # every response token once, in batch order: no sp group's answer counted twice
        assert torch.equal(out.values, batch.response_ids.values.float())
        group.update(batch, 1, False)
        seen = ray.get([w.received.remote() for w in workers])
    finally:
        for w in workers:
            ray.kill(w)
    if dims.sp == 2:  # ranks 0, 1 share shard 0; ranks 2, 3 share shard 1
        assert seen[0] == seen[1] == [[0, 1, 2, 3]] * 2 and seen[2] == seen[3] == [[4, 5, 6]] * 2
    else:
        assert [s[0] for s in seen] == [[0, 1], [2, 3], [4, 5], [6]]


def test_a_mesh_that_does_not_match_the_ranks_is_refused():
    with pytest.raises(ValueError, match=r"the policy mesh \(4 ranks: dp_shard=2 x sp=2\) does not match its 2 ranks"):
        PolicyGroup([object(), object()], ["a", "b"], timeout_s=1, mesh=ParallelDims(dp_shard=2, sp=2))
