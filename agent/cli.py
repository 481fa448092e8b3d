"""The `spanlet` command line: `spanlet run` starts the agent, `spanlet inspect`
shows what a running one sees, `spanlet demo` runs a workload for it to see."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from spanlet import config as config_mod
from spanlet.probes import node_check

EXIT_OK = 0
EXIT_START_REFUSED = 2  # bad config, not root, missing headers or mounts
ASIDE_BEGIN_WAIT_S = 5.0   # at most, for the probe starter to begin its compiling processes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spanlet", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the agent on this node")
    run.add_argument("--config", metavar="FILE",
                     help="YAML config file (default: $SPANLET_CONFIG, else built-in defaults)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one config key, e.g. --set sandbox.mode=enforce (repeatable)")
    run.add_argument("--dump-bpf", action="store_true",
                     help="print each enabled probe's C as shipped, with its compile flags (BCC) or the "
                          "object's settings, programs and maps (CO-RE), and exit")
    run.add_argument("--print-events", action="store_true",
                     help="print every decoded kernel event as one JSON line on stdout")
    from spanlet import inspect as inspect_mod
    inspect_mod.add_parser(sub)
    from spanlet.demo import run as demo_mod
    demo_mod.add_parser(sub)
    return p


def _dump_bpf(cfg: config_mod.Config) -> None:
    from spanlet.probes.starter import probe_classes
    owner = None
    for cls in probe_classes(cfg):
        probe = cls(cfg)
        if owner is None:
            owner = probe  # the span_ctx probe: the others get the folder it will pin in
        if probe.core:        # a CO-RE object: its source as shipped, and the object as the agent sets it up
            rel = probe.object_path.relative_to(probe.object_path.parents[2])
            print(f"/* ==== probe {probe.name}: {probe.source_path.name}  object: {rel} ==== */")
            print(probe.source_text())
            print("/* " + "\n * ".join(probe.describe_object()) + " */")
            continue
        flags = " ".join(probe.compile_flags(pin_dir=str(owner.pin_dir)))
        print(f"/* ==== probe {probe.name}: {probe.source_path.name}  flags: {flags} ==== */")
        print(probe.source_text())


class _RedactingFormatter(logging.Formatter):
    """Every line the agent logs, traceback included, with the configured
    credentials replaced by *** (whatever module wrote it)."""

    def __init__(self, fmt: str, secrets: list[str]) -> None:
        super().__init__(fmt)
        self._secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return config_mod.redact(super().format(record), self._secrets)


def stop_on_signals(stopping: threading.Event) -> None:
    """SIGTERM and SIGINT set `stopping` from now on, instead of ending the
    process at once, which would leave its TC filters, pins and store behind
    (a signal while the probes compile or attach: the agent stops after)."""
    def on_signal(signum, _frame):
        logging.getLogger("spanlet").info("received %s, shutting down", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _setup_logging(cfg: config_mod.Config) -> None:
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr)
    formatter = _RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                    cfg.secrets())
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
    logging.captureWarnings(True)
    # Uncaught exceptions (main or any thread) go through the same formatter.
    crash = logging.getLogger("spanlet.crash")
    sys.excepthook = lambda *exc: crash.critical("uncaught exception", exc_info=exc)

    def thread_hook(a: threading.ExceptHookArgs) -> None:
        if a.exc_type is not SystemExit:     # as the default hook does
            crash.error("uncaught exception in thread %s", a.thread.name if a.thread else "?",
                        exc_info=(a.exc_type, a.exc_value, a.exc_traceback))
    threading.excepthook = thread_hook


def _run(args: argparse.Namespace) -> int:
    # Before the agent's first thread: each thread would otherwise keep an arena.
    from spanlet.memory import cap_malloc_arenas, fix_mmap_threshold
    from spanlet.osthreads import name_os_threads

    cap_malloc_arenas()
    fix_mmap_threshold()
    name_os_threads()       # `top -H` shows which of the agent's threads takes what
    try:
        cfg = config_mod.load(args.config, overrides=args.overrides)
    except config_mod.ConfigError as e:
        # One self-contained line per problem, each naming its key and source.
        for line in str(e).splitlines():
            print(f"spanlet: {line}", file=sys.stderr)
        return EXIT_START_REFUSED
    _setup_logging(cfg)
    if args.dump_bpf:
        _dump_bpf(cfg)
        return EXIT_OK
    from spanlet.probes.starter import ProbeStarter, check_node

    try:
        check_node(cfg)
    except node_check.EnvironmentProblem as e:
        print(f"spanlet: cannot start: {e}", file=sys.stderr)
        return EXIT_START_REFUSED
    # From here a SIGTERM or SIGINT asks for a stop (after the start), never
    # ends the process with the probes half attached.
    stopping = threading.Event()
    stop_on_signals(stopping)
    # The probes compile in a thread while the rest of the agent is imported and built.
    starter = ProbeStarter(cfg)
    starter.begin()
    starter.aside_begun.wait(ASIDE_BEGIN_WAIT_S)   # the compiling processes first, then the imports
    try:
        from spanlet.daemon import Daemon

        sink = None
        if args.print_events:
            def sink(ev):
                print(json.dumps(ev.as_dict()), flush=True)
        daemon = Daemon(cfg, sink=sink, starter=starter, stopping=stopping)
    except BaseException:
        starter.abandon()
        raise
    try:
        daemon.start()
        print("spanlet: running; SIGTERM or Ctrl-C stops it", file=sys.stderr, flush=True)
        daemon.run_until_signal()
    finally:
        daemon.stop()
    # stop() released everything the agent holds (probes detached, exporters
    # flushed, store closed). The interpreter's own teardown of BCC's LLVM,
    # chdb and grpc takes over a second and holds nothing of ours: skip it so
    # the shutdown deadline is the agent's, not the finalizers'.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_OK)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "inspect":
        from spanlet import inspect as inspect_mod
        return inspect_mod.run(args)
    if args.command == "demo":
        from spanlet.demo import run as demo_mod
        return demo_mod.main(args)
    return EXIT_START_REFUSED


if __name__ == "__main__":
    sys.exit(main())
