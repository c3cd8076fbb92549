"""Colocated rollout (rollout.placement=colocated; `COLOCATED` in polyrl/distributed/topologies.py):
every policy rank hosts a rollout engine on its own device. Generation is split evenly over the ranks' engines; after each update a rank copies
its weights into its engine in place (weights/in_place.py), so nothing crosses a process."""

from __future__ import annotations

from polyrl.distributed.topologies import COLOCATED
from polyrl.topology.base import SyncTopology, plan, rendezvous, setup_all, start_policy
from polyrl.topology.worker_group import PolicyGroup


class ColocatedTopology(SyncTopology):
    spec = COLOCATED

    def start(self) -> None:
        self.launch = plan(self.ctx)
        self.policy = start_policy(self.ctx, self.launch)
        address = rendezvous(self.policy, self.cfg.actor.world_size > 1)
        setup_all(self.policy, self.policy.refs("setup", address, None), [])

    @property
    def engines(self) -> PolicyGroup:
        return self.policy

    def publish(self, bump: bool = True) -> dict[str, float]:
        stats = self.policy.call("sync_weights", bump, phase="weight sync")[0]
        # an in-place copy's duration is timing/sync_weights already; its byte rate says nothing
        return {"weight_sync/version": stats["weight_sync/version"]}

    def after_checkpoint_load(self) -> None:
        """Each rank's `load_checkpoint` already refreshed its own engine."""
