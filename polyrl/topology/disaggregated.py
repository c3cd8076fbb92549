"""Disaggregated synchronous rollout (rollout.placement=disaggregated, trainer.mode=sync;
`DISAGGREGATED` in polyrl/distributed/topologies.py): rollout replicas on their own actors and
devices. Trainer ranks and every replica rank share one
torch.distributed world (`RankLayout`); each new version travels from the weight-sync leader over
the run's transport (weights/broadcast.py; same host: shared memory) while every replica
receives, all under one deadline that names the missing. A replica of several ranks
(rollout.tensor_parallel_size > 1) generates on its leader, which hosts its one engine; every rank
receives each version and hands it to that engine through the leader (workers/rollout_worker.py)."""

from __future__ import annotations

import ray

from polyrl.distributed.topologies import DISAGGREGATED
from polyrl.distributed.waits import gather
from polyrl.rollout.launch_args import needs_first_sync
from polyrl.topology.base import SyncTopology, plan, rendezvous, setup_all, start_policy
from polyrl.topology.worker_group import WorkerGroup
from polyrl.weights.object_store import create_mailbox
from polyrl.workers.rollout_worker import RolloutWorker


class DisaggregatedTopology(SyncTopology):
    spec = DISAGGREGATED

    def start(self) -> None:
        cfg = self.cfg
        self.launch = plan(self.ctx)
        mailbox = create_mailbox() if cfg.weight_transport == "object_store" else None
        self.policy = start_policy(self.ctx, self.launch)
        planned = self.launch.of("rollout")
        cls = ray.remote(RolloutWorker)
        self.rollout = WorkerGroup([cls.options(**self.launch.options[a.name]).remote(cfg, a.plan)
                                    for a in planned], [a.name for a in planned], cfg.ray.timeout_s,
                                   helpers=[mailbox] if mailbox is not None else [])
        leaders = [i for i, a in enumerate(planned) if a.plan.hosts_engine]
        self.replicas = WorkerGroup([self.rollout.workers[i] for i in leaders],
                                    [self.rollout.names[i] for i in leaders], cfg.ray.timeout_s)
        address = rendezvous(self.policy, True)
        setup_all(self.policy, self.policy.refs("setup", address, mailbox)
                  + self.rollout.refs("setup", address, mailbox), self.rollout.names)
        if needs_first_sync(cfg.rollout, colocated=self.spec.colocated_engine):
            self.publish(bump=False)  # FP8 replicas start on dummy weights (R4): fill them first

    @property
    def engines(self) -> WorkerGroup:
        """The replica leaders (killed with `self.rollout`, which holds every rank)."""
        return self.replicas

    def publish(self, bump: bool = True) -> dict[str, float]:
        refs = self.policy.refs("sync_weights", bump) + self.rollout.refs("receive_weights")
        results = gather(refs, self.policy.names + self.rollout.names, phase="weight sync",
                         timeout_s=self.cfg.ray.timeout_s)
        return results[0]

    def shutdown(self) -> None:
        rollout, self.rollout = getattr(self, "rollout", None), None
        try:
            super().shutdown()
        finally:
            if rollout is not None:
                rollout.shutdown()
