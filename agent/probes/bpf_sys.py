"""The bpf(2) system call, where the agent makes it itself rather than through
its loader (BCC today): the call's number on each architecture, the commands
(enum bpf_cmd), the few types and flags the agent names, and the members of
union bpf_attr it fills in, all from uapi/linux/bpf.h. This module is the one
place that declares them; the others import them from here."""

from __future__ import annotations

import ctypes as C
import errno
import platform
import resource

# The call's number (asm/unistd.h of each architecture); None where unknown.
NR: int | None = {"x86_64": 321, "aarch64": 280}.get(platform.machine())

# enum bpf_cmd
MAP_CREATE = 0
MAP_LOOKUP_ELEM = 1
MAP_UPDATE_ELEM = 2
MAP_DELETE_ELEM = 3
PROG_LOAD = 5
OBJ_PIN = 6
OBJ_GET = 7
OBJ_GET_INFO_BY_FD = 15
MAP_LOOKUP_AND_DELETE_ELEM = 21       # hash and LRU maps: Linux 5.14
LINK_CREATE = 28

PROG_TYPE_KPROBE = 2                  # enum bpf_prog_type
MAP_TYPE_ARRAY = 2                    # enum bpf_map_type
TRACE_UPROBE_MULTI = 48               # enum bpf_attach_type
F_UPROBE_MULTI_RETURN = 1             # link_create.uprobe_multi.flags
OBJ_NAME_LEN = 16                     # BPF_OBJ_NAME_LEN
LD_IMM64 = 0x18                       # BPF_LD | BPF_IMM | BPF_DW
PSEUDO_MAP_FD = 1                     # its src_reg when the immediate is a map's fd

_libc = C.CDLL(None, use_errno=True)
# syscall(NR, cmd, &attr, sizeof attr): for a hot path that keeps its attr
# made and calls this directly; bpf() below for everything else.
syscall = _libc.syscall
syscall.restype = C.c_long
syscall.argtypes = [C.c_long, C.c_int, C.c_void_p, C.c_uint]


class MapCreateAttr(C.Structure):
    """The map_create member of union bpf_attr, up to map_name."""
    _fields_ = [("map_type", C.c_uint32), ("key_size", C.c_uint32), ("value_size", C.c_uint32),
                ("max_entries", C.c_uint32), ("map_flags", C.c_uint32), ("inner_map_fd", C.c_uint32),
                ("numa_node", C.c_uint32), ("map_name", C.c_char * OBJ_NAME_LEN),
                ("_pad", C.c_uint8 * 72)]


class ElemAttr(C.Structure):
    """The map-element member of union bpf_attr (map_fd, key, value, flags)."""
    _fields_ = [("map_fd", C.c_uint32), ("_pad", C.c_uint32), ("key", C.c_uint64),
                ("value", C.c_uint64), ("flags", C.c_uint64)]


class ProgLoadAttr(C.Structure):
    """The prog_load member of union bpf_attr, up to expected_attach_type."""
    _fields_ = [("prog_type", C.c_uint32), ("insn_cnt", C.c_uint32), ("insns", C.c_uint64),
                ("license", C.c_uint64), ("log_level", C.c_uint32), ("log_size", C.c_uint32),
                ("log_buf", C.c_uint64), ("kern_version", C.c_uint32), ("prog_flags", C.c_uint32),
                ("prog_name", C.c_char * OBJ_NAME_LEN), ("prog_ifindex", C.c_uint32),
                ("expected_attach_type", C.c_uint32), ("_pad", C.c_uint8 * 64)]


class ObjAttr(C.Structure):
    """The obj_pin / obj_get member of union bpf_attr."""
    _fields_ = [("pathname", C.c_uint64), ("bpf_fd", C.c_uint32), ("file_flags", C.c_uint32),
                ("_pad", C.c_uint8 * 48)]


class InfoAttr(C.Structure):
    """The info member of union bpf_attr (BPF_OBJ_GET_INFO_BY_FD)."""
    _fields_ = [("bpf_fd", C.c_uint32), ("info_len", C.c_uint32), ("info", C.c_uint64)]


class MapInfo(C.Structure):
    """struct bpf_map_info."""
    _fields_ = [("type", C.c_uint32), ("id", C.c_uint32), ("key_size", C.c_uint32),
                ("value_size", C.c_uint32), ("max_entries", C.c_uint32), ("map_flags", C.c_uint32),
                ("name", C.c_char * OBJ_NAME_LEN), ("ifindex", C.c_uint32),
                ("btf_vmlinux_value_type_id", C.c_uint32), ("netns_dev", C.c_uint64),
                ("netns_ino", C.c_uint64), ("btf_id", C.c_uint32), ("btf_key_type_id", C.c_uint32),
                ("btf_value_type_id", C.c_uint32), ("_pad", C.c_uint32), ("map_extra", C.c_uint64),
                ("_rest", C.c_uint8 * 32)]


class UprobeMultiLinkAttr(C.Structure):
    """The link_create member of union bpf_attr, with its uprobe_multi part."""
    _fields_ = [("prog_fd", C.c_uint32), ("target_fd", C.c_uint32), ("attach_type", C.c_uint32),
                ("flags", C.c_uint32), ("path", C.c_uint64), ("offsets", C.c_uint64),
                ("ref_ctr_offsets", C.c_uint64), ("cookies", C.c_uint64), ("cnt", C.c_uint32),
                ("multi_flags", C.c_uint32), ("pid", C.c_uint32), ("_pad", C.c_uint8 * 44)]


def bpf(cmd: int, attr: C.Structure) -> int:
    """bpf(cmd, &attr, sizeof attr): its result, or -1 with ctypes' errno set
    (ENOSYS on an architecture whose number is unknown). As libbpf and BCC
    do: where the kernel charges BPF memory to RLIMIT_MEMLOCK (before Linux
    5.11), a map create or program load refused for it (EPERM) raises the
    limit and is tried once more; a program load the verifier broke off for
    a signal (EAGAIN) is tried again, 5 tries in all."""
    if NR is None:
        C.set_errno(errno.ENOSYS)
        return -1
    raised = False
    err = 0
    for _ in range(5):
        fd = syscall(NR, cmd, C.addressof(attr), C.sizeof(attr))
        if fd >= 0:
            return fd
        err = C.get_errno()
        if err == errno.EPERM and not raised and cmd in (MAP_CREATE, PROG_LOAD):
            raised = True
            try:
                resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY,) * 2)
            except (OSError, ValueError):
                break
        elif not (err == errno.EAGAIN and cmd == PROG_LOAD):
            break
    C.set_errno(err)
    return -1
