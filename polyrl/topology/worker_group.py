"""The run's Ray actors as groups (policy ranks; disaggregated rollout replicas): fan calls out,
gather answers with a deadline that names any actor that does not answer. With ray.enabled=false
the group's one worker is a `LocalActor` (polyrl/topology/in_process.py), called in this process
through the same surface."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from polyrl.batch import Ragged, RolloutBatch, shard, split_evenly
from polyrl.distributed.waits import gather
from polyrl.rollout.base import SamplingParams
from polyrl.topology.in_process import is_local
from polyrl.training.mesh import ParallelDims

Waiter = Callable[..., list]
"""`waiter(refs, names, phase=..., timeout_s=...) -> results`: how a group awaits its answers."""


class WorkerGroup:
    """Ray actors of one kind (or one in-process worker), called together, answers gathered with
    a deadline."""

    def __init__(self, workers: list, names: list[str], timeout_s: float, waiter: Waiter = gather,
                 helpers: Sequence[Any] = ()):
        self.workers, self.names, self.timeout_s = workers, names, timeout_s
        self.waiter = waiter
        """How answers are awaited: `gather`, or (streaming topology) one that keeps the rollout
        replicas generating while the policy works."""
        self.helpers = list(helpers)
        """Other actors of this group (a weight mailbox), killed with it."""

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _get(self, refs, phase: str) -> list:
        return self.waiter(refs, self.names, phase=phase, timeout_s=self.timeout_s)

    def refs(self, method: str, *args, **kwargs) -> list:
        """Start the same call on every actor; the caller gathers the refs."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def call(self, method: str, *args, phase: str, **kwargs) -> list:
        """The same call on every rank."""
        return self._get(self.refs(method, *args, **kwargs), phase)

    def call_sharded(self, method: str, shards: Sequence[tuple], phase: str, **kwargs) -> list:
        """Rank i gets `*shards[i]`."""
        refs = [getattr(w, method).remote(*a, **kwargs) for w, a in zip(self.workers, shards)]
        return self._get(refs, phase)

    def generate(self, prompts: list[Any], sampling: SamplingParams, seeds: list[int] | None,
                 phase: str = "generate") -> RolloutBatch:
        """Data rows (`PromptSample`) split evenly over the ranks' engines; samples come back in
        row order."""
        shards = []
        for chunk in split_evenly(list(range(len(prompts))), self.world_size):
            offset = chunk[0] if chunk else 0
            shards.append(([prompts[i] for i in chunk], sampling,
                           [seeds[i] for i in chunk] if seeds else None, offset))
        return RolloutBatch.cat([b for b in self.call_sharded("generate", shards, phase=phase) if len(b)])

    def shutdown(self) -> None:
        try:
            self.call("shutdown", phase="shutdown")
        finally:
            remote = [w for w in self.workers + self.helpers if not is_local(w)]
            if remote:  # in-process workers have no process to end
                import ray

                for w in remote:
                    ray.kill(w)


class PolicyGroup(WorkerGroup):
    """The policy ranks. Training calls shard the batch over the mesh's data-parallel ranks
    (polyrl/training/mesh.py): the ranks of one sequence-parallel group get the same shard, split
    its rows' tokens among themselves and answer with the same gathered result, of which one is
    kept."""

    num_params: int = 0

    def __init__(self, workers: list, names: list[str], timeout_s: float, waiter: Waiter = gather,
                 helpers: Sequence[Any] = (), *, mesh: ParallelDims):
        super().__init__(workers, names, timeout_s, waiter, helpers)
        self.mesh = mesh
        """The ranks' layout, the run plan's (polyrl/topology/run_plan.py): never guessed here."""
        if self.mesh.world_size != len(workers):
            raise ValueError(f"the policy mesh ({self.mesh.describe()}) does not match its {len(workers)} ranks")

    def _per_rank(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """Each rank's shard of `batch`: its data-parallel rank's contiguous share."""
        parts = shard(batch.for_training(), self.mesh.data_parallel_size)
        return [parts[self.mesh.data_rank(r)] for r in range(self.world_size)]

    def _one_per_shard(self, answers: list) -> list:
        """The answers of the first rank of each shard's sequence- and tensor-parallel groups, in shard order."""
        return [a for r, a in enumerate(answers) if self.mesh.first_of_shard(r)]

    def logprobs(self, batch: RolloutBatch, which: str) -> Ragged:
        shards = [(part, which) for part in self._per_rank(batch)]
        return Ragged.cat(self._one_per_shard(self.call_sharded("logprobs", shards, phase=f"{which} log-probs")))

    def values(self, batch: RolloutBatch) -> Ragged:
        shards = [(part,) for part in self._per_rank(batch)]
        return Ragged.cat(self._one_per_shard(self.call_sharded("values", shards, phase="critic values")))

    def update(self, batch: RolloutBatch, num_mini_batches: int, use_rollout_logprobs: bool) -> dict:
        shards = [(part, num_mini_batches, use_rollout_logprobs) for part in self._per_rank(batch)]
        per_rank = self.call_sharded("update", shards, phase="update")
        return per_rank[0]  # metrics are global (all-reduced) quantities or rank-0 timings
