"""Same-host data path for the broadcast transport: bucket bytes through shared memory.

Gloo carries every byte through the kernel's TCP stack twice (send and receive copies), which
on one host caps weight sync far below memory bandwidth. NCCL avoids the same problem inside a
node with its shared-memory transport; this is the CPU equivalent. When every rank of the sync
group can open the sender's segments (checked, not assumed: a same-named host in another
container or IPC namespace fails the check), the sender packs each bucket into one of two
shared slots and the collective carries one small all-reduce per bucket:

    step b    sender: "bucket b is in slot b % 2" (0 = aborted); receivers: "bucket b-1 copied"

After step b the receivers copy bucket b while the sender packs bucket b+1 into the other slot
(freed at step b: bucket b-1 was copied). A last step says the last bucket was copied. Receivers copy out of the slots
into their own staging buffers, so all-or-nothing holds exactly as on the plain path.

Segments are files in /dev/shm that the sender unlinks as soon as every receiver has mapped
them: the memory lives exactly as long as some process maps it, and a crash leaks nothing.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import torch

SLOTS = 2
TOKEN_BYTES = 16
SHM_DIR = Path("/dev/shm")


class ShmRing:
    """Two bucket-sized shared-memory slots, created (`names=None`) or mapped by name."""

    def __init__(self, nbytes: int, names: list[str] | None = None):
        self.nbytes = max(nbytes, TOKEN_BYTES)
        self.owner = names is None
        self.token = secrets.token_bytes(TOKEN_BYTES) if self.owner else b""
        if self.owner:
            if not SHM_DIR.is_dir():
                raise OSError(f"{SHM_DIR} does not exist")
            names = [f"polyrl-weights-{secrets.token_hex(8)}-{i}" for i in range(SLOTS)]
        self.names = list(names)
        self._maps: list[mmap.mmap] = []
        try:
            for name in self.names:
                self._maps.append(self._map(SHM_DIR / name))
        except BaseException:
            self.close()
            raise
        self.slots = [torch.frombuffer(m, dtype=torch.uint8, count=self.nbytes) for m in self._maps]

    def _map(self, path: Path) -> mmap.mmap:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if self.owner else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if self.owner:
                os.ftruncate(fd, self.nbytes)
            elif os.fstat(fd).st_size < self.nbytes:
                raise OSError(f"{path} is smaller than {self.nbytes} bytes")
            return mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)

    def write_token(self) -> None:
        self.slots[0][:TOKEN_BYTES].copy_(torch.frombuffer(bytearray(self.token), dtype=torch.uint8))

    def read_token(self) -> bytes:
        return bytes(self.slots[0][:TOKEN_BYTES].numpy().tobytes())

    def unlink(self) -> None:
        """Remove the names; mappings stay valid (call once every receiver has mapped them)."""
        if self.owner:
            for name in self.names:
                try:
                    (SHM_DIR / name).unlink()
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        self.unlink()
        self.slots = []  # drop the tensor views before unmapping
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps later
                pass
        self._maps = []

    def __del__(self) -> None:
        if getattr(self, "_maps", None) or getattr(self, "owner", False):
            self.close()


def attach(names: list[str], nbytes: int, token: bytes) -> ShmRing | None:
    """The sender's ring if this process can see it (same host, same IPC namespace), else None."""
    try:
        ring = ShmRing(nbytes, names)
    except (OSError, ValueError):
        return None
    if ring.read_token() != token:
        ring.close()
        return None
    return ring
