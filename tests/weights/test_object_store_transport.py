"""Ray object-store fallback: versions through a mailbox actor, all or nothing on the receiver."""

from __future__ import annotations


import pytest

from gloo_world import DictEngine, model_weights, same_weights
from polyrl.distributed.waits import RemoteTimeout
from polyrl.distributed.topologies import DISAGGREGATED
from polyrl.weights import WeightSyncConfig, WeightSyncError, build_transport
from polyrl.weights.object_store import create_mailbox

# generous: these tests check delivery, not deadlines (a loaded machine can take seconds to start an
# actor); the deadline tests below use their own short timeouts, once the mailbox is up
CONFIG = WeightSyncConfig(transport="object_store", bucket_mb=0.001, timeout_s=60)


def sender_actor(ray, mailbox):
    """A trainer stand-in in its own worker process (it owns the objects it puts), so it can
    die mid-send. Defined here so Ray pickles it by value (workers cannot import tests)."""

    @ray.remote(num_cpus=0)
    class Sender:
        def __init__(self, mailbox, config):
            from polyrl.distributed.topologies import DISAGGREGATED
            from polyrl.weights import build_transport

            self.transport = build_transport(config, DISAGGREGATED, mailbox=mailbox)

        def send(self, named_tensors, version: int):
            return self.transport.send(named_tensors, version)

        def send_and_die(self, named_tensors, version: int, at_bucket: int):
            import os

            import polyrl.weights.object_store as object_store

            real = object_store.iter_buckets

            def dying(*args, **kwargs):  # background snapshots and foreground puts both pack here
                for b, flat in real(*args, **kwargs):
                    if b == at_bucket:
                        os._exit(3)
                    yield b, flat

            object_store.iter_buckets = dying
            return self.transport.send(named_tensors, version)

    return Sender.remote(mailbox, CONFIG)


@pytest.fixture(scope="module")
def mailbox(ray_session):
    box = create_mailbox()
    ray_session.get(box.latest_version.remote())  # started, so no test's deadline pays the start-up
    yield box
    ray_session.kill(box)


# These tests share one mailbox, so versions keep increasing: 1, 2, 3, 4, then 5 (never published).


def test_versions_arrive_and_report_stats(mailbox):
    sender = build_transport(CONFIG, DISAGGREGATED, mailbox=mailbox)  # the driver owns the objects
    receiver = build_transport(CONFIG, DISAGGREGATED, mailbox=mailbox)
    engine = DictEngine(model_weights(seed=0))
    stats = sender.send(model_weights(seed=1), 1)
    assert receiver.receive(engine) == 1 and same_weights(engine.weights, model_weights(seed=1))
    assert stats.transport == "object_store" and stats.num_buckets > 3 and stats.bytes_per_s > 0
    sender.send(model_weights(seed=2), 2)
    assert receiver.receive(engine) == 2 and same_weights(engine.weights, model_weights(seed=2))
    assert receiver.last_stats.version == 2


def ray_session_latest(mailbox) -> int:
    import ray

    return ray.get(mailbox.latest_version.remote())


def test_background_publish_snapshots_at_send_and_raises_at_the_next_send(mailbox):
    """send() returns before the version is published; what it publishes is the weights as they
    were at send(), even if the trainer changes them right after; a failed publication raises
    at the next send() / flush(), and the mailbox keeps the last good version."""
    import threading

    sender = build_transport(CONFIG, DISAGGREGATED, mailbox=mailbox)
    assert sender.config.background_publish
    stepped = threading.Event()
    publish = sender._put_and_publish

    def after_the_step(*args):  # the put runs only once the trainer has changed its weights
        assert stepped.wait(10)
        publish(*args)

    sender._put_and_publish = after_the_step
    weights = model_weights(seed=5)
    expected = {k: v.clone() for k, v in weights.items()}
    sender.send(weights, 3)
    assert ray_session_latest(mailbox) == 2  # not yet published
    for tensor in weights.values():  # the trainer's next step, while the publication waits
        tensor.add_(1)
    stepped.set()
    receiver = build_transport(CONFIG, DISAGGREGATED, mailbox=mailbox)
    engine = DictEngine(model_weights(seed=2), version=2)
    assert receiver.receive(engine) == 3 and same_weights(engine.weights, expected)
    sender.flush()
    assert sender.publish_s > 0
    sender.send(model_weights(seed=6), 3)  # not newer than 3: the mailbox refuses it...
    with pytest.raises(Exception, match="not newer than the published 3"):
        sender.flush()  # ...and the refusal reaches the sender
    sender.close()
    assert ray_session_latest(mailbox) == 3  # the refused version never replaced the good one


def test_a_publication_to_a_dead_mailbox_fails_at_flush(ray_session):
    box = create_mailbox()
    sender = build_transport(CONFIG, DISAGGREGATED, mailbox=box)
    sender.send(model_weights(seed=1), 1)
    sender.flush()
    ray_session.kill(box)
    sender.send(model_weights(seed=2), 2)  # returns: the snapshot is taken
    with pytest.raises(Exception, match="(?i)actor|died|mailbox"):
        sender.close()  # the publication's error, and the thread is stopped anyway
    assert sender._publisher is None


def test_foreground_publish_is_done_when_send_returns(ray_session, mailbox):
    config = WeightSyncConfig(transport="object_store", bucket_mb=0.001, timeout_s=60, background_publish=False)
    sender = build_transport(config, DISAGGREGATED, mailbox=mailbox)
    sender.send(model_weights(seed=7), 4)
    assert ray_session_latest(mailbox) == 4
    receiver = build_transport(config, DISAGGREGATED, mailbox=mailbox)
    engine = DictEngine(model_weights(seed=2), version=3)
    assert receiver.receive(engine) == 4 and same_weights(engine.weights, model_weights(seed=7))


def test_nothing_new_published_times_out_naming_the_sender(mailbox):
    config = WeightSyncConfig(transport="object_store", timeout_s=0.5)
    receiver = build_transport(config, DISAGGREGATED, mailbox=mailbox)
    engine = DictEngine(model_weights(seed=2), version=4)
    with pytest.raises(RemoteTimeout, match="weight sender"):
        receiver.receive(engine)
    assert engine.weight_version == 4


def test_sender_dying_midway_keeps_the_previous_version(ray_session, mailbox):
    ray = ray_session
    doomed = sender_actor(ray, mailbox)
    with pytest.raises(ray.exceptions.RayActorError):  # dies while packing bucket 1 of v5
        ray.get(doomed.send_and_die.remote(model_weights(seed=3), 5, 1), timeout=30)
    config = WeightSyncConfig(transport="object_store", timeout_s=1)
    receiver = build_transport(config, DISAGGREGATED, mailbox=mailbox)
    engine = DictEngine(model_weights(seed=2), version=4)
    with pytest.raises(RemoteTimeout, match="weight sender"):
        receiver.receive(engine)
    assert engine.weight_version == 4 and same_weights(engine.weights, model_weights(seed=2))


def test_lost_buckets_are_not_applied(monkeypatch):
    """Published but unfetchable (its owner died): nothing is applied."""
    import polyrl.weights.object_store as object_store
    from polyrl.weights.base import as_stream
    from polyrl.weights.bucketing import plan_buckets

    manifest = plan_buckets(as_stream(model_weights(seed=3)).specs, 3, 256)
    answers = iter([[(3, manifest, ["ref"] * len(manifest.buckets))]])

    def fake_gather(refs, names, *, phase, timeout_s):
        if "fetch" in phase:
            raise RuntimeError("OwnerDiedError: the owner of bucket 1 died")
        return next(answers)

    monkeypatch.setattr(object_store, "gather", fake_gather)
    mailbox = type("Mailbox", (), {"fetch": type("M", (), {"remote": lambda self, *a: None})()})()
    receiver = object_store.ObjectStoreTransport(CONFIG, mailbox=mailbox)
    engine = DictEngine(model_weights(seed=2), version=2)
    with pytest.raises(WeightSyncError, match="version 3 could not be fetched"):
        receiver.receive(engine)
    assert engine.weight_version == 2 and engine.calls == 0
