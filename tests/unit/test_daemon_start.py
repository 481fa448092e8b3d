"""The daemon's start (daemon.py): the store starts in a thread of its own
once no compile runs in the process any more (BCC compiles in the headers
folder it chdir()s the process into; the engine's start changes the
directory too), beside the probes' attaches, and before the readers start."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from spanlet import config, events
from spanlet.daemon import Daemon


class Starter:
    """ProbeStarter as the daemon uses it, with no probes: finish() says what
    the store had done when the compiles ended and when the attaches ended."""

    def __init__(self, store_started: threading.Event):
        self.clock = events.MonotonicClock()
        self.compiles_done = threading.Event()
        self.probes: list = []
        self.store_started = store_started
        self.seen: list[str] = []

    def finish(self, sink=None):
        time.sleep(0.3)                   # compiling: the store must wait
        self.seen.append(f"compiled, store started: {self.store_started.is_set()}")
        self.compiles_done.set()
        # attaching: the store starts meanwhile, not after finish() returns
        self.seen.append(f"attached, store started: {self.store_started.wait(30)}")
        return []

    def statuses(self):
        return []


def agent_config(tmp_path) -> config.Config:
    """The store on (its start replaced by each test), no probe, ports picked by the OS."""
    return config.load(env={}, overrides=[
        f"data_dir={tmp_path}/data", "tc.enabled=false", "sandbox.enabled=false", "gpu.enabled=false",
        "nvml.enabled=false", "http_port=0", "otlp.grpc_port=0", "otlp.http_port=0",
        f"admin_socket={tmp_path}/admin.sock"])


def test_the_store_starts_after_the_compiles_beside_the_attaches(tmp_path, monkeypatch):
    cfg = agent_config(tmp_path)
    store_started = threading.Event()
    starter = Starter(store_started)
    d = Daemon(cfg, starter=starter)
    in_thread = []

    def start():
        in_thread.append(threading.current_thread() is not threading.main_thread())
        store_started.set()
    monkeypatch.setattr(d.store, "start", start)
    try:
        d.start()
        assert starter.seen == ["compiled, store started: False", "attached, store started: True"]
        assert in_thread == [True]
    finally:
        d.stop()


def test_what_the_store_start_raises_is_raised_by_the_daemons_start(tmp_path, monkeypatch):
    cfg = agent_config(tmp_path)
    starter = Starter(threading.Event())
    starter.store_started.set()
    d = Daemon(cfg, starter=starter)

    def start():
        raise RuntimeError("a bug in the store's start")
    monkeypatch.setattr(d.store, "start", start)
    try:
        with pytest.raises(RuntimeError, match="a bug in the store's start"):
            d.start()
    finally:
        d.stop()


def test_the_agent_imports_no_library_its_defaults_do_not_use():
    """What the agent imports while its probes compile is CPU a node's first
    start shares with the compiles: with the defaults, no HTTP client (no
    OTLP upstream), no store engine (it runs in a process of its own), no Arrow."""
    code = ("import sys; import spanlet.cli, spanlet.probes.starter, spanlet.daemon; "
            "print(sorted(m for m in ('requests', 'urllib3', 'chdb', 'pyarrow', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
