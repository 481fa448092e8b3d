"""The agent's threads named in the kernel as in Python (`top -H`, `ps -L`,
/proc/PID/task/TID/comm): without it every thread of the agent is `python`, and
what each one costs cannot be told apart from outside. Python 3.14 does this
itself; before it, a one-shot profile hook names each thread as it starts."""

from __future__ import annotations

import sys
import threading

TASK_COMM_LEN = 15      # the bytes of a name the kernel keeps


def _set_comm(tid: int, name: str) -> bool:
    """Thread `tid` of this process takes `name` in the kernel, cut to what it keeps."""
    try:
        with open(f"/proc/self/task/{tid}/comm", "wb") as f:
            f.write(name.encode()[:TASK_COMM_LEN])
    except OSError:         # gone already, or not Linux
        return False
    return True


def set_os_name(name: str) -> bool:
    """This thread's kernel name: `name`."""
    return _set_comm(threading.get_native_id(), name)


def rename(thread: threading.Thread, name: str) -> bool:
    """A started thread that a library made (and named `Thread-N (target)`)
    takes `name`, in Python and in the kernel. The Python name goes first: if
    the one-shot hook has not yet run in that thread, it then sets the same."""
    thread.name = name
    return thread.native_id is not None and _set_comm(thread.native_id, name)


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
