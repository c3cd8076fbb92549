"""The shared-memory ring and its FIFO signals, both ends in one process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from polyrl.weights.shm import ABORT, CHUNK, MESSAGE, PeerLost, SenderRing, attach


def offer(ring: SenderRing, **change) -> dict:
    return ring.offer() | change


def pair(slots: int, slot_bytes: int):
    sender = SenderRing(capacity=slots * slot_bytes, receivers=1)
    receiver = attach(sender.offer(), 0)
    assert receiver is not None
    sender.geometry(slots, slot_bytes)
    receiver.geometry(slots, slot_bytes)
    return sender, receiver


def test_chunks_messages_and_backpressure_then_nothing_left_in_dev_shm():
    sender, receiver = pair(2, 128)
    sender.connect()
    assert not any(p.exists() for p in sender.names())  # unlinked once everyone has it open
    deadline = time.monotonic() + 5
    sender.message(b"manifest", deadline)
    assert receiver.next_signal(deadline) == MESSAGE and receiver.read_message(deadline) == b"manifest"
    for n in range(2):
        sender.claim_slot(deadline).fill_(n + 1)
        sender.publish(deadline)
    with pytest.raises(PeerLost) as full:  # both slots unread: a third chunk must wait
        sender.claim_slot(time.monotonic() + 0.05)
    assert full.value.timed_out and full.value.peers == [0]
    for n in range(2):
        assert receiver.next_signal(deadline) == CHUNK
        assert torch.all(receiver.current_slot() == n + 1)
        receiver.release(deadline)
    sender.claim_slot(deadline)
    sender.publish(deadline, ABORT)
    assert receiver.next_signal(deadline) == ABORT
    sender.drain(deadline)
    assert sender.inflight == [0]
    sender.close()
    with pytest.raises(PeerLost) as gone:  # the sender's end closed: seen at once, no deadline
        receiver.next_signal(time.monotonic() + 5)
    assert not gone.value.timed_out
    receiver.close()


def test_a_ring_with_another_token_or_name_is_not_attached():
    sender = SenderRing(capacity=128, receivers=1)
    assert attach(offer(sender, token=b"\0" * 16), 0) is None
    assert attach(offer(sender, name="polyrl-weights-missing"), 0) is None
    sender.close()
    assert not list(Path("/dev/shm").glob(f"{sender.name}*"))


def test_a_receiver_that_exits_is_seen_by_the_sender_at_once():
    sender, receiver = pair(2, 64)
    sender.connect()
    deadline = time.monotonic() + 5
    sender.claim_slot(deadline)
    sender.publish(deadline)
    receiver.close()
    with pytest.raises(PeerLost) as gone:
        sender.drain(deadline)
    assert not gone.value.timed_out and gone.value.peers == [0]
    sender.close()


def test_a_message_bigger_than_the_fifo_arrives_whole_while_the_receiver_reads():
    import threading

    sender, receiver = pair(2, 64)
    sender.connect()
    payload = bytes(range(256)) * 2000  # 512 KB, several times a pipe's capacity
    got = {}

    def read():
        deadline = time.monotonic() + 10
        got["signal"] = receiver.next_signal(deadline)
        got["payload"] = receiver.read_message(deadline)

    reader = threading.Thread(target=read)
    reader.start()
    sender.message(payload, time.monotonic() + 10)
    reader.join(10)
    assert got == {"signal": MESSAGE, "payload": payload}
    sender.close()
    receiver.close()


def test_a_geometry_that_does_not_fit_the_segment_is_refused():
    sender = SenderRing(capacity=256, receivers=1)
    sender.geometry(1, 256)  # direct staging: one slot, the whole segment
    with pytest.raises(ValueError, match="do not fit"):
        sender.geometry(3, 128)
    sender.close()
