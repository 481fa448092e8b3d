"""Child process for tests/unit/test_nvml.py: runs an NvmlPoller through the
steps named on the command line and prints what each returned, as JSON."""

import ctypes
import dataclasses
import json
import logging
import sys
import time
import traceback

from spanlet.config import NvmlSettings
from spanlet.nvml import NvmlPoller


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append([record.levelname, record.getMessage()])


def _sample(s):
    return dict(dataclasses.asdict(s), memory_used_ratio=s.memory_used_ratio)


def _step(poller, step):
    name, _, arg = step.partition(":")
    if name == "open":
        return dataclasses.asdict(poller.open())
    if name == "poll":
        return poller.poll_once()
    if name == "snapshot":
        return {gpu: _sample(s) for gpu, s in poller.snapshot().items()}
    if name == "window":
        return poller.window()
    if name == "status":
        return dataclasses.asdict(poller.status)
    if name == "errors":
        return poller.errors
    if name in ("start", "stop"):
        return getattr(poller, name)()
    if name == "wait_polls":    # bounded wait for the thread's n-th poll
        deadline = time.monotonic() + 20
        while poller.polls < int(arg) and time.monotonic() < deadline:
            time.sleep(0.005)
        return poller.polls
    if name == "thread_alive":
        return poller._thread is not None and poller._thread.is_alive()
    if name == "standin":       # the stand-in library's own call counts
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        return {"init": lib.standin_init_calls(), "shutdown": lib.standin_shutdown_calls()}
    raise ValueError(step)


def main():
    settings = NvmlSettings(**json.loads(sys.argv[1]))
    records = _Records()
    logging.getLogger("spanlet.nvml").addHandler(records)
    logging.getLogger("spanlet.nvml").setLevel(logging.DEBUG)
    out = {"results": [], "exception": None}
    try:
        poller = NvmlPoller(settings)
        for step in sys.argv[2:]:
            out["results"].append(_step(poller, step))
    except BaseException:
        out["exception"] = traceback.format_exc()
    out["logs"] = records.lines
    print(json.dumps(out))


if __name__ == "__main__":
    main()
