"""Loader of bpf/mmap_sandbox.bpf.c: compiles the sandbox policy of the config
into the program's maps, keeps it current (cgroup ids, stale fds), and reads
the violation counters (metric 5) back. Its programs show as sbx_* in
`bpftool prog show`.

At the call, pools are recognised by the path string given to the open call,
normalised for repeated '/' and '.' components only (the kernel side's header
comment has the full list of what that misses). What the string cannot see
the kernel notices when it happens (sandbox_notices): a file mmap of an fd it
does not know as a pool's (links, relative or '..' paths, fork, dup,
SCM_RIGHTS), mprotect/mremap by a process that maps a pool, and its forks.
The notice reader (a thread of its own, at most one round every
NOTICE_ROUND_S) resolves each from /proc at once, by inode: the mapping's
file (/proc/<pid>/map_files) and the fd's, and for the other notices that one
process's maps. A pool mapping is judged by the rules of the call, counted
apart from the call's (sweep_violations()), and in enforce mode its process is
killed; the fd is handed to the kernel so that its next mmap is judged at the
call. The work follows the rate of such calls, not the number of fds or
processes on the node.

The full sweep of /proc (sweep(): every fd of every process and every
process's maps) runs only at start (what was open and mapped before), when
the policy changes, and when notices were lost (a full ring), then at most
every sandbox.sweep_interval_s. refresh() re-walks the prefixes' folders for
symlinks and hard links every sandbox.sweep_interval_s (written into the
kernel's pool table as aliases) and forgets the pool fds that went away
without close(2). 32-bit compat syscalls are not checked."""

from __future__ import annotations

import logging
import mmap
import os
import select
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Iterable

from spanlet import events
from spanlet.cgroups import CgroupResolver
from spanlet.config import Config, SandboxConfig
from spanlet.discovery import PF_KTHREAD
from spanlet.probes.base import Probe, ProbeError
from spanlet.probes.maps import dump_table, percpu_sum
from spanlet.probes.node_check import TRACEFS
from spanlet.probes.ringbuf import RingBufferReader
from spanlet.probes.sandbox.policy import (GRANT_CGROUP, GRANT_PID, MAX_GRANTS, MAX_HEADS, PREFIX_FULL,
                                           MAX_JUDGED_MAPS, MAX_POOL_FDS, MAX_POOLS,
                                           MAX_PREFIX_ENTRIES, SLOTS, MapSync, Policy, PoolIds,
                                           _fd_key, _grant_key, _pool_key, _pool_ref,
                                           _prefix_key, _prefix_leaf, _u8, compile_policy,
                                           prefix_heads)
from spanlet.probes.sandbox.procfs import (MAP_SHARED, MAP_SHARED_VALIDATE, MAP_TYPE,
                                           WALK_LIMIT, FolderWatch, PoolIndex, PoolMapping, _ProcMaps,
                                           _read_bytes, _stat_fields, index_pools, judged_cover,
                                           kill_if_same, link_pool, pool_mappings,
                                           process_cgroups, rule_of, scan_pool_fds,
                                           stale_pool_fds)

log = logging.getLogger(__name__)

# (tracepoint, program) pairs. Without any required one the sandbox has a
# hole (an untracked fd, a stale one, an unchecked mmap), so it runs complete
# or not at all; the optional ones close side doors (a direct open(2) or
# openat2(2) call) where the kernel has them, each behind its -D flag.
REQUIRED_TRACEPOINTS = (
    ("syscalls:sys_enter_openat", "sbx_openat_in"),
    ("syscalls:sys_exit_openat", "sbx_openat_out"),
    ("syscalls:sys_enter_mmap", "sbx_mmap"),
    ("syscalls:sys_exit_mmap", "sbx_mmap_out"),
    ("syscalls:sys_enter_close", "sbx_close"),
    ("syscalls:sys_enter_mprotect", "sbx_mprot_in"),
    ("syscalls:sys_exit_mprotect", "sbx_mprot_out"),
    ("syscalls:sys_enter_mremap", "sbx_mremap_in"),
    ("syscalls:sys_exit_mremap", "sbx_mremap_out"),
    ("sched:sched_process_fork", "sbx_fork"),
)
OPTIONAL_TRACEPOINTS = {
    "SANDBOX_TP_PKEY_MPROTECT": (("syscalls:sys_enter_pkey_mprotect", "sbx_pkey_in"),
                                 ("syscalls:sys_exit_pkey_mprotect", "sbx_pkey_out")),
    "SANDBOX_TP_OPENAT2": (("syscalls:sys_enter_openat2", "sbx_openat2_in"),
                           ("syscalls:sys_exit_openat2", "sbx_openat2_out")),
    "SANDBOX_TP_OPEN": (("syscalls:sys_enter_open", "sbx_open_in"),
                        ("syscalls:sys_exit_open", "sbx_open_out")),
}
TRACEFS_DIRS = (TRACEFS, Path("/sys/kernel/debug/tracing"))

# struct sandbox_notice of mmap_sandbox.h, and its kinds.
NOTICE = struct.Struct("<IIiIQQQII")
NOTICE_MMAP, NOTICE_CHANGE, NOTICE_FORK = 1, 2, 3
NOTICE_PAGES = 16
# The notice reader's rounds are at least this far apart: a storm of notices
# costs the agent a bounded share of a core, a single one waits no longer.
NOTICE_ROUND_S = 0.01
PAGE = mmap.PAGESIZE
# After lost notices, full sweeps are this many times their own duration apart
# at least (so they take at most a tenth of a core).
FULL_SWEEP_SHARE = 10


def tracepoint_exists(tp: str) -> bool:
    """Checked in tracefs, as BCC does, without importing BCC."""
    category, event = tp.split(":")
    # os.path.isdir: an unreadable tracefs (not root) is "no", not an error.
    return any(os.path.isdir(d / "events" / category / event) for d in TRACEFS_DIRS)


def sum_violations(items: Iterable) -> dict[tuple[int, str, str], int]:
    """(key, per-CPU values) pairs of spanlet_sandbox_violations_total →
    {(cgroup id, rule, action): count} with rule and action by name."""
    out: dict[tuple[int, str, str], int] = {}
    for key, values in items:
        n = sum(int(getattr(v, "value", v)) for v in values)
        rule = events.Rule(key.rule).name
        action = events.Action(key.action).name
        k = (int(key.cgroup_id), rule, action)
        out[k] = out.get(k, 0) + n
    return out


def _int(v) -> int:
    """A scalar of a map entry (batch reads give ints, others ctypes values)."""
    return int(getattr(v, "value", v))


# -- the probe --------------------------------------------------------------------
class SandboxProbe(Probe):
    """mmap sandbox over the tensor pools of cfg.sandbox (see module doc)."""

    name = "mmap_sandbox"

    def __init__(self, cfg: Config, sink=None, clock=None,
                 cgroups: CgroupResolver | None = None, proc: str = "/proc"):
        super().__init__(cfg, sink, clock)
        self.cgroups = cgroups or CgroupResolver()
        self.proc = proc
        self.ids = PoolIds()
        self.policy = Policy()
        self._maps: dict[str, MapSync] = {}
        self._policy_lock = threading.Lock()
        self._problems: list[str] = []
        self.tracepoints: list[tuple[str, str]] = list(REQUIRED_TRACEPOINTS)
        # the sweep (see the module doc)
        self.index = PoolIndex()
        self._last_sweep = float("-inf")         # the last full sweep
        self._last_walk = float("-inf")          # the last periodic walk of the prefixes
        self._proc_maps: dict[int, _ProcMaps] = {}
        self._reported: set[tuple] = set()       # sweep violations still mapped
        self._swept: dict[tuple[int, str, str], int] = {}
        self.adopted_fds = 0                      # pool fds the agent gave the kernel
        self.sweep_seconds = 0.0                  # how long the last full sweep took
        # the notices (see the module doc)
        self._notices: RingBufferReader | None = None
        self._notice_thread: threading.Thread | None = None
        self._notice_stop: int | None = None      # eventfd that wakes the reader to stop
        self._heads: list = []
        self._lost_seen = 0
        self._watch: FolderWatch | None = None    # the prefixes' folders (inotify)
        # What the agent did in /proc since start, by kind: the notices read,
        # the links it stat'ed for them (fd, mapping), the maps files it read
        # for them, and the full sweeps.
        self.work = {"notices": 0, "links": 0, "maps": 0, "sweeps": 0}

    def cflags(self) -> list[str]:
        flags = super().cflags() + [f"-DSANDBOX_MAX_PREFIX_ENTRIES={MAX_PREFIX_ENTRIES}",
                                    f"-DSANDBOX_MAX_POOLS={MAX_POOLS}",
                                    f"-DSANDBOX_MAX_GRANTS={MAX_GRANTS}",
                                    f"-DSANDBOX_MAX_POOL_FDS={MAX_POOL_FDS}",
                                    f"-DSANDBOX_MAX_JUDGED_MAPS={MAX_JUDGED_MAPS}"]
        if self.cfg.sandbox.mode == "enforce":
            flags.append("-DSANDBOX_ENFORCE")
        self.tracepoints = list(REQUIRED_TRACEPOINTS)
        for flag, pairs in OPTIONAL_TRACEPOINTS.items():
            if all(tracepoint_exists(tp) for tp, _ in pairs):
                flags.append(f"-D{flag}")
                self.tracepoints += pairs
        return flags

    # -- policy ----------------------------------------------------------------------
    def compile_policy(self, sb: SandboxConfig | None = None, strict: bool = True) -> Policy:
        return compile_policy(sb or self.cfg.sandbox, self.ids, self.cgroups.id, strict)

    def compile(self, pin_dir: str | None = None) -> None:
        # Configuration problems first: they must not wait for a compile.
        self.policy = self.compile_policy()
        super().compile(pin_dir)

    def _push(self, policy: Policy) -> None:
        """Grants and pools before prefixes, so that a path recognised as a
        pool is never judged against a half-written policy."""
        if not self._maps:
            b = self.bpf
            self._maps = {
                "grants": MapSync(b["sandbox_grants"], _grant_key, _u8),
                "pools": MapSync(b["sandbox_pools"], _pool_key, _pool_ref),
                "prefixes": MapSync(b["sandbox_prefixes"], _prefix_key, _prefix_leaf),
            }
        m = self._maps
        pools = self._pool_entries(policy)
        heads = prefix_heads(policy.prefixes)
        m["grants"].sync(policy.grants, remove=False)
        m["pools"].sync(pools, remove=False)
        self._write_heads(self._heads + [h for h in heads if h not in self._heads])
        m["prefixes"].sync(policy.prefixes)
        self._write_heads(heads)
        m["pools"].sync(pools)
        m["grants"].sync(policy.grants)
        self.policy = policy

    def _write_heads(self, heads: list) -> None:
        """The open's early-return table (while prefixes change, the union of
        the old and new heads, so that no path slips between them)."""
        if heads == self._heads:
            return
        if len(heads) > MAX_HEADS:
            raise ProbeError(f"sandbox.prefixes: more than {MAX_HEADS} different heads")
        table = self.bpf["sandbox_heads"]
        leaf = table.Leaf()
        for i, (v0, v1, m0, m1) in enumerate(heads):
            leaf.value[2 * i], leaf.value[2 * i + 1] = v0, v1
            leaf.mask[2 * i], leaf.mask[2 * i + 1] = m0, m1
        table[table.Key(0)] = leaf
        self._heads = list(heads)

    def _pool_entries(self, policy: Policy) -> dict[str, tuple[int, int]]:
        """The configured pools, and the aliases of the last sweep (never
        over a configured path), within the table's size."""
        out = dict(policy.pools)
        for path, ref in self.index.aliases.items():
            if len(out) >= MAX_POOLS:
                log.warning("mmap_sandbox: pool table full: %d aliases left out",
                            len(self.index.aliases) - (len(out) - len(policy.pools)))
                break
            out.setdefault(path, ref)
        return out

    def apply_policy(self, sb: SandboxConfig | None = None) -> None:
        """Push a (new) sandbox section into the running program; raises
        ProbeError for a bad one and leaves the old policy in place. The mode
        (audit/enforce) is compiled in and needs a restart."""
        if sb is not None and sb.mode != self.cfg.sandbox.mode:
            raise ProbeError(f"sandbox.mode: {self.cfg.sandbox.mode} → {sb.mode} needs a restart")
        policy = self.compile_policy(sb)
        with self._policy_lock:
            if sb is not None:
                self.cfg.sandbox = sb
            if self.bpf is not None:
                self._push(policy)
                self._sweep()      # open fds and mappings follow a changed policy
            else:
                self.policy = policy

    def _attach(self) -> None:
        self._maps = {}
        self._heads = []
        self.status.attachments, self.status.failed_attachments = [], []
        self._push(self.policy)
        for tp, fn in self.tracepoints:  # as compiled (cflags)
            try:
                self.bpf.attach_tracepoint(tp=tp, fn_name=fn)
                self.status.attachments.append(f"tracepoint:{tp}")
            except Exception as e:
                self.status.failed_attachments.append(f"tracepoint:{tp}: {e}")
                raise ProbeError(f"cannot attach tracepoint {tp}: {e}") from None
        self._notices = RingBufferReader(self.bpf["sandbox_notices"].map_fd, NOTICE_PAGES * PAGE)
        try:
            self._watch = FolderWatch()
        except OSError as e:   # then links under a prefix wait for the periodic walk
            log.warning("mmap_sandbox: cannot watch the prefixes' folders: %s", e)
        self._sweep()  # also adopts the pool fds opened before the probe started
        if self.adopted_fds:
            log.info("mmap_sandbox: %d pool fds were open before start", self.adopted_fds)
        self._notice_stop = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._notice_thread = threading.Thread(target=self._notice_loop, name="sandbox-notices",
                                               daemon=True)
        self._notice_thread.start()

    def _fds_table(self):
        return self.bpf["sandbox_pool_fds"]

    def _sweep_fds(self) -> None:
        table = self._fds_table()
        entries = [((k.tgid, k.fd), (v.pool_id, v.max_bytes)) for k, v in table.items()]
        for k, now in stale_pool_fds(entries, self.policy, self.proc, self.index.by_inode):
            if now is None:
                try:
                    del table[_fd_key(table, k)]
                except KeyError:
                    pass
            else:
                table[_fd_key(table, k)] = _pool_ref(table, now)

    def refresh(self) -> None:
        """Follow cgroups that were recreated (new ids), forget pool fds that
        went away without close(2), re-walk the prefixes every
        sandbox.sweep_interval_s, and sweep in full only after lost notices.
        Never raises: a failure is logged and the last policy stays in force."""
        with self._policy_lock:
            if self.bpf is None:
                return
            try:
                policy = self.compile_policy(strict=False)
                if policy.problems != self._problems:
                    for p in policy.problems:
                        log.warning("mmap_sandbox: grant skipped: %s", p)
                    self._problems = policy.problems
                self._push(policy)
                self._sweep_fds()
                now = time.monotonic()
                interval = self.cfg.sandbox.sweep_interval_s
                lost = self.lost_notices()
                # a full sweep at most every sweep_interval_s, and never more
                # than a tenth of the time: its cost per second stays bounded
                if lost != self._lost_seen and now - self._last_sweep >= max(
                        interval, FULL_SWEEP_SHARE * self.sweep_seconds):
                    log.warning("mmap_sandbox: %d notices lost (full ring): sweeping /proc",
                                lost - self._lost_seen)
                    self._lost_seen = lost
                    self._sweep()
                    self._last_walk = now
                elif now - self._last_walk >= interval:
                    self._last_walk = now
                    self._reindex()
                    self._forget_gone()
            except Exception as e:
                log.warning("mmap_sandbox: refresh failed: %s", e)

    # -- the sweep -------------------------------------------------------------------
    def sweep(self, full: bool = False) -> None:
        """Run the sweep now (refresh() runs it every sandbox.sweep_interval_s); full:
        read every process's maps, not only those whose mapped size changed
        (mprotect changes none)."""
        with self._policy_lock:
            if self.bpf is not None:
                if full:
                    self._proc_maps.clear()
                self._sweep()

    def _sweep(self) -> None:
        """Never raises: a sweep that fails is logged, and the next one tries
        again (the check at the call is not affected)."""
        t0 = time.monotonic()
        self._last_sweep = t0
        try:
            self._sweep_once()
        except Exception as e:
            log.warning("mmap_sandbox: sweep failed: %s", e)
        self.sweep_seconds = time.monotonic() - t0

    def _sweep_once(self) -> None:
        self.work["sweeps"] += 1
        if self._reindex():
            self._proc_maps.clear()             # other inodes to look for: read every maps again
        self._sweep_fds()                       # what the aliases and inodes say now
        self._adopt_fds()
        self._judge_mappings()

    def _reindex(self) -> bool:
        """Walk the prefixes again; push the aliases. True when the pool
        inodes changed."""
        index = index_pools(self.policy)
        if index.truncated and not self.index.truncated:
            log.warning("mmap_sandbox: more than %d entries under the prefixes: the agent "
                        "looks at the first ones only", WALK_LIMIT)
        changed = index.by_inode.keys() != self.index.by_inode.keys()
        self.index = index
        self._push(self.policy)                 # the aliases
        if self._watch is not None:
            self._watch.follow(index.folders)
        return changed

    def _forget_gone(self) -> None:
        """Drop what is kept for processes that ended (cost: the processes
        that mapped a pool; what the last full sweep kept of the others goes
        at the next one)."""
        table = self.bpf["sandbox_pool_procs"]
        for k in list(table.keys()):
            if not os.path.exists(f"{self.proc}/{k.value}"):
                try:
                    del table[k]
                except KeyError:
                    pass
        self._reported = {r for r in self._reported if os.path.exists(f"{self.proc}/{r[0]}")}
        for pid in [p for p, seen in self._proc_maps.items()
                    if seen.pools and not os.path.exists(f"{self.proc}/{p}")]:
            del self._proc_maps[pid]

    def _adopt_fds(self) -> None:
        """Give the kernel every open pool fd it does not know (or knows as
        another pool), so that their next mmap is checked at the call."""
        table = self._fds_table()
        known = {(k.tgid, k.fd): (v.pool_id, v.max_bytes) for k, v in table.items()}
        for k, ref in scan_pool_fds(self.policy, self.proc, self.index.by_inode):
            if known.get(k) != ref and not self._adopt(k, ref, known.get(k)):
                return

    def _adopt(self, k: tuple[int, int], ref: tuple[int, int], known=False) -> bool:
        """Hand one pool fd to the kernel (its process's slot first, so that
        the kernel looks it up); False when its table is full."""
        slots = self.bpf["sandbox_proc_slots"]
        slots[slots.Key(k[0] & (SLOTS - 1))] = slots.Leaf(1)
        table = self._fds_table()
        try:
            table[_fd_key(table, k)] = _pool_ref(table, ref)
        except Exception as e:  # full: the kernel side counts its own misses
            log.warning("mmap_sandbox: cannot adopt pool fd %s: %s", k, e)
            return False
        if known is None:
            self.adopted_fds += 1
        return True

    def _pids(self) -> list[int]:
        try:
            with os.scandir(self.proc) as it:
                return [int(e.name) for e in it if e.name.isdigit()]
        except OSError:
            return []

    def _pool_maps_of(self, pid: int, now: float) -> _ProcMaps | None:
        """The pool mappings of a process, its maps read again only when its
        mapped size changed (or the pool inodes did)."""
        fields = _stat_fields(self.proc, pid)
        if not fields or len(fields) < 21:
            return None
        starttime, vsize = fields[19], fields[20]
        seen = self._proc_maps.get(pid)
        if seen is not None and seen.starttime == starttime and (seen.kernel_thread or (
                seen.vsize == vsize and now - seen.read_at < self.cfg.discovery.full_rescan_s)):
            return seen
        seen = self._proc_maps[pid] = _ProcMaps(starttime, vsize, now,
                                                bool(int(fields[6]) & PF_KTHREAD))
        if not seen.kernel_thread and self.index.by_inode:
            maps = _read_bytes(f"{self.proc}/{pid}/maps")
            seen.pools = pool_mappings(maps, self.index.by_inode) if maps else []
        return seen

    def _judged(self, alive: set[int] | None = None) -> dict[int, list[tuple[int, int, int, int]]]:
        """{tgid: [(address, length, prot, flags)]} of the mappings the call
        judged; with `alive`, those of processes gone are deleted (a reused
        pid must not inherit them)."""
        table = self.bpf["sandbox_judged_maps"]
        out: dict[int, list] = {}
        for key, v in dump_table(table).items():
            k = table.Key.from_buffer_copy(key)
            if alive is not None and k.tgid not in alive and not os.path.exists(
                    f"{self.proc}/{k.tgid}"):  # not one born since the pids were listed
                try:
                    del table[k]
                except KeyError:
                    pass
                continue
            out.setdefault(k.tgid, []).append((k.addr, v.len, v.prot, v.flags))
        return out

    def _access(self, pid: int, pool_id: int, cgroups: list[int]) -> int:
        grants = self.policy.grants
        best = grants.get((pool_id, GRANT_PID, pid), 0)
        for cg in cgroups:
            best = max(best, grants.get((pool_id, GRANT_CGROUP, cg), 0))
        return best

    def _judged_of(self, pid: int, pools: list[PoolMapping]) -> list[tuple[int, int, int, int]]:
        """The judged mappings of one process: looked up where its pool
        mappings start, the whole table only when one is not found there."""
        table = self.bpf["sandbox_judged_maps"]
        out = []
        for m in pools:
            key = table.Key()
            key.tgid, key.addr = pid, m.start
            try:
                v = table[key]
            except KeyError:
                return self._judged().get(pid, [])
            out.append((m.start, v.len, v.prot, v.flags))
        return out

    def _judge_mappings(self) -> None:
        """Pool mappings the call did not judge (or judged with fewer
        permissions): judged here by the same rules, each counted once while
        it stays mapped; in enforce mode its process is killed."""
        now = time.monotonic()
        pids = self._pids()
        alive = set(pids)
        candidates = self._breaking(pids, self._judged(alive), now)
        for pid in [p for p in self._proc_maps if p not in alive]:
            del self._proc_maps[pid]
        new = [k for k in candidates if k not in self._reported]
        if new:  # a mapping made while this sweep ran may be judged meanwhile
            judged = self._judged()
            new = [k for k in new if not judged_cover(k[2], judged.get(k[0], []))]
        for key in new:
            self._report(key, *candidates[key])
        self._reported = set(candidates)

    def _breaking(self, pids: list[int], judged: dict[int, list], now: float
                  ) -> dict[tuple, tuple[int, int]]:
        """{(pid, starttime, mapping): (cgroup id, rule)} of the pool mappings
        that break a rule and that the call did not judge as they are now."""
        candidates: dict[tuple, tuple] = {}
        for pid in pids:
            seen = self._pool_maps_of(pid, now)
            if seen is not None and seen.pools:
                self._mark_pool_proc(pid)
                candidates.update(self._breaking_of(pid, seen, judged.get(pid, [])))
        return candidates

    def _breaking_of(self, pid: int, seen: _ProcMaps, judged: list) -> dict[tuple, tuple]:
        candidates: dict[tuple, tuple] = {}
        cgroup, ancestry = None, []
        for m in seen.pools:
            if judged_cover(m, judged):
                continue
            if cgroup is None:
                cgroup, ancestry = process_cgroups(self.proc, self.cgroups.mount, pid)
            pool_id, max_bytes = self.index.by_inode[m.inode]
            rule = rule_of(self._access(pid, pool_id, ancestry), m.prot, m.shared,
                           m.end - m.start, m.offset, max_bytes)
            if rule:
                candidates[(pid, seen.starttime, m)] = (cgroup, rule)
        return candidates

    def _mark_pool_proc(self, pid: int) -> None:
        """The kernel notices this process's mprotect, mremap and forks."""
        table = self.bpf["sandbox_pool_procs"]
        table[table.Key(pid)] = table.Leaf(1)

    def _report(self, key: tuple, cgroup: int, rule: int) -> None:
        """Count one violation seen from /proc (and kill its process in enforce mode)."""
        pid, starttime, m = key
        killed = self.cfg.sandbox.mode == "enforce" and kill_if_same(self.proc, pid, starttime)
        action = events.Action.kill if killed else events.Action.audit
        k = (cgroup, events.Rule(rule).name, action.name)
        self._swept[k] = self._swept.get(k, 0) + 1
        log.warning("mmap_sandbox: pid %d maps pool %s (%s) at %#x, seen from /proc: %s", pid, self.pool_path(self.index.by_inode[m.inode][0]),
                    events.Rule(rule).name, m.start, action.name)

    # -- the notices ------------------------------------------------------------------
    def _notice_loop(self) -> None:
        """The notice reader: wakes on the kernel's notices (or each second,
        for fds noticed in a full ring) and resolves them, one round at most
        every NOTICE_ROUND_S."""
        ring, stop = self._notices, self._notice_stop
        ep = select.epoll()
        try:
            ep.register(self.bpf["sandbox_notices"].map_fd, select.EPOLLIN)
            ep.register(stop, select.EPOLLIN)
            if self._watch is not None:
                ep.register(self._watch.fd, select.EPOLLIN)
            last = 0.0
            while True:
                if not ring.pending():
                    ready = ep.poll(1.0)
                    if any(fd == stop for fd, _ in ready):
                        return
                wait = NOTICE_ROUND_S - (time.monotonic() - last)
                if wait > 0 and select.select([stop], [], [], wait)[0]:   # not the ring: it stays ready
                    return
                last = time.monotonic()
                self.settle()
        except Exception as e:  # the probe's maps went away under it
            if self.bpf is not None:
                log.warning("mmap_sandbox: notice reader stopped: %s", e)
        finally:
            ep.close()

    def settle(self) -> None:
        """Resolve every notice the kernel sent so far, now (the reader does it
        on its own within NOTICE_ROUND_S; tests call this to know it is done)."""
        with self._policy_lock:
            if self.bpf is None or self._notices is None:
                return
            try:
                self._round()
            except Exception as e:
                log.warning("mmap_sandbox: resolving notices failed: %s", e)

    def _round(self) -> None:
        if self._watch is not None and self._watch.changed(
                p for p, (kind, _, _) in self.policy.prefixes.items() if kind == PREFIX_FULL):
            self._reindex()                     # before the notices: they may need its aliases
        got: list[tuple] = []
        self._notices.consume(lambda buf, off, size: got.append(NOTICE.unpack_from(buf, off)))
        unknown = {(k.tgid, k.fd): _int(v)
                   for k, v in self.bpf["sandbox_unknown_fds"].items_lookup_and_delete_batch()}
        changed = {_int(k) for k, _ in self.bpf["sandbox_changed_procs"].items_lookup_and_delete_batch()}
        self.work["notices"] += len(got)
        read_maps = set(changed)
        noticed = set()
        for kind, tgid, fd, prot, addr, length, off, flags, _ in got:
            if kind == NOTICE_MMAP:
                noticed.add((tgid, fd))
                if not self._resolve_mmap(tgid, fd, prot, addr, length, off, flags):
                    read_maps.add(tgid)
            elif kind == NOTICE_CHANGE:
                read_maps.add(tgid)
            elif kind == NOTICE_FORK:
                if os.path.exists(f"{self.proc}/{addr}/task/{tgid}"):   # a thread
                    table = self.bpf["sandbox_pool_procs"]
                    try:
                        del table[table.Key(tgid)]
                    except KeyError:
                        pass
                else:
                    read_maps.add(tgid)
        # mmaps of a noticed fd before its notice was read, or a notice lost
        read_maps |= {k[0] for k, n in unknown.items() if n > 1 or k not in noticed}
        for pid in read_maps:
            self._judge_process(pid)

    def _pool_of(self, link: str) -> tuple[bool, os.stat_result | None, tuple[int, int] | None]:
        """What a /proc link leads to (procfs.link_pool), walking the prefixes
        again when a file that may be a hard link of a pool is not known
        (made since the last walk)."""
        self.work["links"] += 1
        try:
            st = os.stat(link)
        except OSError:
            st = None
        if st is not None and st.st_dev not in self.index.devices:
            return True, st, None               # on no pool's file system: nothing more to read
        there, st, ref = link_pool(link, self.policy, self.index.by_inode)
        if st is not None and ref is None and st.st_nlink > 1 and stat.S_ISREG(st.st_mode) and \
                st.st_dev in {d for d, _ in self.index.by_inode}:
            self._reindex()
            there, st, ref = link_pool(link, self.policy, self.index.by_inode)
        return there, st, ref

    def _resolve_mmap(self, tgid: int, fd: int, prot: int, addr: int, length: int, off: int,
                      flags: int) -> bool:
        """One mmap of an fd the kernel did not know: the mapping judged as
        the call would have judged it if it maps a pool, and then (or when
        the mapping is not to be found) its fd handed to the kernel if it
        names a pool. A mapping on no pool's file system costs one stat.
        False when the mapping is not where the call left it (merged with a
        neighbour, or gone): then that process's maps are read."""
        end = addr + -(-length // PAGE) * PAGE
        there, st, mapped = self._pool_of(f"{self.proc}/{tgid}/map_files/{addr:x}-{end:x}")
        if there and mapped is None:
            return True   # the fd named no pool then (if it does now, its next mmap is noticed)
        _, _, ref = self._pool_of(f"{self.proc}/{tgid}/fd/{fd}")
        if ref is not None:
            table = self._fds_table()
            key = _fd_key(table, (tgid, fd))
            if table.get(key) is None or (table[key].pool_id, table[key].max_bytes) != ref:
                self._adopt((tgid, fd), ref, table.get(key))
        if not there:
            return False
        fields = _stat_fields(self.proc, tgid)
        if not fields or len(fields) < 21:
            return True                                       # gone
        shared = flags & MAP_TYPE in (MAP_SHARED, MAP_SHARED_VALIDATE)
        cgroup, ancestry = process_cgroups(self.proc, self.cgroups.mount, tgid)
        pool_id, max_bytes = mapped
        rule = rule_of(self._access(tgid, pool_id, ancestry), prot, shared, length, off,
                       max_bytes, as_called=True)
        table = self.bpf["sandbox_judged_maps"]
        key = table.Key()
        key.tgid, key.addr = tgid, addr
        leaf = table.Leaf()
        leaf.len, leaf.pool_id, leaf.prot, leaf.flags, leaf.rule = length, pool_id, prot, flags, rule
        table[key] = leaf
        self._mark_pool_proc(tgid)
        m = PoolMapping(addr, end, prot, shared, off, (st.st_dev, st.st_ino) if st else (0, 0))
        if rule and (tgid, fields[19], m) not in self._reported:
            self._reported.add((tgid, fields[19], m))
            self._report((tgid, fields[19], m), cgroup, rule)
        return True

    def _judge_process(self, pid: int) -> None:
        """Read one process's maps now and judge its pool mappings that no
        call (or notice) judged as they are now."""
        self.work["maps"] += 1
        self._proc_maps.pop(pid, None)
        seen = self._pool_maps_of(pid, time.monotonic())
        if seen is None or not seen.pools:
            self._proc_maps.pop(pid, None)      # kept only for processes that map a pool
            return
        self._mark_pool_proc(pid)
        for key, (cgroup, rule) in self._breaking_of(pid, seen, self._judged_of(pid, seen.pools)).items():
            if key not in self._reported:
                self._reported.add(key)
                self._report(key, cgroup, rule)

    def stop(self) -> None:
        if self._notice_stop is not None:
            os.eventfd_write(self._notice_stop, 1)
            if self._notice_thread is not None:
                self._notice_thread.join(5)
            os.close(self._notice_stop)
            self._notice_stop = self._notice_thread = None
        with self._policy_lock:
            if self._notices is not None:
                self._notices.close()
                self._notices = None
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            super().stop()
            self._maps = {}

    # -- readers ---------------------------------------------------------------------
    def violations(self) -> dict[tuple[int, str, str], int]:
        """{(cgroup id, rule, action): count} since the probe started."""
        if self.bpf is None:
            return {}
        return sum_violations(self.bpf["spanlet_sandbox_violations_total"].items())

    def sweep_violations(self) -> dict[tuple[int, str, str], int]:
        """{(cgroup id, rule, action): count} of the mappings the agent judged
        from /proc, not the call (made through an fd the call did not know,
        given more permissions since, or inherited), each counted once while
        it stays mapped."""
        with self._policy_lock:
            return dict(self._swept)

    def unresolved_opens(self) -> int:
        """Opens of a path under a prefix with a '..' component, which the
        kernel left to the sweep."""
        if self.bpf is None:
            return 0
        return percpu_sum(self.bpf["spanlet_sandbox_unresolved_opens_total"], 0)

    def lost_notices(self) -> int:
        """Notices the kernel could not send (a full ring): then a full sweep."""
        if self.bpf is None:
            return 0
        return percpu_sum(self.bpf["sandbox_lost_notices"], 0)

    def untracked_fds(self) -> int:
        """Pool fds the kernel could not remember (its fd table was full)."""
        if self.bpf is None:
            return 0
        return percpu_sum(self.bpf["spanlet_sandbox_untracked_fds_total"], 0)

    @property
    def pool_paths(self) -> dict[int, str]:
        return dict(self.policy.pool_paths)

    def pool_path(self, pool_id: int) -> str | None:
        """The pool an event's pool_id names ('<prefix>*' for a file under a
        prefix that is no configured pool)."""
        return self.policy.pool_paths.get(pool_id)
