"""Same-host data path for the broadcast transport: a shared-memory ring plus FIFO signals.

Gloo carries every byte through the kernel's TCP stack twice (send and receive copies), which
on one host caps weight sync far below memory bandwidth. NCCL avoids the same problem inside a
node with its shared-memory transport; this is the CPU equivalent.

    segment   /dev/shm/polyrl-weights-<id>: a header page (a random token), then either one
              slot as big as the whole stream (direct staging: the sender packs every byte
              once and receivers hand views of the segment to the engine, no copy of their
              own), or a ring of `slots` slots of `slot_bytes` that the stream passes through
              in slot-sized chunks (receivers copy each chunk out)
    down_i    FIFO sender -> receiver i: one byte per chunk ("chunk n is in slot n % slots"),
              an abort byte, or a framed message (the next transfer's manifest)
    up_i      FIFO receiver i -> sender: one byte per chunk copied out ("slot free again")

The sender writes chunk n once every receiver has acknowledged chunk n - slots, so in a ring it
packs chunk n+1 while receivers copy chunk n (the two copies overlap on two cores) and the ring
stays cache-sized whatever the model size. With direct staging a receiver first says it is
ready (it is inside receive()) and acknowledges the single chunk after the engine has loaded
it, so the segment only changes while every receiver is waiting for it. Signals are blocking reads with the transfer's
deadline (no spinning, no collective per chunk), and a FIFO whose other end closed reads as
end-of-file: a peer process that dies is noticed at once, not at the deadline.

Whether every receiver can open the ring is checked, not assumed (a same-named host in another
container or IPC namespace fails the token check). The sender unlinks every name once every
receiver has opened it: the memory lives exactly as long as some process maps it, and a crash
leaks nothing.
"""

from __future__ import annotations

import mmap
import os
import secrets
import select
import struct
import time
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096
TOKEN_BYTES = 16
CHUNK, ABORT, MESSAGE, FREE = b"C", b"A", b"M", b"F"
_LEN = struct.Struct("<Q")


class PeerLost(RuntimeError):
    """A ring peer did not answer: `timed_out` (deadline) or its end closed (the process exited).
    `peers` are receiver indices (the sender's side) or [-1] (the sender, seen by a receiver)."""

    def __init__(self, peers: list[int], timed_out: bool):
        self.peers, self.timed_out = peers, timed_out
        super().__init__("no answer before the deadline" if timed_out else
                         "closed its end of the shared-memory ring (the process exited)")


class ShmRing:
    """The segment, created (`name=None`, by the sender) or mapped by name (by a receiver).

    How a transfer uses it (`geometry`) is the sender's choice per transfer: `slots` slots of
    `slot_bytes`, or one slot holding the whole stream (direct staging)."""

    def __init__(self, capacity: int, receivers: int, name: str | None = None):
        self.capacity, self.receivers = capacity, receivers
        self.owner = name is None
        self.token = secrets.token_bytes(TOKEN_BYTES) if self.owner else b""
        if self.owner and not SHM_DIR.is_dir():
            raise OSError(f"{SHM_DIR} does not exist")
        self.name = name or f"polyrl-weights-{secrets.token_hex(8)}"
        self.nbytes = HEADER_BYTES + capacity
        self._map: mmap.mmap | None = None
        self._fds: list[int] = []
        try:
            self._map = self._open_segment()
        except BaseException:
            self.close()
            raise
        self._whole = torch.frombuffer(self._map, dtype=torch.uint8, count=self.nbytes)
        self.header = self._whole[:HEADER_BYTES]
        if self.owner:
            self.header[:TOKEN_BYTES].copy_(torch.frombuffer(bytearray(self.token), dtype=torch.uint8))
        self.slot: list[torch.Tensor] = []
        self.slots = self.slot_bytes = 0
        self.position = 0

    def geometry(self, slots: int, slot_bytes: int) -> None:
        """Cut the segment into `slots` slots of `slot_bytes` for the next transfer (the ring
        is idle between transfers, so each may choose)."""
        if slots < 1 or slots * slot_bytes > self.capacity:
            raise ValueError(f"{slots} slots of {slot_bytes} bytes do not fit {self.capacity}")
        self.slots, self.slot_bytes, self.position = slots, slot_bytes, 0
        self.slot = [self._whole[HEADER_BYTES + i * slot_bytes: HEADER_BYTES + (i + 1) * slot_bytes]
                     for i in range(slots)]

    def _open_segment(self) -> mmap.mmap:
        path = SHM_DIR / self.name
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if self.owner else 0), 0o600)
        try:
            if self.owner:  # reserve the pages now: a full tmpfs fails here, not with SIGBUS later
                os.posix_fallocate(fd, 0, self.nbytes)
            elif os.fstat(fd).st_size < self.nbytes:
                raise OSError(f"{path} is smaller than {self.nbytes} bytes")
            return mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)

    def fifo(self, kind: str, i: int) -> Path:
        return SHM_DIR / f"{self.name}-{kind}{i}"

    def names(self) -> list[Path]:
        return [SHM_DIR / self.name] + [self.fifo(k, i) for i in range(self.receivers) for k in "du"]

    def token_ok(self, token: bytes) -> bool:
        return bytes(self.header[:TOKEN_BYTES].numpy().tobytes()) == token

    def _open(self, path: Path, flags: int) -> int:
        fd = os.open(path, flags | os.O_NONBLOCK)
        self._fds.append(fd)
        return fd

    def unlink(self) -> None:
        """Remove the names; what is open stays valid (call once every receiver has opened it)."""
        if self.owner:
            for path in self.names():
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        self.unlink()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._whole = self.header = None  # drop the tensor views before unmapping
        self.slot = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps later
                pass
            self._map = None

    def __del__(self) -> None:
        if getattr(self, "_map", None) is not None or getattr(self, "_fds", None):
            self.close()


class SenderRing(ShmRing):
    """The sender's side: creates the ring, then `connect()` once every receiver opened it."""

    def __init__(self, capacity: int, receivers: int):
        super().__init__(capacity, receivers)
        self.down: list[int] = []
        self.up: list[int] = []
        self._placeholders: list[int] = []
        try:
            for i in range(receivers):
                os.mkfifo(self.fifo("d", i), 0o600)
                os.mkfifo(self.fifo("u", i), 0o600)
                # A reader of our own lets us open the write end now, so a receiver that opens
                # its read end never sees end-of-file before the sender is connected.
                self._placeholders.append(self._open(self.fifo("d", i), os.O_RDONLY))
                self.down.append(self._open(self.fifo("d", i), os.O_WRONLY))
                self.up.append(self._open(self.fifo("u", i), os.O_RDONLY))
        except BaseException:
            self.close()
            raise
        self.inflight = [0] * receivers
        """Chunks written that receiver i has not acknowledged yet (at most `slots`)."""

    def offer(self) -> dict:
        return {"name": self.name, "capacity": self.capacity, "receivers": self.receivers,
                "token": self.token}

    def connect(self) -> None:
        """Every receiver has the ring open: drop our placeholder readers and the names."""
        for fd in self._placeholders:
            self._fds.remove(fd)
            os.close(fd)
        self._placeholders = []
        self.unlink()

    def hold(self) -> None:
        """Direct staging: every receiver still holds the segment until it says `ready()` (it is
        then inside receive(), so nothing it serves from can change under it)."""
        self.inflight = [self.slots] * self.receivers

    def claim_slot(self, deadline: float) -> torch.Tensor:
        """The next slot, once every receiver has copied what it held."""
        for i in range(self.receivers):
            while self.inflight[i] >= self.slots:
                self._collect(i, deadline)
        return self.slot[self.position % self.slots]

    def publish(self, deadline: float, signal: bytes = CHUNK) -> None:
        """Chunk `position` is in its slot (CHUNK), or this transfer stops here (ABORT)."""
        for i in range(self.receivers):
            _write_all(self.down[i], signal, deadline, i)
        if signal == CHUNK:
            self.position += 1
            self.inflight = [n + 1 for n in self.inflight]

    def message(self, payload: bytes, deadline: float) -> None:
        framed = MESSAGE + _LEN.pack(len(payload)) + payload
        for i in range(self.receivers):
            _write_all(self.down[i], framed, deadline, i)

    def drain(self, deadline: float) -> None:
        """Wait until every receiver has copied every chunk (the ring is idle)."""
        for i in range(self.receivers):
            while self.inflight[i]:
                self._collect(i, deadline)

    def _collect(self, i: int, deadline: float) -> None:
        data = _read_some(self.up[i], 4096, deadline, i)
        if data.strip(FREE):
            raise RuntimeError(f"weight ring: receiver {i} sent {data[:16]!r}, not acknowledgements")
        self.inflight[i] -= len(data)


class ReceiverRing(ShmRing):
    """Receiver `index`'s side: maps the sender's ring by name and checks its token."""

    def __init__(self, offer: dict, index: int):
        super().__init__(offer["capacity"], offer["receivers"], name=offer["name"])
        if not self.token_ok(offer["token"]):
            self.close()
            raise OSError("the shared-memory ring holds another token (another host or namespace)")
        try:
            self.down = self._open(self.fifo("d", index), os.O_RDONLY)
            self.up = self._open(self.fifo("u", index), os.O_WRONLY)
        except BaseException:
            self.close()
            raise

    def next_signal(self, deadline: float) -> bytes:
        """CHUNK, ABORT or MESSAGE, waiting up to `deadline` (monotonic seconds)."""
        return _read_exact(self.down, 1, deadline)

    def read_message(self, deadline: float) -> bytes:
        (n,) = _LEN.unpack(_read_exact(self.down, _LEN.size, deadline))
        return _read_exact(self.down, n, deadline)

    def current_slot(self) -> torch.Tensor:
        return self.slot[self.position % self.slots]

    def ready(self, deadline: float) -> None:
        """Direct staging: this receiver is inside receive(); the sender may write the segment."""
        _write_all(self.up, FREE, deadline, -1)

    def release(self, deadline: float) -> None:
        """The current slot is copied out: tell the sender it may overwrite it."""
        self.position += 1
        _write_all(self.up, FREE, deadline, -1)


def attach(offer: dict, index: int) -> ReceiverRing | None:
    """The sender's ring if this process can open it (same host, same namespace), else None."""
    try:
        return ReceiverRing(offer, index)
    except (OSError, ValueError):
        return None


# --- FIFO reads and writes with a deadline ---------------------------------------------------------

def _wait(fd: int, event: int, deadline: float, peer: int) -> None:
    poller = select.poll()
    poller.register(fd, event)
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(max(int(left * 1000), 1)):
        raise PeerLost([peer], timed_out=True)


def _read_some(fd: int, n: int, deadline: float, peer: int) -> bytes:
    while True:
        try:
            data = os.read(fd, n)
        except BlockingIOError:  # nothing yet: sleep in poll() until there is, or the deadline
            _wait(fd, select.POLLIN, deadline, peer)
            continue
        if not data:
            raise PeerLost([peer], timed_out=False)
        return data


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    out = b""
    while len(out) < n:
        out += _read_some(fd, n - len(out), deadline, -1)
    return out


def _write_all(fd: int, data: bytes, deadline: float, peer: int) -> None:
    """Write all of `data`; a signal (one byte) always fits, a message may wait for room."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            _wait(fd, select.POLLOUT, deadline, peer)
        except BrokenPipeError:
            raise PeerLost([peer], timed_out=False) from None
