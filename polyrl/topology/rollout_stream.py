"""The driver's side of asynchronous RL: keep the replicas busy, stream finished groups into a
bounded queue, hand the trainer a batch when one is ready, never exceed the staleness bound.

One thread, one event loop (`pump`): dispatch prompt groups to replicas (Ray calls), collect
whichever finish (`ray.wait`), score them, queue them. The trainer's own remote calls (update,
log-probs, checkpoint) are waited on through `gather`, which pumps meanwhile, so generation
continues while the policy trains.

Staleness. The trainer at version v has consumed `consumed` groups; a group started now on a
replica serving version w is the (consumed + outstanding)-th group and will be trained at version
floor(index / B) at the earliest, so it may start only if

    consumed + outstanding < (w + max_staleness + 1) * B          (B = data.train_batch_size)

At consume time every sample's staleness (trainer version - oldest version of its tokens) is
checked again; a group over the bound (out-of-order finishing, a resume) is discarded, counted,
and its prompt regenerated, so every prompt drawn from the data is trained exactly once.

Faults. A replica that dies (any Ray actor error) has its groups put back at the front of the
queue (each retried at most async.max_retries times) and is replaced by a new actor, which loads
the newest published weights before it takes work. Results are keyed by group id, so a group is
queued at most once. Validation (`generate_sharded`) survives a dying replica the same way: its
shard is run again on a live replica.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError

from polyrl.distributed.waits import RemoteTimeout, gather
from polyrl.batch import RolloutBatch, split_evenly
from polyrl.rollout.base import SamplingParams
from polyrl.job import JobConfig

logger = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    pass


@dataclass
class Group:
    gid: int
    prompt: Any  # PromptSample
    seed: int
    attempts: int = 0
    samples: RolloutBatch | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        return int(self.samples.min_version.min())


@dataclass
class Call:
    replica: int
    groups: list[Group]
    started: float


class RolloutStream:
    def __init__(self, cfg: JobConfig, pool: Any, loader: Any, score: Callable[[RolloutBatch], dict],
                 sampling: SamplingParams):
        self.cfg, self.pool, self.loader, self.score = cfg, pool, loader, score
        self.a = cfg.async_
        self.B = cfg.data.train_batch_size
        self.sampling = sampling
        self.inflight_cap = self.a.max_inflight_per_replica or self.B
        self.pending: deque[Group] = deque()
        self.ready: dict[int, Group] = {}
        self.calls: dict[Any, Call] = {}
        self.receives: dict[Any, int] = {}  # ref -> replica
        self.starting: dict[Any, int] = {}  # setup ref -> replica
        self.next_gid = 0
        self.consumed = 0
        self.version = 0  # the trainer's (newest published) policy version
        self.totals = dict(discarded_stale=0, retried_groups=0, replica_restarts=0, partial_rollouts=0,
                           dropped_uninformative=0)
        self.dropped_for_batch = 0
        """Groups dynamic sampling dropped since the last batch was taken."""
        n = len(pool.workers)
        self.load = [0] * n  # groups in flight per replica
        self.idle_since: list[float | None] = [time.perf_counter()] * n
        self.idle_s = [0.0] * n
        self.trainer_idle_s = 0.0
        self.side_calls: dict[Any, tuple[int, int, Any]] = {}
        """generate_sharded's calls in flight: ref -> (shard, replica, actor)."""
        self.closed = False

    def close(self) -> None:
        """Dispatch nothing more (the run is ending; replicas are about to be shut down)."""
        self.closed = True

    # --- weights -------------------------------------------------------------------------------
    def published(self, version: int) -> None:
        """The trainer published `version`: every live replica behind it fetches it."""
        self.version = version
        busy = set(self.receives.values()) | set(self.starting.values())
        for i, w in enumerate(self.pool.workers):
            if i not in busy and 0 <= self.pool.versions[i] < version:
                self.receives[w.receive_weights.remote()] = i

    def wait_replicas_current(self, phase: str = "validation") -> None:
        """Block (pumping) until every replica serves the trainer's version."""
        deadline = time.perf_counter() + self.cfg.ray.timeout_s

        def lagging() -> list[str]:  # a dead replica that is not being replaced does not count
            restarting = set(self.starting.values())
            return [self.pool.names[i] for i, v in enumerate(self.pool.versions)
                    if v != self.version and (v >= 0 or i in restarting)]

        while lagging():
            if time.perf_counter() > deadline:
                raise RemoteTimeout(f"{phase}: replicas reaching weight version {self.version}",
                                    lagging(), self.cfg.ray.timeout_s)
            self.pump(0.05)

    # --- generation outside the stream (validation) ----------------------------------------------
    def generate_sharded(self, prompts: list[Any], sampling: SamplingParams, seeds: list[int] | None,
                         phase: str = "validation") -> RolloutBatch:
        """`WorkerGroup.generate` for the replicas (data rows in), surviving a replica that dies: the rows are
        split over the replicas serving the trainer's version; a shard whose replica dies goes
        back in the queue for a live one (at most async.max_retries times) and the replica is
        replaced, as during training. Training generation is pumped meanwhile. Samples come
        back in prompt order, `group` = the prompt's index."""
        chunks = [c for c in split_evenly(list(range(len(prompts))), max(len(self.pool.workers), 1)) if c]
        todo: deque[int] = deque(range(len(chunks)))
        attempts = [0] * len(chunks)
        results: dict[int, RolloutBatch] = {}
        self.side_calls: dict[Any, tuple[int, int, Any]] = {}  # ref -> (chunk, replica, actor)
        deadline = time.perf_counter() + self.cfg.ray.timeout_s
        while todo or self.side_calls:
            busy = {i for _, i, _ in self.side_calls.values()} | set(self.starting.values())
            for i, w in enumerate(self.pool.workers):
                if todo and i not in busy and self.pool.versions[i] == self.version:
                    c = todo.popleft()
                    attempts[c] += 1
                    ref = w.generate.remote([prompts[j] for j in chunks[c]], sampling,
                                            [seeds[j] for j in chunks[c]] if seeds else None, chunks[c][0])
                    self.side_calls[ref] = (c, i, w)
            done, _ = ray.wait(list(self.side_calls), num_returns=len(self.side_calls), timeout=0)
            if not done:
                if time.perf_counter() > deadline:
                    names = sorted({self.pool.names[i] for _, i, _ in self.side_calls.values()}) or ["every replica"]
                    raise RemoteTimeout(phase, names, self.cfg.ray.timeout_s)
                self.pump(0.05, extra=list(self.side_calls))
                continue
            for ref in done:
                c, i, actor = self.side_calls.pop(ref)
                try:
                    results[c] = ray.get(ref)
                except RayActorError:
                    if attempts[c] > self.a.max_retries:
                        raise GenerationFailed(f"{phase}: prompts {chunks[c][0]}-{chunks[c][-1]} failed "
                                               f"{attempts[c]} times (their replicas died); raise "
                                               "async.max_retries or check the replicas' logs") from None
                    todo.append(c)
                    if self.pool.workers[i] is actor:  # not yet replaced by a training call's failure
                        self._replica_died(i, [])
        return RolloutBatch.cat([results[c] for c in range(len(chunks))])

    # --- the event loop ------------------------------------------------------------------------
    def gather(self, refs: Sequence[Any], names: Sequence[str], *, phase: str, timeout_s: float) -> list:
        """`ray.get(refs)` with a deadline, generating meanwhile (WorkerGroup's waiter)."""
        if self.closed:  # the run is ending: nothing to pump, plain waits
            return gather(refs, names, phase=phase, timeout_s=timeout_s)
        refs = list(refs)
        deadline = time.perf_counter() + timeout_s
        while True:
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            if not pending:
                return ray.get(refs)
            if time.perf_counter() > deadline:
                missing = [n for r, n in zip(refs, names) if r in set(pending)]
                raise RemoteTimeout(phase, missing, timeout_s)
            self.pump(0.05, extra=pending)

    def pump(self, timeout: float, extra: Sequence[Any] = ()) -> None:
        """Dispatch what may start, then wait up to `timeout` for anything to finish."""
        self._dispatch()
        watched = list(self.calls) + list(self.receives) + list(self.starting)
        if not watched:
            if extra:
                ray.wait(list(extra), num_returns=1, timeout=timeout)
            else:
                time.sleep(min(timeout, 0.01))
            return
        done, _ = ray.wait(watched + list(extra), num_returns=1, timeout=timeout)
        if done:  # take everything else that is finished too
            done, _ = ray.wait(watched, num_returns=len(watched), timeout=0)
        for ref in done:
            if self.closed:
                break
            if ref in self.calls:
                self._collect(ref)
            elif ref in self.receives:
                self._received(ref)
            elif ref in self.starting:
                self._started(ref)
        self._check_deadlines()
        self._dispatch()

    # --- dispatch ------------------------------------------------------------------------------
    def _outstanding(self) -> int:
        return len(self.ready) + sum(len(c.groups) for c in self.calls.values())

    def _budget(self, replica: int) -> int:
        """Groups that may still start on `replica` without breaking the staleness bound."""
        w = self.pool.versions[replica]
        limit = (w + self.a.max_staleness + 1) * self.B - self.consumed - self._outstanding()
        if self.a.queue_size is not None:
            limit = min(limit, self.a.queue_size - len(self.ready))
        return limit

    def _dispatch(self) -> None:
        while not self.closed:
            busy = set(self.starting.values())
            free = [i for i in range(len(self.pool.workers))
                    if i not in busy and self.pool.versions[i] >= 0 and self.load[i] < self.inflight_cap]
            if not free:
                return
            i = min(free, key=lambda r: self.load[r])
            take = min(self.a.groups_per_request, self.inflight_cap - self.load[i], self._budget(i))
            if take <= 0:
                return
            while len(self.pending) < take:
                self._draw()
            groups = [self.pending.popleft() for _ in range(take)]
            for g in groups:
                g.attempts += 1
            ref = self.pool.workers[i].generate_groups.remote(
                [g.gid for g in groups], [g.prompt for g in groups], self.sampling, [g.seed for g in groups])
            self.calls[ref] = Call(i, groups, time.perf_counter())
            self._set_load(i, self.load[i] + take)

    def _draw(self) -> None:
        seed = self.cfg.trainer.seed
        for p in self.loader.next_batch():
            # one seed per (run, group, prompt): a group draws the same samples wherever it runs
            self.pending.append(Group(self.next_gid, p, hash((seed, self.next_gid, p.index)) % (2**31)))
            self.next_gid += 1

    def _set_load(self, replica: int, load: int) -> None:
        now = time.perf_counter()
        if self.load[replica] == 0 and load > 0 and self.idle_since[replica] is not None:
            self.idle_s[replica] += now - self.idle_since[replica]
            self.idle_since[replica] = None
        elif load == 0 and self.load[replica] > 0:
            self.idle_since[replica] = now
        self.load[replica] = load

    # --- results -------------------------------------------------------------------------------
    def _collect(self, ref: Any) -> None:
        call = self.calls.pop(ref)
        self._set_load(call.replica, self.load[call.replica] - len(call.groups))
        try:
            results: dict[int, RolloutBatch] = ray.get(ref)
        except RayActorError:
            self._replica_died(call.replica, call.groups)
            return
        except Exception as exc:
            raise GenerationFailed(f"{self.pool.names[call.replica]} failed on groups "
                                   f"{[g.gid for g in call.groups]}: {exc}") from exc
        for g in call.groups:
            if g.gid in self.ready:  # cannot happen: each dispatch of a gid returns at most once
                raise GenerationFailed(f"group {g.gid} arrived twice")
            g.samples = results[g.gid]
            g.samples.prompts = [g.prompt] * len(g.samples)
            g.metrics = self.score(g.samples)
            if self._uninformative(g):
                continue  # dropped, and its place in the batch goes to a group drawn later
            self.ready[g.gid] = g

    def _uninformative(self, g: Group) -> bool:
        """Dynamic sampling (DAPO): drop a group whose rewards are all equal, up to
        (max_sampling_rounds - 1) x B groups per batch, the same bound sync training has."""
        algo = self.cfg.algorithm
        if not algo.dynamic_sampling or self.dropped_for_batch >= (algo.max_sampling_rounds - 1) * self.B:
            return False
        rewards = g.samples.rewards
        if bool((rewards != rewards[0]).any()):
            return False
        self.dropped_for_batch += 1
        self.totals["dropped_uninformative"] += 1
        return True

    def _received(self, ref: Any) -> None:
        self._now_serving(self.receives.pop(ref), ref)

    def _started(self, ref: Any) -> None:
        i = self.starting.pop(ref)
        if self._now_serving(i, ref):
            self.idle_since[i] = time.perf_counter()

    def _now_serving(self, i: int, ref: Any) -> bool:
        """Replica `i` answered `ref` with the version it now serves; it fetches again if a newer
        one came out meanwhile. False: it died (and is being replaced)."""
        try:
            self.pool.versions[i] = ray.get(ref)
        except RayActorError:
            self._replica_died(i, [])
            return False
        if self.pool.versions[i] < self.version:
            self.receives[self.pool.workers[i].receive_weights.remote()] = i
        return True

    def _replica_died(self, i: int, groups: list[Group]) -> None:
        for g in groups:
            if g.attempts > self.a.max_retries:
                raise GenerationFailed(f"group {g.gid} failed {g.attempts} times (its replicas died); "
                                       "raise async.max_retries or check the replicas' logs")
        self.totals["retried_groups"] += len(groups)
        self.pending.extendleft(reversed(groups))
        # forget the dead actor's other calls: their refs will fail too and must not restart it twice
        for ref, call in list(self.calls.items()):
            if call.replica == i:
                self.calls.pop(ref)
                self._set_load(i, self.load[i] - len(call.groups))
                self.totals["retried_groups"] += len(call.groups)
                self.pending.extendleft(reversed(call.groups))
        for ref, r in list(self.receives.items()):
            if r == i:
                self.receives.pop(ref)
        for ref, r in list(self.starting.items()):
            if r == i:
                self.starting.pop(ref)
        if not self.a.restart_replicas:
            self.pool.versions[i] = -1
            if all(v < 0 for v in self.pool.versions):
                raise GenerationFailed("every rollout replica is dead (async.restart_replicas=false)")
            return
        self.totals["replica_restarts"] += 1
        self.starting[self.pool.restart(i)] = i

    def _check_deadlines(self) -> None:
        now, limit = time.perf_counter(), self.cfg.ray.timeout_s
        late = sorted({self.pool.names[c.replica] for c in self.calls.values() if now - c.started > limit})
        if late:
            raise RemoteTimeout("async generation", late, limit)

    # --- the trainer's side --------------------------------------------------------------------
    def take_batch(self) -> tuple[list[Group], dict[str, float]]:
        """The next B groups (oldest policy first), waiting (pumping) until they are ready."""
        t0 = time.perf_counter()
        discarded = 0
        while True:
            for g in sorted(self.ready.values(), key=lambda g: (g.min_version, g.gid)):
                if self.version - g.min_version > self.a.max_staleness:
                    del self.ready[g.gid]
                    g.samples, g.metrics = None, {}
                    self.pending.appendleft(g)  # regenerate with fresh weights
                    discarded += 1
            if len(self.ready) >= self.B:
                break
            self.pump(0.05)
        waited = time.perf_counter() - t0
        self.trainer_idle_s += waited
        depth = len(self.ready)
        chosen = sorted(self.ready.values(), key=lambda g: (g.min_version, g.gid))[: self.B]
        for g in chosen:
            del self.ready[g.gid]
        self.consumed += len(chosen)
        self.dropped_for_batch = 0
        self.totals["discarded_stale"] += discarded
        return chosen, self._metrics(chosen, waited, depth, discarded)

    def _metrics(self, groups: list[Group], waited: float, depth: int, discarded: int) -> dict[str, float]:
        batch = RolloutBatch.cat([g.samples for g in groups])
        stale = (self.version - batch.min_version).numpy()
        partial = int((batch.continuations > 0).sum())
        self.totals["partial_rollouts"] += partial
        now = time.perf_counter()
        idle = [t + (now - s if s is not None else 0.0) for t, s in zip(self.idle_s, self.idle_since)]
        self.idle_s = [0.0] * len(idle)
        self.idle_since = [now if s is not None else None for s in self.idle_since]
        out = {
            "async/staleness_mean": float(stale.mean()),
            "async/staleness_max": float(stale.max()),
            **{f"async/staleness_{k}": float((stale == k).mean()) for k in range(self.a.max_staleness + 1)},
            "async/version_spread_mean": float((batch.max_version - batch.min_version).float().mean()),
            "async/queue_depth": float(depth),
            "async/inflight_groups": float(sum(self.load)),
            "async/trainer_idle_s": waited,
            "async/rollout_idle_s": float(np.mean(idle)),
            "async/partial_rollouts": float(partial),
            "async/discarded_stale": float(discarded),
            "async/replica_version_min": float(min(self.pool.versions)),
        }
        out.update({f"async/{k}_total": float(v) for k, v in self.totals.items()})
        for key in ("reward/errors", "reward/timeouts"):
            out[key] = float(sum(g.metrics.get(key, 0.0) for g in groups))
        return out

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every drawn but untrained prompt: finished groups with their samples, the rest (in
        flight or queued) as prompts to generate again after a resume."""
        unstarted = [g for c in self.calls.values() for g in c.groups] + list(self.pending)
        strip = lambda g: Group(g.gid, g.prompt, g.seed)
        return {"next_gid": self.next_gid, "consumed": self.consumed, "totals": dict(self.totals),
                "ready": [Group(g.gid, g.prompt, g.seed, 0, g.samples, g.metrics) for g in self.ready.values()],
                "pending": sorted((strip(g) for g in unstarted), key=lambda g: g.gid)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_gid, self.consumed = state["next_gid"], state["consumed"]
        self.totals.update(state["totals"])
        self.ready = {g.gid: g for g in state["ready"]}
        self.pending = deque(state["pending"])
