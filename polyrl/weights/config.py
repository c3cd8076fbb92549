"""Weight sync configuration: which transport carries new weights to the rollout engines."""

from __future__ import annotations

from pydantic import Field, field_validator

from polyrl.config import Config


class WeightSyncConfig(Config):
    transport: str = "auto"
    """How weights reach the engines (a mechanism; where the engine lives is rollout.placement,
    docs/architecture.md "Vocabulary"). in_place: colocated placement (its only choice): each
    policy rank hands its weights to its own colocated engine in one engine.update_weights call,
    which copies them into the engine's layout all or nothing; nothing crosses a process.
    broadcast: disaggregated, sync mode: bucketed from the trainer's weight-sync leader to every
    rollout rank, through shared memory when all are on one host (see shared_memory), else over
    the platform's communication backend. object_store: disaggregated through Ray's object store
    and a mailbox actor (required with trainer.mode=async, where a replacement replica must fetch
    the current version). auto: in_place when colocated, broadcast when disaggregated,
    object_store in async mode."""
    bucket_mb: float = Field(64, gt=0)
    """Bucket size in MB: tensors are packed into flat buffers up to this size, one collective
    (or object) per bucket. The sender holds two buckets of scratch memory; bigger buckets mean
    fewer, larger messages."""
    shared_memory: bool = True
    """broadcast only: when every rank of the sync group can map the sender's shared memory (one
    host, CPU tensors; checked at the first transfer), stream the bucket bytes through a ring in
    /dev/shm with FIFO signals and no collective per transfer after the first. Off: every byte
    goes through the backend."""
    shm_direct: bool = True
    """Shared-memory path: stage the whole version in one segment that receivers hand to the
    engine without a copy of their own (one copy in total; receivers release it once the engine
    has loaded it). Needs /dev/shm room for one copy of the weights (reserved up front); when
    off or when it does not fit, the stream goes through a ring of shm_slots x shm_slot_mb and
    each receiver copies it out into its own staging buffer."""
    shm_slot_mb: float = Field(4, gt=0)
    """Shared-memory path: ring slot size in MB (the chunk the sender packs while receivers
    copy the previous one). Small enough to stay in the CPU's last-level cache; independent of
    bucket_mb."""
    shm_slots: int = Field(3, ge=2)
    """Shared-memory path: ring slots (the sender may run this many chunks ahead of the
    slowest receiver)."""
    background_publish: bool = True
    """object_store with trainer.mode=async: send() snapshots the version into host buffers and
    returns; putting them in the object store and publishing them to the mailbox run on a
    background thread, overlapping the trainer's next step (an error surfaces at the next sync).
    Costs one host copy of the weights, kept between versions. Off (and always in sync mode,
    where the replicas wait for each version at once): send() returns once the version is
    published, through one bucket of scratch."""
    timeout_s: float = Field(300, gt=0)
    """Deadline for one transfer (every wait inside it); on expiry the error names the ranks or
    replicas that did not arrive and the receivers keep serving the previous weights."""

    @field_validator("transport")
    @classmethod
    def _known(cls, value: str) -> str:
        from polyrl.weights.base import WEIGHT_TRANSPORTS

        if value != "auto" and value not in WEIGHT_TRANSPORTS:
            raise ValueError(f"unknown weight transport '{value}'; valid choices: auto, "
                             f"{', '.join(WEIGHT_TRANSPORTS.names())}")
        return value

    @property
    def bucket_bytes(self) -> int:
        return max(int(self.bucket_mb * (1 << 20)), 1)

    @property
    def shm_slot_bytes(self) -> int:
        return -(-max(int(self.shm_slot_mb * (1 << 20)), 1) // 64) * 64  # whole cache lines
