"""Loader of bpf/mmap_sandbox.bpf.c: compiles the sandbox policy of the config
into the program's maps, keeps it current (cgroup ids, stale fds), and reads
the violation counters (metric 5) back. Its programs show as sbx_* in
`bpftool prog show`.

At the call, pools are recognised by the path string given to the open call,
normalised for repeated '/' and '.' components only (the kernel side's header
comment has the full list of what that misses). Behind it runs a sweep by
inode, from /proc (sweep(): at start, then every sandbox.sweep_interval_s from
refresh()): it writes the symlinks and hard links found under the prefixes
into the kernel's pool table as aliases, adopts pool fds the open did not show
(fork, dup, SCM_RIGHTS, symlinks and hard links elsewhere, relative or '..'
paths) so that their next mmap is checked at the call, and judges the pool
mappings in /proc/<pid>/maps that the call did not judge, or that have more
permissions now (mprotect): those are counted as sweep violations, apart
from the call's, and in enforce mode their process is killed. Fds dropped
without close(2) are forgotten by refresh(). 32-bit compat syscalls are not
checked."""

from __future__ import annotations

import logging
import os
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
from spanlet.probes.sandbox.policy import (GRANT_CGROUP, GRANT_PID, MAX_GRANTS, MAX_JUDGED_MAPS,
                                           MAX_POOL_FDS, MAX_POOLS, MAX_PREFIX_ENTRIES, MapSync,
                                           Policy, PoolIds, _fd_key, _grant_key, _pool_key,
                                           _pool_ref, _prefix_key, _prefix_leaf, _u8,
                                           compile_policy)
from spanlet.probes.sandbox.procfs import (WALK_LIMIT, PoolIndex, _ProcMaps, _read_bytes,
                                           _stat_fields, index_pools, judged_cover,
                                           kill_if_same, pool_mappings, process_cgroups,
                                           rule_of, scan_pool_fds, stale_pool_fds)

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
)
OPTIONAL_TRACEPOINTS = {
    "SANDBOX_TP_OPENAT2": (("syscalls:sys_enter_openat2", "sbx_openat2_in"),
                           ("syscalls:sys_exit_openat2", "sbx_openat2_out")),
    "SANDBOX_TP_OPEN": (("syscalls:sys_enter_open", "sbx_open_in"),
                        ("syscalls:sys_exit_open", "sbx_open_out")),
}
TRACEFS_DIRS = (TRACEFS, Path("/sys/kernel/debug/tracing"))


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
        self._last_sweep = float("-inf")
        self._proc_maps: dict[int, _ProcMaps] = {}
        self._reported: set[tuple] = set()       # sweep violations still mapped
        self._swept: dict[tuple[int, str, str], int] = {}
        self.adopted_fds = 0                      # pool fds the sweep gave the kernel
        self.sweep_seconds = 0.0                  # how long the last sweep took

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
        m["grants"].sync(policy.grants, remove=False)
        m["pools"].sync(pools, remove=False)
        m["prefixes"].sync(policy.prefixes)
        m["pools"].sync(pools)
        m["grants"].sync(policy.grants)
        self.policy = policy

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
        self.status.attachments, self.status.failed_attachments = [], []
        self._push(self.policy)
        for tp, fn in self.tracepoints:  # as compiled (cflags)
            try:
                self.bpf.attach_tracepoint(tp=tp, fn_name=fn)
                self.status.attachments.append(f"tracepoint:{tp}")
            except Exception as e:
                self.status.failed_attachments.append(f"tracepoint:{tp}: {e}")
                raise ProbeError(f"cannot attach tracepoint {tp}: {e}") from None
        self._sweep()  # also adopts the pool fds opened before the probe started
        if self.adopted_fds:
            log.info("mmap_sandbox: %d pool fds were open before start", self.adopted_fds)

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
        """Follow cgroups that were recreated (new ids), and forget pool fds
        that went away without close(2). Never raises: a failure is logged and
        the last policy stays in force."""
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
                if time.monotonic() - self._last_sweep >= self.cfg.sandbox.sweep_interval_s:
                    self._sweep()
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
        index = index_pools(self.policy)
        if index.truncated and not self.index.truncated:
            log.warning("mmap_sandbox: more than %d entries under the prefixes: the sweep "
                        "looks at the first ones only", WALK_LIMIT)
        if index.by_inode.keys() != self.index.by_inode.keys():
            self._proc_maps.clear()             # other inodes to look for: read every maps again
        self.index = index
        self._push(self.policy)                 # the aliases
        self._sweep_fds()                       # what the aliases and inodes say now
        self._adopt_fds()
        self._judge_mappings()

    def _adopt_fds(self) -> None:
        """Give the kernel every open pool fd it does not know (or knows as
        another pool), so that their next mmap is checked at the call."""
        table = self._fds_table()
        known = {(k.tgid, k.fd): (v.pool_id, v.max_bytes) for k, v in table.items()}
        for k, ref in scan_pool_fds(self.policy, self.proc, self.index.by_inode):
            if known.get(k) == ref:
                continue
            try:
                table[_fd_key(table, k)] = _pool_ref(table, ref)
            except Exception as e:  # full: the kernel side counts its own misses
                log.warning("mmap_sandbox: cannot adopt pool fd %s: %s", k, e)
                return
            if k not in known:
                self.adopted_fds += 1

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
            if seen is None or not seen.pools:
                continue
            cgroup, ancestry = None, []
            for m in seen.pools:
                if judged_cover(m, judged.get(pid, [])):
                    continue
                if cgroup is None:
                    cgroup, ancestry = process_cgroups(self.proc, self.cgroups.mount, pid)
                pool_id, max_bytes = self.index.by_inode[m.inode]
                rule = rule_of(self._access(pid, pool_id, ancestry), m.prot, m.shared,
                               m.end - m.start, m.offset, max_bytes)
                if rule:
                    candidates[(pid, seen.starttime, m)] = (cgroup, rule)
        return candidates

    def _report(self, key: tuple, cgroup: int, rule: int) -> None:
        """Count one sweep violation (and kill its process in enforce mode)."""
        pid, starttime, m = key
        killed = self.cfg.sandbox.mode == "enforce" and kill_if_same(self.proc, pid, starttime)
        action = events.Action.kill if killed else events.Action.audit
        k = (cgroup, events.Rule(rule).name, action.name)
        self._swept[k] = self._swept.get(k, 0) + 1
        log.warning("mmap_sandbox: sweep: pid %d maps pool %s (%s) at %#x, judged nowhere "
                    "else: %s", pid, self.pool_path(self.index.by_inode[m.inode][0]),
                    events.Rule(rule).name, m.start, action.name)

    def stop(self) -> None:
        with self._policy_lock:
            super().stop()
            self._maps = {}

    # -- readers ---------------------------------------------------------------------
    def violations(self) -> dict[tuple[int, str, str], int]:
        """{(cgroup id, rule, action): count} since the probe started."""
        if self.bpf is None:
            return {}
        return sum_violations(self.bpf["spanlet_sandbox_violations_total"].items())

    def sweep_violations(self) -> dict[tuple[int, str, str], int]:
        """{(cgroup id, rule, action): count} of the mappings only the sweep
        judged (made through an fd the call did not know, or given more
        permissions since), each counted once while it stays mapped."""
        with self._policy_lock:
            return dict(self._swept)

    def unresolved_opens(self) -> int:
        """Opens of a path under a prefix with a '..' component, which the
        kernel left to the sweep."""
        if self.bpf is None:
            return 0
        return percpu_sum(self.bpf["spanlet_sandbox_unresolved_opens_total"], 0)

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
