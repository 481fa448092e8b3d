"""Netlink side of the TC classifier: which interfaces to attach to, clsact and
the cls_bpf filters through pyroute2, and a monitor of interface changes."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from spanlet.config import TcConfig
from spanlet.probes.base import ProbeError

log = logging.getLogger(__name__)

FILTER_NAME = "spanlet_tc_classify"
PROGRAMS = {"ingress": "tc_classify_in", "egress": "tc_classify_eg"}
REQUEST_PARSER = "tc_classify_req"
# Where clsact (or the legacy ingress qdisc) hangs: TC_H_INGRESS, ffff:fff1.
QDISC_PARENT = 0xFFFFFFF1
# clsact's two hooks as filter parents (TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS/EGRESS)).
PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}
ETH_P_ALL = 0x0003
ARPHRD_ETHER = 1
IFF_LOOPBACK = 0x8
RTMGRP_LINK = 0x1
NETLINK_ROUTE = 0
# The link monitor re-reads the interfaces this often even without events
# (a netlink socket can overflow and lose them).
RECONCILE_EVERY_S = 30.0


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    loopback: bool
    ether: bool


def select_interfaces(links: Iterable[Link], tc: TcConfig) -> tuple[dict[int, str], list[str]]:
    """Which interfaces to attach to ({ifindex: name}) and which configured ones
    cannot be used ("name: why"). No configured list: every non-loopback
    Ethernet interface not excluded."""
    links = list(links)
    wanted: dict[int, str] = {}
    problems: list[str] = []
    if tc.interfaces:
        by_name = {l.name: l for l in links}
        for name in tc.interfaces:
            link = by_name.get(name)
            if link is None:
                problems.append(f"{name}: no such interface")
            elif not link.ether:
                problems.append(f"{name}: not an Ethernet interface")
            else:
                wanted[link.index] = name
        return wanted, problems
    for link in links:
        if link.loopback or not link.ether or link.name in tc.exclude_interfaces:
            continue
        wanted[link.index] = link.name
    return wanted, problems



def _prog_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("prog_id:"):
                return int(line.split()[1])
    raise ProbeError(f"no prog_id for fd {fd}")


@dataclass
class _Attachment:
    index: int
    name: str
    owns_clsact: bool


def open_iproute(netns: str | None):
    from pyroute2 import IPRoute
    # flags=0: never create the namespace if it is gone.
    return IPRoute(netns=netns, flags=0) if netns else IPRoute()


def _filter_name(msg) -> str | None:
    if msg.get_attr("TCA_KIND") != "bpf":
        return None
    opts = msg.get_attr("TCA_OPTIONS")
    return opts.get_attr("TCA_BPF_NAME") if opts is not None else None


class TcAttacher:
    """clsact + cls_bpf filters through pyroute2, in one network namespace.

    Our filters carry the name FILTER_NAME, priority cfg.tc.filter_priority and
    as handle the id of our ingress program, so that a filter left by a killed
    agent (same name, other handle) is told apart from ours."""

    def __init__(self, netns: str | None, prio: int, fds: dict[str, int], handle: int):
        self.netns = netns
        self.prio = prio
        self.fds = fds
        self.handle = handle

    def iproute(self):
        return open_iproute(self.netns)

    @staticmethod
    def links(ipr) -> list[Link]:
        out = []
        for m in ipr.get_links():
            out.append(Link(index=m["index"], name=m.get_attr("IFLA_IFNAME"),
                            loopback=bool(m["flags"] & IFF_LOOPBACK),
                            ether=m["ifi_type"] == ARPHRD_ETHER))
        return out

    @staticmethod
    def _qdisc_kinds(ipr, index: int) -> set[str]:
        return {q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index)
                if q["index"] == index and q["parent"] == QDISC_PARENT}

    @staticmethod
    def _filters(ipr, index: int, parent: int) -> list:
        return [f for f in ipr.get_filters(index=index, parent=parent)
                if f["handle"] != 0 and f["index"] == index and f["parent"] == parent]

    def _remove_named(self, ipr, index: int, handle: int | None) -> int:
        """Delete our-named filters (all of them, or those with `handle`)."""
        removed = 0
        for parent in PARENTS.values():
            for f in self._filters(ipr, index, parent):
                if _filter_name(f) != FILTER_NAME or (handle is not None and f["handle"] != handle):
                    continue
                ipr.tc("del-filter", "bpf", index=index, handle=f["handle"], parent=parent,
                       info=f["info"])
                removed += 1
        return removed

    def _other_filters(self, ipr, index: int) -> int:
        return sum(len(self._filters(ipr, index, p)) for p in PARENTS.values())

    def remove_stale(self, ipr, index: int, name: str, drop_clsact: bool) -> bool:
        """Remove filters named like ours (a killed agent's). True when the
        clsact held nothing else: it was that agent's (deleted if drop_clsact)."""
        if "clsact" not in self._qdisc_kinds(ipr, index):
            return False
        stale = self._remove_named(ipr, index, None)
        if not stale:
            return False
        log.info("tc_classify: removed %d stale %s filter(s) on %s", stale, FILTER_NAME, name)
        if self._other_filters(ipr, index):
            return False
        if drop_clsact:
            ipr.tc("del", "clsact", index)
        return True

    def attach(self, ipr, index: int, name: str) -> _Attachment:
        owns = self.remove_stale(ipr, index, name, drop_clsact=False)
        kinds = self._qdisc_kinds(ipr, index)
        if "clsact" not in kinds:
            if "ingress" in kinds:
                raise ProbeError("an ingress qdisc is present (clsact cannot be added)")
            ipr.tc("add", "clsact", index)
            owns = True
        try:
            for direction, parent in PARENTS.items():
                ipr.tc("add-filter", "bpf", index=index, handle=self.handle, fd=self.fds[direction],
                       name=FILTER_NAME, parent=parent, prio=self.prio, protocol=ETH_P_ALL,
                       direct_action=True)
        except Exception:
            self.detach(ipr, _Attachment(index, name, owns))
            raise
        return _Attachment(index, name, owns)

    def detach(self, ipr, att: _Attachment) -> None:
        self._remove_named(ipr, att.index, self.handle)
        if att.owns_clsact and self._other_filters(ipr, att.index) == 0:
            ipr.tc("del", "clsact", att.index)


def _netlink_error_text(e: Exception) -> str:
    code = getattr(e, "code", None)
    if isinstance(code, int) and code > 0:
        return f"{os.strerror(code)} ({e})"
    return str(e) or type(e).__name__



class LinkMonitor:
    """A thread that calls `on_change` when the interfaces of a network
    namespace change (RTMGRP_LINK), and every RECONCILE_EVERY_S anyway."""

    def __init__(self, netns: str | None, on_change: Callable[[], None]):
        self.netns = netns
        self.on_change = on_change
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_w: int | None = None

    def _socket(self) -> socket.socket:
        if self.netns:
            from pyroute2 import netns as pr_netns
            sock = pr_netns.create_socket(self.netns, socket.AF_NETLINK, socket.SOCK_RAW,
                                          NETLINK_ROUTE, flags=0)
        else:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        sock.bind((0, RTMGRP_LINK))
        sock.setblocking(False)
        return sock

    def start(self) -> None:
        try:
            sock = self._socket()
        except OSError as e:
            log.warning("tc_classify: no link monitor (%s); interfaces are re-read on refresh", e)
            return
        wake_r, self._wake_w = os.pipe()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(sock, wake_r),
                                        name="tc_classify-links", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self, sock: socket.socket, wake_r: int) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([sock, wake_r], [], [], RECONCILE_EVERY_S)
                if wake_r in ready or self._stop.is_set():
                    break
                if sock in ready:
                    try:
                        while sock.recv(65536):
                            pass
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as e:  # ENOBUFS: events lost, so re-read all
                        log.debug("tc_classify: link monitor: %s", e)
                self.on_change()
        except Exception as e:
            log.warning("tc_classify: link monitor stopped: %s", e)
        finally:
            sock.close()
            os.close(wake_r)

    def stop(self) -> None:
        self._stop.set()
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._wake_w is not None:
            os.close(self._wake_w)
            self._wake_w = None
