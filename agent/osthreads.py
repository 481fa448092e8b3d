"""The agent's threads named in the kernel as in Python (`top -H`, `ps -L`,
/proc/PID/task/TID/comm): without it every thread of the agent is `python`, and
what each one costs cannot be told apart from outside. Python 3.14 does this
itself; before it, a one-shot profile hook names each thread as it starts."""

from __future__ import annotations

import sys
import threading

from spanlet.memory import LIBC

PR_SET_NAME = 15        # linux/prctl.h; the kernel keeps 15 bytes of it
TASK_COMM_LEN = 15


_PRCTL = getattr(LIBC, "prctl", None)       # None: not Linux's libc


def set_os_name(name: str) -> bool:
    """This thread's kernel name: `name`, cut to what the kernel keeps."""
    return _PRCTL is not None and _PRCTL(PR_SET_NAME, name.encode()[:TASK_COMM_LEN], 0, 0, 0) == 0


def rename(thread: threading.Thread, name: str) -> bool:
    """A started thread that a library made (and named `Thread-N (target)`)
    takes `name`, in Python and in the kernel. The Python name goes first: if
    the one-shot hook has not yet run in that thread, it then sets the same."""
    thread.name = name
    if thread.native_id is None:
        return False
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm", "w") as f:
            f.write(name[:TASK_COMM_LEN])
    except OSError:         # gone already, or not Linux
        return False
    return True


def _name_on_start(*_) -> None:
    sys.setprofile(None)        # once, at the thread's first call: no cost after
    set_os_name(threading.current_thread().name)


def name_os_threads() -> bool:
    """Every thread the threading module starts from now on takes its Python name
    in the kernel too (the main thread keeps the process's). False where Python
    does it already (3.14) and nothing was set."""
    if sys.version_info >= (3, 14):
        return False
    threading.setprofile(_name_on_start)
    return True
