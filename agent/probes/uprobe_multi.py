"""uprobe_multi links (Linux 6.6+): one BPF link attaches a program to many
offsets of one file (entry or return), and closing it waits for one grace
period for all of them, where a perf-event uprobe waits for one per probe
(seconds at stop for the GPU probe's dozens of hooks per library). BCC 0.26
has no API for them: the link is made with bpf(BPF_LINK_CREATE) here, for a
program BCC loaded with the uprobe_multi attach type."""

from __future__ import annotations

import ctypes as C
import errno
import os
import struct

from spanlet.probes import bpf_sys

_supported: bool | None = None


def supported() -> bool:
    """Whether this kernel makes uprobe_multi links: as libbpf tells
    (probe_uprobe_multi_link), a two-instruction program loaded for them,
    whose link on "/" the kernel refuses with EBADF (a kernel without them:
    EINVAL). Asked once a process; a millisecond."""
    global _supported
    if _supported is None:
        insns = (C.c_uint64 * 2)(0xB7, 0x95)      # r0 = 0; exit
        license_ = C.create_string_buffer(b"GPL")
        prog = bpf_sys.bpf(bpf_sys.PROG_LOAD, bpf_sys.ProgLoadAttr(
            prog_type=bpf_sys.PROG_TYPE_KPROBE, insn_cnt=2, insns=C.addressof(insns),
            license=C.addressof(license_), expected_attach_type=bpf_sys.TRACE_UPROBE_MULTI))
        if prog < 0:
            _supported = False
        else:
            try:
                fd = link(prog, "/", [0], retprobe=False)
            except OSError as e:
                _supported = e.errno == errno.EBADF
            else:
                os.close(fd)
                _supported = False
            finally:
                os.close(prog)
    return _supported


def link(prog_fd: int, path: str, offsets: list[int], retprobe: bool,
         cookies: list[int] | None = None) -> int:
    """A link of `prog_fd` at the file offsets of `path` (every process that
    maps it), each with its attach cookie (bpf_get_attach_cookie) if given;
    its fd, closed to detach. Raises OSError."""
    path_b = C.create_string_buffer(os.fsencode(path))
    offs = (C.c_uint64 * len(offsets))(*offsets)
    cks = (C.c_uint64 * len(offsets))(*(cookies or [0] * len(offsets)))
    attr = bpf_sys.UprobeMultiLinkAttr(prog_fd=prog_fd, attach_type=bpf_sys.TRACE_UPROBE_MULTI,
                                       path=C.addressof(path_b), offsets=C.addressof(offs), cnt=len(offsets),
                                       cookies=C.addressof(cks) if cookies else 0,
                                       multi_flags=bpf_sys.F_UPROBE_MULTI_RETURN if retprobe else 0)
    fd = bpf_sys.bpf(bpf_sys.LINK_CREATE, attr)
    if fd < 0:
        err = C.get_errno()
        raise OSError(err, f"uprobe_multi link on {path}: {os.strerror(err)}")
    return fd


def file_offsets(path: str, addrs: list[int]) -> list[int]:
    """The file offsets of virtual addresses of a 64-bit little-endian ELF
    file (symbol values), through its PT_LOAD program headers."""
    with open(path, "rb") as f:
        ehdr = f.read(64)
        if ehdr[:4] != b"\x7fELF" or ehdr[4] != 2 or ehdr[5] != 1:
            raise OSError(errno.ENOEXEC, f"{path}: not a 64-bit little-endian ELF file")
        phoff, = struct.unpack_from("<Q", ehdr, 32)
        phentsize, phnum = struct.unpack_from("<HH", ehdr, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    loads = []
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == 1:   # PT_LOAD
            loads.append((p_vaddr, p_filesz, p_offset))
    out = []
    for a in addrs:
        seg = next((s for s in loads if s[0] <= a < s[0] + s[1]), None)
        if seg is None:
            raise OSError(errno.EINVAL, f"{path}: address {a:#x} is in no loaded segment")
        out.append(a - seg[0] + seg[2])
    return out
