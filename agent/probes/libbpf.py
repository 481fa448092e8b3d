"""libbpf (Debian's libbpf1), through ctypes: opens a CO-RE object built with
the package, sets its `const volatile` settings, leaves out the programs a
setting turns off, loads it (relocated against the running kernel's BTF, or
a BTF file given for a kernel without one), pins and reopens the maps that
several objects share by name, and attaches its programs. The bpf(2) calls
the agent makes itself stay in bpf_sys.py; a map here is read through its
fd, with the key and value types its BTF gives (btf.py).

libbpf's own messages go to the `spanlet.libbpf` logger (warnings and up at
WARNING, the rest at DEBUG)."""

from __future__ import annotations

import ctypes as C
import errno
import logging
import os
from pathlib import Path

from .btf import BTF, BTFError

log = logging.getLogger("spanlet.libbpf")
KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")
SONAME = "libbpf.so.1"


class LibbpfError(OSError):
    """A libbpf call failed: what was being done and the kernel's reason."""


class _OpenOpts(C.Structure):
    """struct bpf_object_open_opts (libbpf 1.1)."""
    _fields_ = [("sz", C.c_size_t), ("object_name", C.c_char_p), ("relaxed_maps", C.c_bool),
                ("pin_root_path", C.c_char_p), ("_removed", C.c_uint32), ("kconfig", C.c_char_p),
                ("btf_custom_path", C.c_char_p), ("kernel_log_buf", C.c_char_p),
                ("kernel_log_size", C.c_size_t), ("kernel_log_level", C.c_uint32)]


class _UprobeOpts(C.Structure):
    """struct bpf_uprobe_opts (libbpf 1.1)."""
    _fields_ = [("sz", C.c_size_t), ("ref_ctr_offset", C.c_size_t), ("bpf_cookie", C.c_uint64),
                ("retprobe", C.c_bool), ("func_name", C.c_char_p)]


_lib = None
_PRINT = C.CFUNCTYPE(C.c_int, C.c_int, C.c_char_p, C.c_void_p)
_LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)     # enum libbpf_print_level


def _vformat(fmt: bytes, ap: int) -> str:
    buf = C.create_string_buffer(1 << 16)
    _libc.vsnprintf(buf, len(buf), fmt, ap)
    return buf.value.decode(errors="replace").rstrip("\n")


@_PRINT
def _print(level: int, fmt: bytes, ap: int) -> int:
    lvl = _LEVELS[level] if 0 <= level < len(_LEVELS) else logging.DEBUG
    if log.isEnabledFor(lvl):
        log.log(lvl, "%s", _vformat(fmt, ap))
    return 0


_libc = C.CDLL(None)
_libc.vsnprintf.argtypes = [C.c_char_p, C.c_size_t, C.c_char_p, C.c_void_p]

_SIGNATURES = {
    "bpf_object__open_mem": (C.c_void_p, [C.c_void_p, C.c_size_t, C.POINTER(_OpenOpts)]),
    "bpf_object__load": (C.c_int, [C.c_void_p]),
    "bpf_object__close": (None, [C.c_void_p]),
    "bpf_object__btf": (C.c_void_p, [C.c_void_p]),
    "bpf_object__next_program": (C.c_void_p, [C.c_void_p, C.c_void_p]),
    "bpf_object__next_map": (C.c_void_p, [C.c_void_p, C.c_void_p]),
    "bpf_program__name": (C.c_char_p, [C.c_void_p]),
    "bpf_program__section_name": (C.c_char_p, [C.c_void_p]),
    "bpf_program__set_autoload": (C.c_int, [C.c_void_p, C.c_bool]),
    "bpf_program__autoload": (C.c_bool, [C.c_void_p]),
    "bpf_program__fd": (C.c_int, [C.c_void_p]),
    "bpf_program__attach": (C.c_void_p, [C.c_void_p]),
    "bpf_program__attach_uprobe_opts": (C.c_void_p, [C.c_void_p, C.c_int, C.c_char_p, C.c_size_t,
                                                     C.POINTER(_UprobeOpts)]),
    "bpf_link__destroy": (C.c_int, [C.c_void_p]),
    "bpf_map__name": (C.c_char_p, [C.c_void_p]),
    "bpf_map__fd": (C.c_int, [C.c_void_p]),
    "bpf_map__type": (C.c_int, [C.c_void_p]),
    "bpf_map__key_size": (C.c_uint32, [C.c_void_p]),
    "bpf_map__value_size": (C.c_uint32, [C.c_void_p]),
    "bpf_map__max_entries": (C.c_uint32, [C.c_void_p]),
    "bpf_map__set_max_entries": (C.c_int, [C.c_void_p, C.c_uint32]),
    "bpf_map__set_pin_path": (C.c_int, [C.c_void_p, C.c_char_p]),
    "bpf_map__btf_key_type_id": (C.c_uint32, [C.c_void_p]),
    "bpf_map__btf_value_type_id": (C.c_uint32, [C.c_void_p]),
    "bpf_map__initial_value": (C.c_void_p, [C.c_void_p, C.POINTER(C.c_size_t)]),
    "bpf_map__is_internal": (C.c_bool, [C.c_void_p]),
    "btf__raw_data": (C.c_void_p, [C.c_void_p, C.POINTER(C.c_uint32)]),
    "bpf_map_lookup_elem": (C.c_int, [C.c_int, C.c_void_p, C.c_void_p]),
    "bpf_map_update_elem": (C.c_int, [C.c_int, C.c_void_p, C.c_void_p, C.c_uint64]),
    "bpf_map_delete_elem": (C.c_int, [C.c_int, C.c_void_p]),
    "bpf_map_get_next_key": (C.c_int, [C.c_int, C.c_void_p, C.c_void_p]),
    "bpf_map_lookup_batch": (C.c_int, [C.c_int, C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p,
                                       C.POINTER(C.c_uint32), C.c_void_p]),
    "libbpf_num_possible_cpus": (C.c_int, []),
    "libbpf_set_print": (C.c_void_p, [_PRINT]),
}
# enum bpf_map_type: the per-CPU kinds, whose value is one per possible CPU
_PERCPU_TYPES = {5, 6, 10}        # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH


def lib() -> C.CDLL:
    """libbpf, loaded once, its messages routed to logging."""
    global _lib
    if _lib is None:
        try:
            handle = C.CDLL(SONAME, use_errno=True)
        except OSError as e:
            raise LibbpfError(errno.ENOENT, f"{SONAME} is not installed (Debian: libbpf1): {e}") from None
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype, fn.argtypes = res, args
        handle.libbpf_set_print(_print)
        _lib = handle
    return _lib


def _fail(what: str) -> LibbpfError:
    err = C.get_errno() or errno.EINVAL
    return LibbpfError(err, f"{what}: {os.strerror(err)}")


def kernel_btf(btf_path: str | os.PathLike | None = None) -> Path:
    """The BTF that CO-RE relocates against: `btf_path` if given, else the
    kernel's own. A kernel without BTF gets one clear message."""
    path = Path(btf_path) if btf_path else KERNEL_BTF
    if not path.is_file():
        if btf_path:
            raise LibbpfError(errno.ENOENT, f"bpf.btf_path {path} is not a file")
        raise LibbpfError(errno.ENOENT, f"this kernel has no BTF ({KERNEL_BTF} is missing): give the agent a BTF "
                                        "file for it with bpf.btf_path (for example one of BTFHub's)")
    return path


class Map:
    """A map of a loaded object, read and written through its fd with the
    key and value types of its BTF. As a mapping: map[key] (KeyError when
    absent; a per-CPU map's value is a list, one a possible CPU), map[key] =
    value, del map[key]."""

    def __init__(self, obj: "Object", ptr: int):
        L = lib()
        self._obj, self._ptr = obj, ptr
        self.name = L.bpf_map__name(ptr).decode()
        key_id, value_id = L.bpf_map__btf_key_type_id(ptr), L.bpf_map__btf_value_type_id(ptr)
        self.Key = obj.btf.ctype(key_id) if key_id else C.c_uint8 * L.bpf_map__key_size(ptr)
        self.Leaf = obj.btf.ctype(value_id) if value_id else C.c_uint8 * L.bpf_map__value_size(ptr)
        self.percpu = L.bpf_map__type(ptr) in _PERCPU_TYPES
        if self.percpu:
            self._cpus = L.libbpf_num_possible_cpus()
            self._slot = (C.sizeof(self.Leaf) + 7) // 8 * 8

    def __getitem__(self, key):
        if not self.percpu:
            value = self.lookup(key)
            if value is None:
                raise KeyError(key)
            return value
        buf = C.create_string_buffer(self._slot * self._cpus)
        if lib().bpf_map_lookup_elem(self.fd, C.byref(key), buf) != 0:
            if C.get_errno() == errno.ENOENT:
                raise KeyError(key)
            raise _fail(f"lookup in {self.name}")
        return [self.Leaf.from_buffer_copy(buf, i * self._slot) for i in range(self._cpus)]

    def __setitem__(self, key, value) -> None:
        self.update(key, value)

    def __delitem__(self, key) -> None:
        if not self.delete(key):
            raise KeyError(key)

    @property
    def fd(self) -> int:
        return lib().bpf_map__fd(self._ptr)

    map_fd = fd

    @property
    def max_entries(self) -> int:
        return lib().bpf_map__max_entries(self._ptr)

    def lookup(self, key):
        """The value at key, or None."""
        value = self.Leaf()
        if lib().bpf_map_lookup_elem(self.fd, C.byref(key), C.byref(value)) != 0:
            if C.get_errno() == errno.ENOENT:
                return None
            raise _fail(f"lookup in {self.name}")
        return value

    def update(self, key, value, flags: int = 0) -> None:
        if lib().bpf_map_update_elem(self.fd, C.byref(key), C.byref(value), flags) != 0:
            raise _fail(f"update of {self.name}")

    def delete(self, key) -> bool:
        """Whether there was an entry to delete."""
        if lib().bpf_map_delete_elem(self.fd, C.byref(key)) != 0:
            if C.get_errno() == errno.ENOENT:
                return False
            raise _fail(f"delete in {self.name}")
        return True

    def keys(self) -> list:
        out, key, nxt, first = [], self.Key(), self.Key(), True
        while lib().bpf_map_get_next_key(self.fd, None if first else C.byref(key), C.byref(nxt)) == 0:
            out.append(type(nxt).from_buffer_copy(nxt))
            C.memmove(C.byref(key), C.byref(nxt), C.sizeof(nxt))
            first = False
        return out

    def items(self) -> list:
        return [(k, v) for k in self.keys() if (v := self.lookup(k)) is not None]


class Object:
    """One CO-RE object: opened, set, loaded, attached; close() (or the with
    block's end) detaches and unloads it and leaves its pins."""

    def __init__(self, data: bytes, name: str, *, btf_path: str | os.PathLike | None = None,
                 pin_root: str | os.PathLike | None = None):
        L = lib()
        self.name = name
        self._data = C.create_string_buffer(bytes(data), len(data))     # libbpf keeps no copy before load
        self._opts = _OpenOpts(sz=C.sizeof(_OpenOpts), object_name=name.encode(),
                               pin_root_path=str(pin_root).encode() if pin_root else None,
                               btf_custom_path=str(btf_path).encode() if btf_path else None)
        C.set_errno(0)
        self._ptr = L.bpf_object__open_mem(self._data, len(data), C.byref(self._opts))
        if not self._ptr:
            raise _fail(f"opening the BPF object {name}")
        self.links: list[int] = []
        self.loaded = False
        try:
            size = C.c_uint32(0)
            raw = L.btf__raw_data(L.bpf_object__btf(self._ptr), C.byref(size))
            if not raw:
                raise LibbpfError(errno.EINVAL, f"the BPF object {name} has no BTF (built without -g?)")
            self.btf = BTF(C.string_at(raw, size.value))
        except Exception:
            self.close()
            raise

    @classmethod
    def open_file(cls, path: str | os.PathLike, **kw) -> "Object":
        p = Path(path)
        return cls(p.read_bytes(), p.name.split(".")[0], **kw)

    def __enter__(self) -> "Object":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _each(self, nxt) -> list[int]:
        out, cur = [], None
        while True:
            cur = nxt(self._ptr, cur)
            if not cur:
                return out
            out.append(cur)

    def _find(self, what: str, name: str) -> int:
        L = lib()
        nxt, name_of = ((L.bpf_object__next_program, L.bpf_program__name) if what == "program"
                        else (L.bpf_object__next_map, L.bpf_map__name))
        for ptr in self._each(nxt):
            if name_of(ptr).decode() == name:
                return ptr
        raise KeyError(f"{self.name} has no {what} {name}")

    def _program(self, name: str) -> int:
        return self._find("program", name)

    def programs(self) -> dict[str, str]:
        """Each program's name → its section (what it attaches to)."""
        L = lib()
        return {L.bpf_program__name(p).decode(): L.bpf_program__section_name(p).decode()
                for p in self._each(L.bpf_object__next_program)}

    def _map_ptr(self, name: str) -> int:
        return self._find("map", name)

    def maps(self) -> list[str]:
        L = lib()
        return [L.bpf_map__name(m).decode() for m in self._each(L.bpf_object__next_map)
                if not L.bpf_map__is_internal(m)]

    def __getitem__(self, name: str | bytes) -> Map:
        return Map(self, self._map_ptr(name.decode() if isinstance(name, bytes) else name))

    # Before load

    def _rodata(self) -> tuple[int, int]:
        L = lib()
        for m in self._each(L.bpf_object__next_map):
            if L.bpf_map__is_internal(m) and L.bpf_map__name(m).decode().endswith(".rodata"):
                size = C.c_size_t(0)
                return L.bpf_map__initial_value(m, C.byref(size)), size.value
        raise KeyError(f"{self.name} has no settings (.rodata)")

    def set(self, **settings: int) -> "Object":
        """Its `const volatile` settings (integers), by name, before load."""
        if self.loaded:
            raise LibbpfError(errno.EBUSY, f"{self.name}: settings are given before load")
        where = self.btf.datasec_vars(".rodata")
        addr, size = self._rodata()
        for name, value in settings.items():
            if name not in where:
                raise KeyError(f"{self.name} has no setting {name}")
            off, width = where[name]
            if off + width > size:
                raise BTFError(f"{self.name}: setting {name} lies past .rodata")
            C.memmove(addr + off, int(value).to_bytes(width, "little", signed=value < 0), width)
        return self

    def settings(self) -> dict[str, int]:
        """Its integer settings as they stand (set, or as built)."""
        addr, size = self._rodata()
        out = {}
        for name, (off, width) in self.btf.datasec_vars(".rodata").items():
            if width in (1, 2, 4, 8) and off + width <= size and not name.startswith("spanlet_btf_"):
                out[name] = int.from_bytes(C.string_at(addr + off, width), "little")
        return out

    def describe(self) -> list[str]:
        """Its settings, programs (loaded or left out) and maps, a line each."""
        L = lib()
        lines = [f"settings: {' '.join(f'{k}={v}' for k, v in self.settings().items())}"]
        for p in self._each(L.bpf_object__next_program):
            lines.append(f"program {L.bpf_program__name(p).decode()}: {L.bpf_program__section_name(p).decode()}"
                         f"{'' if L.bpf_program__autoload(p) else ' (left out)'}")
        for m in self._each(L.bpf_object__next_map):
            if not L.bpf_map__is_internal(m):
                lines.append(f"map {L.bpf_map__name(m).decode()}: type {L.bpf_map__type(m)}, key "
                             f"{L.bpf_map__key_size(m)} B, value {L.bpf_map__value_size(m)} B, "
                             f"max_entries {L.bpf_map__max_entries(m)}")
        return lines

    def autoload(self, program: str, on: bool) -> "Object":
        """Whether a program is loaded at all (a setting that turns it off: not)."""
        if lib().bpf_program__set_autoload(self._program(program), on) != 0:
            raise _fail(f"{self.name}: autoload of {program}")
        return self

    def resize(self, map_name: str, max_entries: int) -> "Object":
        if lib().bpf_map__set_max_entries(self._map_ptr(map_name), max_entries) != 0:
            raise _fail(f"{self.name}: max entries of {map_name}")
        return self

    def pin(self, map_name: str, path: str | os.PathLike) -> "Object":
        """Pin a map at this path (reused if a map is pinned there already)."""
        if lib().bpf_map__set_pin_path(self._map_ptr(map_name), str(path).encode()) != 0:
            raise _fail(f"{self.name}: pin path of {map_name}")
        return self

    def load(self) -> "Object":
        C.set_errno(0)
        if lib().bpf_object__load(self._ptr) != 0:
            raise _fail(f"loading the BPF object {self.name} (libbpf's messages above say where)")
        self.loaded = True
        return self

    # After load

    def program_fd(self, name: str) -> int:
        return lib().bpf_program__fd(self._program(name))

    def attach(self, program: str) -> int:
        """Attach by the program's section (tracepoints, tp_btf, raw tracepoints)."""
        return self._link(lib().bpf_program__attach(self._program(program)), f"attaching {program}")

    def attach_uprobe(self, program: str, binary: str | os.PathLike, *, symbol: str | None = None,
                      offset: int = 0, pid: int = -1, ret: bool = False) -> int:
        """A uprobe (or uretprobe) on `symbol` (or at `offset`) of a binary, for one process or all (-1)."""
        opts = _UprobeOpts(sz=C.sizeof(_UprobeOpts), retprobe=ret,
                           func_name=symbol.encode() if symbol else None)
        ptr = lib().bpf_program__attach_uprobe_opts(self._program(program), pid, str(binary).encode(), offset,
                                                    C.byref(opts))
        return self._link(ptr, f"attaching {program} to {binary}:{symbol or hex(offset)}")

    def _link(self, ptr: int, what: str) -> int:
        if not ptr:
            raise _fail(f"{self.name}: {what}")
        self.links.append(ptr)
        return ptr

    def detach(self, link: int) -> None:
        self.links.remove(link)
        lib().bpf_link__destroy(link)

    def close(self) -> None:
        L = lib()
        for link in self.links:
            L.bpf_link__destroy(link)
        self.links = []
        if self._ptr:
            L.bpf_object__close(self._ptr)
            self._ptr = None
