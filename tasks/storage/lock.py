"""One owner per workspace: the lock `grpoflow run`, `resume`, `sync`, a deployed pipeline flow and a continuous
cycle take on the folder they write, held until they end.

    local folder   <folder>/.grpoflow.lock, an exclusive flock (released by the kernel when the process dies);
                   the file names the holder (pid, host, since, command) while it is held and is emptied on
                   release, so a non-empty file found when the flock is free was left by a process that died
    s3://          <prefix>/.grpoflow.lease, a JSON lease created with a conditional put (If-None-Match: *),
                   renewed every ttl/3 by a background thread (If-Match: the ETag it wrote last) and deleted on
                   release (If-Match). A lease not renewed for ``ttl_s`` by the S3 server's clock (its age is
                   the server's Date minus the object's LastModified, so machines' clocks do not matter) is
                   taken over with a warning, again with If-Match: of two takers, one wins; so is, at once, a lease
                   whose holder ran on this host and is gone (kill -9, a crash): same host name, same boot and
                   same PID namespace (:func:`current_pid_space`; containers sharing the host's name, as with
                   ``network_mode: host``, each have their own PIDs), and no process has its pid. Each renewal
                   writes new bytes (a counter), so its ETag differs and a taker's If-Match on the version it read
                   fails once the holder renewed. The holder fences its own writes: every write, delete or upload
                   of an S3Store under the workspace first checks the lease (renewing it at once when the last
                   renewal is over ttl/2 old: a process paused or cut off) and raises :class:`WorkspaceLost` once
                   it was taken over, so a holder that wakes up after a takeover writes nothing more

A process that cannot take the lock gets :class:`WorkspaceBusy`, whose message names the holder; the CLI exits 2
with it before any work. The lock is re-entrant within a process (the CLI takes it, then the flow it calls takes
it again), keyed by the store's location. Why a lock: two processes on one workspace prune each other's
checkpoints, empty each other's stage folders and both write the final model.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpoflow.tasks.storage import store as store_module
from grpoflow.tasks.storage.s3 import join_uri
from grpoflow.tasks.storage.store import S3Store, Store

LOCK_FILE = ".grpoflow.lock"
LEASE = ".grpoflow.lease"
LEASE_TTL_S = 60.0

log = logging.getLogger(__name__)


@dataclass
class Holder:
    """Who holds a workspace: written into the lock file or lease."""

    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    since: float = field(default_factory=time.time)
    command: str = ""
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    renewals: int = 0  # S3: counted up by each renewal, so every version of the lease has its own ETag
    pid_space: str = field(default_factory=lambda: current_pid_space())  # where ``pid`` means this process ("" unknown)

    def gone(self, me: Holder) -> bool:
        """Whether this holder provably died: it ran where ``me`` runs (host, boot and PID namespace all the same,
        so its pid means the same process here) and no process has its pid now. A holder of another container
        under the same host name, or one that recorded no namespace (older grpoflow), is never taken for gone:
        only its lease's expiry tells."""
        same = self.host == me.host and bool(self.pid_space) and self.pid_space == me.pid_space
        return same and not _alive(self.pid)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on host {self.host} since {when}" + (f" ({self.command})" if self.command else "")

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def loads(cls, data: bytes) -> Holder | None:
        """The holder a lock file or lease names; None for an empty or unreadable one (a torn write)."""
        try:
            raw = json.loads(data)
            keys = ("pid", "host", "since", "command", "owner", "renewals", "pid_space")
            return cls(**{k: raw[k] for k in keys if k in raw})
        except (ValueError, TypeError):
            return None


class WorkspaceBusy(RuntimeError):
    """Another process holds the workspace; the message names it and what to do."""

    def __init__(self, location: str, holder: Holder | None):
        self.location, self.holder = location, holder
        who = holder.describe() if holder else "another process (it has not written its name yet)"
        fix = f" (stop it with `kill {holder.pid}` on {holder.host})" if holder else ""
        super().__init__(
            f"workspace {location} is in use by {who}; wait for it to finish{fix}, or use another run.name"
        )


class WorkspaceLost(OSError):
    """This process held the workspace's S3 lease and another process took it over (it was not renewed for the
    lease's ttl: this process was paused or cut off from S3); raised before any further write, so the new
    holder's files are not overwritten. Not an S3Error: an upload is not retried after it."""

    def __init__(self, location: str, ttl_s: float, holder: Holder | None):
        who = holder.describe() if holder else "another process"
        super().__init__(
            f"workspace {location}: this process no longer holds its lease (taken over by {who} after it was not "
            f"renewed for {ttl_s:.0f} s: this process was paused or cut off from S3); stopped before writing to it "
            "again. Wait for the new holder to finish, then `grpoflow resume`"
        )


def current_pid_space() -> str:
    """This process's PID namespace on this boot, "<boot id>:<pid namespace inode>": two processes whose pids can
    be compared have the same one (a reboot or another container gives another); "" where Linux's /proc does not
    tell."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _LocalLock:
    def __init__(self, folder: Path):
        self.path = folder / LOCK_FILE
        self.fd: int | None = None

    def acquire(self, me: Holder) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            data = os.pread(fd, 4096, 0)
            os.close(fd)
            raise WorkspaceBusy(str(self.path.parent), Holder.loads(data)) from None
        left = Holder.loads(os.pread(fd, 4096, 0))
        if left is not None and left.owner != me.owner:
            state = "gone" if left.gone(me) else "no longer holds it"
            log.warning("workspace %s: took over the lock left by %s (that process is %s)", self.path.parent,
                        left.describe(), state)  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.dumps(), 0)
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # emptied, never unlinked: another process may have it open already
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


class _S3Lease:
    def __init__(self, store: S3Store, ttl_s: float):
        self.client, self.uri, self.ttl_s = store.client, join_uri(store.uri, LEASE), ttl_s
        self.etag: str | None = None
        self.me: Holder | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.mutex = threading.Lock()  # one renewal at a time (the thread's, or a write's check)
        self.renewed_at = 0.0  # time.monotonic() when the last successful write of the lease was sent
        self.lost = False
        # the local copy is locked too: `grpoflow sync` of it (a local RUN_DIR) is then refused while the S3 run
        # is live on this machine, as two senders of one journal would send its records twice
        self.mirror: _LocalLock | None = _LocalLock(store.local_root)
        self.expired_holder = False  # the lease was taken over from a live holder past its ttl

    def acquire(self, me: Holder) -> None:
        try:
            self._acquire(me)
        except BaseException:
            self.mirror = None
            raise
        try:
            self.mirror.acquire(me)
        except WorkspaceBusy as e:
            self.mirror = None
            if not self.expired_holder:
                self.release()
                raise
            # a stalled holder on this host whose lease expired: taken over as on any host (it stops writing to
            # S3 when it wakes); its flock on the local copy stays until it exits
            log.warning("workspace %s: the local copy stays locked by the stalled holder (%s)", self.uri, e)
        except BaseException:
            self.mirror = None
            self.release()
            raise

    def _acquire(self, me: Holder) -> None:
        self.me = me
        sent = time.monotonic()
        for _ in range(3):  # a lease deleted between our put and our read: try again
            etag = self.client.put_if(me.dumps(), self.uri)
            if etag is not None:
                break
            got = self.client.get_with_etag(self.uri)
            if got is None:
                continue
            data, old, age = got
            holder = Holder.loads(data)
            dead = holder is not None and holder.gone(me)
            if age < self.ttl_s and not dead:  # a live lease; one of a dead process on this host is not
                raise WorkspaceBusy(self.uri.rsplit("/", 1)[0], holder)
            etag = self.client.put_if(me.dumps(), self.uri, etag=old)
            if etag is None:  # another process took it over first
                got = self.client.get_with_etag(self.uri)
                raise WorkspaceBusy(self.uri.rsplit("/", 1)[0], Holder.loads(got[0]) if got else None)
            who = holder.describe() if holder else "an unreadable lease"
            why = "that process is gone" if dead else f"not renewed for {age:.0f} s (lease ttl {self.ttl_s:.0f} s)"
            self.expired_holder = not dead
            log.warning("workspace %s: took over the lease of %s, %s", self.uri.rsplit("/", 1)[0], who, why)
            break
        else:
            raise WorkspaceBusy(self.uri.rsplit("/", 1)[0], None)
        self.etag, self.renewed_at = etag, sent
        self.thread = threading.Thread(target=self._renew, name="grpoflow-lease", daemon=True)
        self.thread.start()

    def _renew(self) -> None:
        while not self.stop.wait(self.ttl_s / 3) and not self.lost:
            try:
                self._renew_once()
            except OSError as e:  # S3 down for a moment: the lease lasts ttl_s, try again at the next tick
                log.warning("workspace lease %s: renewal failed (%s); retrying", self.uri, e)

    def _renew_once(self) -> None:
        """Write the lease again if it is still ours (If-Match); else mark it lost. OSError when S3 does not answer."""
        with self.mutex:
            if self.lost:
                return
            self.me.renewals += 1
            sent = time.monotonic()
            etag = self.client.put_if(self.me.dumps(), self.uri, etag=self.etag)
            if etag is None:
                self.lost = True
                log.error("workspace lease %s: lost (another process took it over after it was not renewed for "
                          "%.0f s); this process no longer owns the workspace", self.uri, self.ttl_s)  # fmt: skip
                return
            self.etag, self.renewed_at = etag, sent

    def check(self) -> None:
        """Before a write to the workspace: :class:`WorkspaceLost` when the lease was taken over. A lease whose
        last renewal is overdue (over ttl/2 old; renewed every ttl/3) may have expired: it is renewed first."""
        if not self.lost and time.monotonic() - self.renewed_at > self.ttl_s / 2:
            self._renew_once()
        if self.lost:
            got = self.client.get_with_etag(self.uri)
            raise WorkspaceLost(self.uri.rsplit("/", 1)[0], self.ttl_s, Holder.loads(got[0]) if got else None)

    def release(self) -> None:
        if self.mirror is not None:
            self.mirror.release()
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        if self.etag is not None and not self.lost:
            try:
                self.client.delete_if(self.uri, self.etag)
            except OSError as e:  # it expires by itself
                log.warning("workspace lease %s: not deleted (%s); it expires in %.0f s", self.uri, e, self.ttl_s)
            self.etag = None


_held: dict[str, list] = {}  # location -> [lock, depth]
_guard = threading.Lock()


@contextlib.contextmanager
def workspace_lock(store: Store, command: str, ttl_s: float = LEASE_TTL_S) -> Iterator[None]:
    """Hold ``store``'s workspace for the block (re-entrant within this process); :class:`WorkspaceBusy` when
    another process holds it. ``command`` is what the holder's record names (``grpoflow resume``)."""
    key = store.location
    with _guard:
        if key in _held:
            _held[key][1] += 1
            lock = None
        else:
            lock = _S3Lease(store, ttl_s) if isinstance(store, S3Store) else _LocalLock(store.local_root)
            lock.acquire(Holder(command=command))
            _held[key] = [lock, 1]
            if isinstance(lock, _S3Lease):  # the store's writes under this location check the lease first
                store_module.FENCES[key] = lock.check
    try:
        yield
    finally:
        with _guard:
            _held[key][1] -= 1
            if _held[key][1] == 0:
                store_module.FENCES.pop(key, None)
                _held.pop(key)[0].release()


def held_fds() -> list[int]:
    """The descriptors of the local locks this process holds (an S3 lease's included: it locks the local copy).
    A child process started with them (``pass_fds``: torchrun) keeps each flock until it exits too, so a kill -9
    of this process does not free the workspace while its GRPO workers still drain their uploads."""
    with _guard:
        locks = [entry[0] for entry in _held.values()]
    local = [lk.mirror if isinstance(lk, _S3Lease) else lk for lk in locks]
    return sorted(lk.fd for lk in local if lk is not None and lk.fd is not None)


def holds(store: Store) -> bool:
    """Whether this process holds ``store``'s workspace."""
    return store.location in _held
