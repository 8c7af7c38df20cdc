"""Memory shared by the ranks of one node: decoded images held once per node, not once per rank.

Each block is an anonymous memory file (``memfd_create``) that local rank 0 creates and hands to
the other local ranks over a Unix socket in the abstract namespace (``SCM_RIGHTS``: the file
descriptor itself travels; nothing is written to a file system). Every local rank maps it
``MAP_SHARED``, fills its own part (:meth:`Block.fill_part`: part ``local_rank`` of
``local_world``, so the decode work is spread over the node's processes), says so, and waits until
all parts are in (:meth:`Block.wait_ready`). Rank 0's server drops its own descriptor once every
rank has received one, so a block lives exactly as long as some rank maps it: a block is freed
when the last rank lets it go, and a killed job leaves nothing behind (no /dev/shm files to clean).
Memory is then counted once per node in PSS (shared pages split between the processes mapping
them).

The ranks agree on a ``key`` (the same string on every local rank of one job; default from
torchrun's environment: :func:`default_key`) and create their :class:`NodeShare` and its blocks
in the same order. With one local rank no socket is used (blocks are private anonymous maps).

>>> share = NodeShare("job42/scene-0f3a", local_rank=0, local_world=2)
>>> blk = share.block("window-0", nbytes)          # every local rank, same name and size
>>> blk.fill_part(lambda view, part, parts: ...)    # this rank's share of the work
>>> blk.wait_ready(); pixels = blk.array           # all parts filled
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import threading
import time
from typing import Callable, Dict, Optional

import numpy as np

from dali_nerf.errors import DataError
from dali_nerf.launch_env import launch_env

__all__ = ["NodeShare", "Block", "default_key", "SHARE_TIMEOUT_S"]

SHARE_TIMEOUT_S = 900.0
"""How long a rank waits for its node's other ranks (a block's parts, the server) before a
one-line error: a decode of a large window by a slow rank takes minutes, a dead rank forever."""

_GENERATIONS: Dict[str, int] = {}
_LOCK = threading.Lock()


def default_key() -> Optional[str]:
    """A key every local rank of a torchrun job computes alike: the job's rendezvous id, its
    master address and port and the restart count (a restarted group gets fresh blocks); None
    outside torchrun (:func:`dali_nerf.launch_env.launch_env`)."""
    env = launch_env()
    if not env.run_id:
        return None
    return "/".join([env.run_id, env.master_addr or "", str(env.master_port or ""), str(env.restart_count)])


def _address(key: str) -> bytes:
    return b"\0dali_nerf-share/" + key.encode()[:90]


class _Server:
    """Local rank 0's thread: creates each block's memfd on the first request for it, hands its
    descriptor to every rank that asks, counts the parts done and answers the waits."""

    def __init__(self, address: bytes, local_world: int):
        self.local_world = local_world
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(address)
        except OSError as e:
            self.sock.close()
            raise DataError(f"node share {address[1:].decode(errors='replace')}: cannot listen ({e.strerror}); another "
                            f"job on this node uses the same key: give the loader another share_key") from None
        self.sock.listen(local_world + 4)
        self.blocks: dict = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dali_nerf-node-share", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        conns, bufs = [], {}
        try:
            while not self.stop.is_set():
                ready, _, _ = select.select([self.sock] + conns, [], [], 0.2)
                for s in ready:
                    if s is self.sock:
                        c, _ = self.sock.accept()
                        conns.append(c)
                        bufs[c] = b""
                        continue
                    data = s.recv(4096)
                    if not data:
                        conns.remove(s)
                        s.close()
                        continue
                    bufs[s] += data
                    while b"\n" in bufs[s]:
                        line, bufs[s] = bufs[s].split(b"\n", 1)
                        self._handle(s, line.decode().split())
        finally:
            for c in conns:
                c.close()
            self.sock.close()
            for b in self.blocks.values():
                if b["fd"] is not None:
                    os.close(b["fd"])

    def _handle(self, conn, msg) -> None:
        op, name = msg[0], msg[1]
        b = self.blocks.setdefault(name, {"fd": None, "served": 0, "done": 0, "waiting": [], "answered": 0,
                                          "failed": False})
        if op == "get":
            if b["fd"] is None and b["served"] == 0:
                fd = os.memfd_create(f"dali_nerf-{name}", os.MFD_CLOEXEC)
                os.ftruncate(fd, max(1, int(msg[2])))
                b["fd"] = fd
            socket.send_fds(conn, [b"ok\n"], [b["fd"]])
            b["served"] += 1
            if b["served"] == self.local_world:  # every rank holds it now: the block lives in their maps
                os.close(b["fd"])
                b["fd"] = None
        elif op in ("done", "fail"):
            b["done"] += 1
            b["failed"] |= op == "fail"
            if b["done"] == self.local_world:
                for c in b["waiting"]:
                    c.sendall(b"failed\n" if b["failed"] else b"ready\n")
                b["answered"] += len(b["waiting"])
                b["waiting"] = []
        elif op == "wait":
            if b["done"] == self.local_world:
                conn.sendall(b"failed\n" if b["failed"] else b"ready\n")
                b["answered"] += 1
            else:
                b["waiting"].append(conn)
        if b["served"] == self.local_world and b["answered"] == self.local_world:  # every rank has it, ready
            del self.blocks[name]


class Block:
    """One shared block of ``nbytes``: ``array`` (nbytes,) uint8 over the mapping (read-only
    after :meth:`wait_ready`); :meth:`release` unmaps it (the memory is freed when every local rank
    has)."""

    def __init__(self, share: "NodeShare", name: str, nbytes: int, mm, array: np.ndarray):
        self.share, self.name, self.nbytes, self._mm, self.array = share, name, nbytes, mm, array

    def fill_part(self, fill: Callable[[np.ndarray, int, int], None]) -> None:
        """``fill(array, part, parts)`` writes this rank's part; then tells the node it is done (or
        that it failed, re-raising: the other ranks' :meth:`wait_ready` then fail too)."""
        try:
            fill(self.array, self.share.local_rank, self.share.local_world)
        except BaseException:
            self.share._send(f"fail {self.name}\n")
            raise
        self.share._send(f"done {self.name}\n")

    def wait_ready(self, timeout: Optional[float] = None) -> np.ndarray:
        """Block until every local rank filled its part; returns ``array`` (read-only). A
        DataError when another rank failed to fill its part (that rank raises its own error)."""
        if self.share._request(f"wait {self.name}\n", timeout=timeout) == "failed":
            raise DataError(f"node share {self.share.key}: another rank of this node failed to fill its part of "
                            f"{self.name} (see that rank's error)")
        self.array.setflags(write=False)
        return self.array

    def release(self) -> None:
        self.array = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still exported (a batch the consumer holds): unmapped when it dies
                pass
            self._mm = None


class NodeShare:
    """The node's shared blocks, as seen from one rank (module doc).

    Args:
        key: the same string on every local rank of the job (:func:`default_key`).
        local_rank, local_world: this rank on its node and the ranks on the node.
        timeout: seconds to wait for the other ranks (:data:`SHARE_TIMEOUT_S`).
    """

    def __init__(self, key: str, local_rank: int, local_world: int, timeout: float = SHARE_TIMEOUT_S):
        self.local_rank, self.local_world, self.timeout = int(local_rank), int(local_world), float(timeout)
        with _LOCK:  # the n-th share of this key in this process: the same n on every rank
            gen = _GENERATIONS.get(key, 0)
            _GENERATIONS[key] = gen + 1
        self.key = f"{key}#{gen}"
        self._server: Optional[_Server] = None
        self._sock: Optional[socket.socket] = None
        self._buf = b""
        if self.local_world > 1:
            if self.local_rank == 0:
                self._server = _Server(_address(self.key), self.local_world)
            self._sock = self._connect(_address(self.key))

    def _connect(self, address: bytes) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(address)
                return s
            except OSError:
                s.close()
                if time.monotonic() > deadline:
                    raise DataError(f"node share {self.key}: local rank 0 did not open its share within {self.timeout:g} s; "
                                    f"check that every rank of the node builds the same loader") from None
                time.sleep(0.05)

    def _send(self, text: str) -> None:
        if self._sock is not None:
            self._sock.sendall(text.encode())

    def _request(self, text: str, fds: bool = False, timeout: Optional[float] = None):
        """Send ``text``; wait for one reply line (and a descriptor with ``fds``)."""
        if self._sock is None:
            return None
        self._send(text)
        limit = self.timeout if timeout is None else timeout
        r, _, _ = select.select([self._sock], [], [], limit)
        if not r:
            raise DataError(f"node share {self.key}: no answer for {text.split()[0]} {text.split()[1]} within {limit:g} s "
                            f"(another rank of this node stopped or is far behind)")
        if fds:
            msg, got, _, _ = socket.recv_fds(self._sock, 64, 1)
            if not got:
                raise DataError(f"node share {self.key}: local rank 0 went away")
            return got[0]
        while b"\n" not in self._buf:
            data = self._sock.recv(64)
            if not data:
                raise DataError(f"node share {self.key}: local rank 0 went away")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def block(self, name: str, nbytes: int) -> Block:
        """Map the block ``name`` of ``nbytes`` (created by the first rank that asks)."""
        nbytes = int(nbytes)
        if self._sock is None:
            mm = mmap.mmap(-1, max(1, nbytes))
        else:
            fd = self._request(f"get {name} {nbytes}\n", fds=True)
            try:
                mm = mmap.mmap(fd, max(1, nbytes), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        return Block(self, name, nbytes, mm, np.frombuffer(mm, np.uint8, count=nbytes))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._server is not None:
            self._server.stop.set()
            self._server.thread.join(timeout=2.0)
            self._server = None
