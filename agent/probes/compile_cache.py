"""Compiled probes kept between starts (data_dir/bpf-cache): a start whose
program text, flags, kernel, headers and BCC are those of an earlier start
loads that start's instructions into a module of its own maps instead of
compiling them again (BCC 0.26 compiles each time and cannot load an object).

What a compile leaves is read from BCC's module right after it: each map's
kernel attributes (type, sizes, entries, flags, name, from the kernel's own
map info), the key and value type descriptions BCC's Python tables are built
from, whether the map is a pin (BPF_TABLE_PINNED, its path checked against
the kernel's map id), and each function's instructions with the map fds in
them turned back into map indexes. A cached start makes the maps (a pin is
opened, or made and pinned where absent, as BCC does), writes their fds into
the instructions and hands the module to bcc.BPF in place of a compile:
tables, program loads, attaching and cleanup are BCC's own code, through a
stand-in of libbcc's module calls (`_Lib`) that answers them for a cached
module and passes every other call on. Programs are loaded into the verifier
as ever.

Anything unexpected (a file that does not parse, a map that cannot be made,
an instruction kind this does not know) is logged and the probe compiled as
without a cache; an unexpected compile result is not cached."""

from __future__ import annotations

import base64
import ctypes as C
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from spanlet.probes import bpf_sys

log = logging.getLogger(__name__)

FORMAT = 1                 # of the files; part of the key
CACHE_DIR = "bpf-cache"    # under data_dir
MAX_FILES = 64             # kept, the least recently used removed past it
ASIDE_TIMEOUT_S = 120.0    # a compile in a process of its own (compile_aside) waited for at most

# prefixes bcc's program load leaves out of a program's kernel name (libbpf.c)
_NAME_PREFIXES = ("kprobe__", "kretprobe__", "tracepoint__", "raw_tracepoint__", "kfunc__",
                  "kretfunc__", "lsm__")

# The kernel symbols a BCC 0.26 compile looks up (its clang frontend asks
# whether bpf_probe_read_kernel and, for a program that reads user memory,
# bpf_probe_read_user exist), reading the whole of /proc/kallsyms for each:
# 0.1 to 0.2 s of a compile's CPU on the 2-core development VM.
COMPILE_KSYMS = ("bpf_probe_read_kernel", "bpf_probe_read_user")
BTF_VMLINUX = "/sys/kernel/btf/vmlinux"
_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE, _MNT_DETACH = 0x00020000, 4096, 0x4000, 1 << 18, 2

_libc = C.CDLL(None, use_errno=True)


class CacheError(Exception):
    """A cached module could not be used or a compile could not be cached."""


def _fail(what: str) -> CacheError:
    err = C.get_errno()
    return CacheError(f"{what}: {os.strerror(err)}")


def map_info(fd: int) -> bpf_sys.MapInfo:
    info = bpf_sys.MapInfo()
    attr = bpf_sys.InfoAttr(bpf_fd=fd, info_len=C.sizeof(info), info=C.addressof(info))
    if bpf_sys.bpf(bpf_sys.OBJ_GET_INFO_BY_FD, attr) < 0:
        raise _fail(f"map info of fd {fd}")
    return info


def _obj_get(path: str) -> int:
    p = C.create_string_buffer(os.fsencode(path))
    return bpf_sys.bpf(bpf_sys.OBJ_GET, bpf_sys.ObjAttr(pathname=C.addressof(p)))


def _obj_pin(fd: int, path: str) -> int:
    p = C.create_string_buffer(os.fsencode(path))
    return bpf_sys.bpf(bpf_sys.OBJ_PIN, bpf_sys.ObjAttr(pathname=C.addressof(p), bpf_fd=fd))


# -- what a compile left, read from BCC's module --------------------------------
_PINNED = re.compile(r"\bBPF_TABLE_PINNED\s*\(([^;]*?)\)\s*;", re.S)
_STRING_DEFINE = re.compile(r'^-D(\w+)="(.*)"$')
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|(\w+)')


def pinned_candidates(text: str, flags: list[str]) -> dict[str, str]:
    """Table name → pin path of each BPF_TABLE_PINNED whose path is made of
    string literals and -D string macros of `flags` (a declaration naming a
    macro that is not defined is in a branch not compiled)."""
    defines = {m.group(1): m.group(2) for f in flags if (m := _STRING_DEFINE.match(f))}
    out = {}
    found = list(_PINNED.finditer(text))
    if len(found) != len(re.findall(r"\bBPF_TABLE_PINNED\b", text)):
        raise CacheError("a BPF_TABLE_PINNED this cannot read")
    for m in found:
        args = [a.strip() for a in m.group(1).split(",")]
        if len(args) < 6:
            raise CacheError(f"a BPF_TABLE_PINNED this cannot read: {m.group(0)[:80]}")
        path, ok = "", True
        for lit, ident in _TOKEN.findall(args[5]):     # (type, key, leaf, name, max, path[, flags])
            if ident:
                if ident not in defines:
                    ok = False
                    break
                path += defines[ident]
            else:
                path += lit
        if ok:
            out[args[3]] = path
    return out


def _module_calls():
    """libbcc's module calls this reads, their types declared (bcc's Python
    binds only some)."""
    from bcc.libbcc import lib
    sz, vp = C.c_size_t, C.c_void_p
    for name, res, args in (("bpf_num_tables", sz, [vp]), ("bpf_table_name", C.c_char_p, [vp, sz]),
                            ("bpf_table_fd_id", C.c_int, [vp, sz])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def capture(module, text: str, flags: list[str], templates: dict[str, str]) -> dict:
    """The image of a module BCC just compiled (and made the maps of): see
    the module's doc. `templates` (real string → placeholder) are taken out
    of the pin paths. Raises CacheError where the module holds what this
    does not know how to make again."""
    lib = _module_calls()
    pins = pinned_candidates(text, flags)
    tables, by_fd = [], {}
    for i in range(lib.bpf_num_tables(module)):
        name = lib.bpf_table_name(module, i)
        fd = lib.bpf_table_fd_id(module, i)
        if fd < 0:
            raise CacheError(f"table {name!r} has no fd")
        info = map_info(fd)
        pin = pins.get(name.decode())
        # A pinned table is opened again where its pin is (the span context
        # maps, which the CO-RE span_ctx object makes with BTF); only a table
        # this makes itself must need none.
        if info.btf_id and pin is None:
            raise CacheError(f"table {name.decode()} has BTF, which this does not make again")
        key_desc = lib.bpf_table_key_desc(module, name)
        leaf_desc = lib.bpf_table_leaf_desc(module, name)
        if pin is not None:
            pfd = _obj_get(pin)
            if pfd < 0:
                raise _fail(f"pin {pin} of table {name.decode()}")
            try:
                if map_info(pfd).id != info.id:
                    raise CacheError(f"pin {pin} is not table {name.decode()}")
            finally:
                os.close(pfd)
            for real, placeholder in templates.items():
                pin = pin.replace(real, placeholder)
        tables.append({
            "name": name.decode(), "type": info.type, "key_size": info.key_size,
            "value_size": info.value_size, "max_entries": info.max_entries,
            "map_flags": info.map_flags, "kname": info.name.decode(),
            "bcc_type": lib.bpf_table_type_id(module, i), "bcc_flags": lib.bpf_table_flags_id(module, i),
            "bcc_max_entries": lib.bpf_table_max_entries_id(module, i),
            "key_desc": (key_desc or b"").decode(), "leaf_desc": (leaf_desc or b"").decode(),
            "pin": pin})
        by_fd[fd] = i
    funcs = []
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        start, size = lib.bpf_function_start(module, name), lib.bpf_function_size(module, name)
        if not start or size % 8:
            raise CacheError(f"function {name!r}: no instructions")
        insns = bytearray(C.string_at(start, size))
        relocs = []
        for at in range(0, size, 8):
            if insns[at] != bpf_sys.LD_IMM64:
                continue
            src = insns[at + 1] >> 4
            if src == 0:
                continue
            imm = int.from_bytes(insns[at + 4:at + 8], "little", signed=True)
            if src != bpf_sys.PSEUDO_MAP_FD or imm not in by_fd:
                raise CacheError(f"function {name.decode()}: a 64-bit load of kind {src} "
                                 f"(imm {imm}) is not a map of the module")
            relocs.append([at // 8, by_fd[imm]])
            insns[at + 4:at + 8] = b"\0\0\0\0"
        funcs.append({"name": name.decode(), "insns": base64.b64encode(bytes(insns)).decode(),
                      "maps": relocs})
    return {"format": FORMAT, "license": lib.bpf_module_license(module).decode(),
            "kern_version": lib.bpf_module_kern_version(module), "tables": tables,
            "functions": funcs}


# -- a module made from an image --------------------------------------------------
class CachedModule:
    """Stands for a libbcc module in bcc's calls (see _Lib): the maps of an
    image made (or pins opened) and its functions' instructions with their fds."""

    def __init__(self, image: dict, templates: dict[str, str]):
        if image.get("format") != FORMAT:
            raise CacheError("another format")
        self.license = image["license"].encode()
        self.kern_version = int(image["kern_version"])
        self.tables = image["tables"]
        self.fds: list[int] = []
        self._names = {t["name"].encode(): i for i, t in enumerate(self.tables)}
        try:
            for t in self.tables:
                self.fds.append(self._open_map(t, templates))
            self.funcs: dict[bytes, C.Array] = {}
            self.func_names: list[bytes] = []
            for f in image["functions"]:
                insns = bytearray(base64.b64decode(f["insns"]))
                for at, table in f["maps"]:
                    insns[at * 8 + 4:at * 8 + 8] = self.fds[table].to_bytes(4, "little", signed=True)
                name = f["name"].encode()
                self.funcs[name] = (C.c_char * len(insns)).from_buffer_copy(insns)
                self.func_names.append(name)
        except Exception:
            self.destroy()
            raise

    @staticmethod
    def _open_map(t: dict, templates: dict[str, str]) -> int:
        pin = t["pin"]
        if pin is not None:
            for real, placeholder in templates.items():
                pin = pin.replace(placeholder, real)
            fd = _obj_get(pin)
            if fd >= 0:
                try:
                    info = map_info(fd)
                    if (info.type, info.key_size, info.value_size) != (t["type"], t["key_size"],
                                                                       t["value_size"]):
                        raise CacheError(f"pin {pin} is another map")
                except BaseException:
                    os.close(fd)
                    raise
                return fd
            if C.get_errno() != errno.ENOENT:
                raise _fail(f"pin {pin}")
        # made as BCC makes it: the declared bound, flags and name (a pin
        # another tool made first reports that tool's)
        attr = bpf_sys.MapCreateAttr(map_type=t["type"], key_size=t["key_size"], value_size=t["value_size"],
                                     max_entries=t["bcc_max_entries"], map_flags=t["bcc_flags"],
                                     map_name=t["name"].encode()[:bpf_sys.OBJ_NAME_LEN - 1])
        fd = bpf_sys.bpf(bpf_sys.MAP_CREATE, attr)
        if fd < 0:
            raise _fail(f"map {t['name']}")
        if pin is not None and _obj_pin(fd, pin) < 0:
            err = _fail(f"pin {pin}")
            os.close(fd)
            raise err
        return fd

    def destroy(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []

    # the module calls bcc makes, answered
    def table_id(self, name: bytes) -> int:
        return self._names.get(name, 2**64 - 1)

    def table_fd(self, name: bytes) -> int:
        i = self._names.get(name)
        return -1 if i is None or i >= len(self.fds) else self.fds[i]

    def table(self, i: int) -> dict:
        return self.tables[i] if 0 <= i < len(self.tables) else _NO_TABLE

    def load(self, prog_type: int, name: bytes, start, size: int, license_: bytes,
             kern_version: int, log_level: int, log_buf, log_size: int, device, attach_type: int) -> int:
        """bcc_func_load for a cached module: the program into the verifier,
        its fd or -1 with errno set (the verifier's log then logged)."""
        kname = name
        for prefix in _NAME_PREFIXES:
            if kname.startswith(prefix.encode()):
                kname = kname[len(prefix):]
                break
        lic = C.create_string_buffer(license_)
        ifname = device.decode() if isinstance(device, bytes) else device
        attr = bpf_sys.ProgLoadAttr(prog_type=prog_type, insn_cnt=size // 8, insns=start,
                                    license=C.addressof(lic), kern_version=kern_version,
                                    prog_name=kname[:bpf_sys.OBJ_NAME_LEN - 1],
                                    prog_ifindex=0 if device is None else socket.if_nametoindex(ifname),
                                    expected_attach_type=attach_type if attach_type >= 0 else 0)
        fd = bpf_sys.bpf(bpf_sys.PROG_LOAD, attr)
        if fd < 0:
            err = C.get_errno()
            buf = C.create_string_buffer(1 << 20)
            attr.log_level, attr.log_size, attr.log_buf = 1, len(buf), C.addressof(buf)
            again = bpf_sys.bpf(bpf_sys.PROG_LOAD, attr)
            if again >= 0:                  # passed the second time
                return again
            log.warning("cached program %s refused: %s\n%s", name.decode(), os.strerror(err),
                      buf.value.decode(errors="replace")[-4000:])
            C.set_errno(err)
        return fd


_NO_TABLE = {"bcc_type": -1, "bcc_flags": -1, "bcc_max_entries": 0}   # libbcc's answers for no table

_HANDLERS = {
    "bpf_module_destroy": lambda m: m.destroy(),
    "bpf_module_license": lambda m: m.license,
    "bpf_module_kern_version": lambda m: m.kern_version,
    "bpf_num_functions": lambda m: len(m.func_names),
    "bpf_function_name": lambda m, i: m.func_names[i] if i < len(m.func_names) else None,
    "bpf_function_start": lambda m, n: C.addressof(m.funcs[n]) if n in m.funcs else None,
    "bpf_function_size": lambda m, n: len(m.funcs[n]) if n in m.funcs else 0,
    "bcc_func_load": lambda m, *a: m.load(*a),
    "bpf_num_tables": lambda m: len(m.tables),
    "bpf_table_name": lambda m, i: m.tables[i]["name"].encode() if i < len(m.tables) else None,
    "bpf_table_fd_id": lambda m, i: m.fds[i] if i < len(m.fds) else -1,
    "bpf_table_id": lambda m, n: m.table_id(n),
    "bpf_table_fd": lambda m, n: m.table_fd(n),
    "bpf_table_type_id": lambda m, i: m.table(i)["bcc_type"],
    "bpf_table_flags_id": lambda m, i: m.table(i)["bcc_flags"],
    "bpf_table_max_entries_id": lambda m, i: m.table(i)["bcc_max_entries"],
    "bpf_table_key_desc": lambda m, n: (m.table(m._names[n])["key_desc"].encode()
                                        if n in m._names else None),
    "bpf_table_leaf_desc": lambda m, n: (m.table(m._names[n])["leaf_desc"].encode()
                                         if n in m._names else None),
}


class _Lib:
    """libbcc as bcc's Python modules call it: a module call whose module is
    a CachedModule is answered by it, and a compile call answered with the
    module handed in by `pending` (see cached_bpf); anything else is libbcc's
    own function (looked up once, then an attribute of this object)."""

    def __init__(self, real):
        self._real = real
        self.pending = threading.local()

    def __getattr__(self, name: str):
        fn = getattr(self._real, name)
        handler = _HANDLERS.get(name)
        if name == "bpf_module_create_c_from_string":
            def create(*args, _fn=fn):
                module = getattr(self.pending, "module", None)
                return module if module is not None else _fn(*args)
            value = create
        elif handler is not None:
            def call(*args, _fn=fn, _h=handler):
                return _h(*args) if args and isinstance(args[0], CachedModule) else _fn(*args)
            value = call
        else:
            value = fn
        setattr(self, name, value)
        return value


_installed: _Lib | None = None
_install_lock = threading.Lock()


def _install() -> _Lib:
    """Put _Lib in place of libbcc in the bcc modules that call it with a module."""
    global _installed
    with _install_lock:
        if _installed is None:
            import bcc
            import bcc.table
            _module_calls()
            proxy = _Lib(bcc.libbcc.lib)
            bcc.lib = proxy
            bcc.table.lib = proxy
            _installed = proxy
        return _installed


def cached_bpf(image: dict, text: str, flags: list[str], templates: dict[str, str]):
    """A bcc.BPF over the image's maps and instructions, made as BCC makes one
    (its tracepoint autoload included) but for the compile. Raises
    CacheError (or OSError) where the maps cannot be made."""
    from bcc import BPF
    proxy = _install()
    module = CachedModule(image, templates)
    proxy.pending.module = module
    bpf = BPF.__new__(BPF)
    try:
        bpf.__init__(text=text, cflags=flags)
        return bpf
    except Exception:
        try:
            bpf.cleanup()       # what its tracepoint autoload attached, its fds
        except Exception:
            pass
        module.destroy()
        raise
    finally:
        proxy.pending.module = None


# -- the key and the files ---------------------------------------------------------
def _file_id(path: str) -> str:
    """A file by its contents (small files: headers)."""
    try:
        with open(path, "rb") as f:
            return f"{os.path.realpath(path)}:{hashlib.sha256(f.read()).hexdigest()}"
    except OSError:
        return f"{path}:-"


def _libbcc_id() -> str:
    """The libbcc this process mapped: its path, device and inode (a library
    replaced under a running agent is another inode), size and time."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libbcc.so" in line:
                    fields = line.split(maxsplit=5)
                    path = fields[5].strip()
                    try:
                        st = os.stat(path)
                        return f"{path}:{fields[3]}:{fields[4]}:{st.st_size}:{st.st_mtime_ns}"
                    except OSError:
                        return f"{path}:{fields[3]}:{fields[4]}"
    except OSError:
        pass
    return "libbcc"


# what BCC reads from the environment that changes a compile (loader.cc, kbuild_helper.cc)
_BCC_ENV = ("BCC_KERNEL_SOURCE", "BCC_LINUX_VERSION_CODE", "BCC_KERNEL_MODULES_SUFFIX", "ARCH")
_HEADER_FILES = ("include/generated/autoconf.h", "include/generated/utsrelease.h",
                 "include/generated/uapi/linux/version.h", "include/linux/kconfig.h")


def cache_key(text: str, flags: list[str], templates: dict[str, str]) -> str:
    """What a compile's result depends on: the text and flags (placeholders
    for the strings of `templates`), the kernel (release and build), its
    headers (the contents of their generated configuration and version files,
    in BCC_KERNEL_SOURCE or /lib/modules/<release>/build and source), what
    else of the environment BCC reads, BCC (its version and library file)
    and this format."""
    import bcc
    norm = []
    for f in flags:
        for real, placeholder in templates.items():
            f = f.replace(real, placeholder)
        norm.append(f)
    uname = os.uname()
    try:
        kernel = Path("/proc/version").read_text()
    except OSError:
        kernel = ""
    given = os.environ.get("BCC_KERNEL_SOURCE")
    trees = [given] if given else [f"/lib/modules/{uname.release}/{d}" for d in ("build", "source")]
    parts = [str(FORMAT), bcc.__version__, _libbcc_id(), uname.release, uname.machine, kernel,
             json.dumps({k: os.environ.get(k) for k in _BCC_ENV}),
             *(_file_id(os.path.join(tree, p)) for tree in trees for p in _HEADER_FILES),
             json.dumps(norm), text]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _job(text: str, flags: list[str], templates: dict[str, str]) -> str:
    """A compile by what it was given (no libbcc needed, unlike cache_key)."""
    return hashlib.sha256(json.dumps([text, flags, templates]).encode()).hexdigest()


def compile_ksyms(btf: str = BTF_VMLINUX) -> str | None:
    """The lines of /proc/kallsyms that a compile reads (COMPILE_KSYMS), for
    the symbols the kernel's BTF names (a read of 8 ms where the kallsyms
    table takes 80), each with an address that stands for its own (BCC asks
    only whether the symbol is there). None where there is no BTF to tell."""
    try:
        with open(btf, "rb") as f:
            data = f.read()
        magic, _, _, hdr_len, _, _, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
    except (OSError, struct.error):
        return None
    if magic != 0xEB9F:
        return None
    names = data[hdr_len + str_off:hdr_len + str_off + str_len]
    return "".join(f"ffffffff81000000 T {n}\n" for n in COMPILE_KSYMS if f"\0{n}\0".encode() in names)


def _own_kallsyms(lines: str) -> bool:
    """This thread (a process's only thread, or one of several: it gets a
    root and working folder of its own too) and the processes it starts see
    `lines` as /proc/kallsyms: a mount namespace of its own, no mount event
    shared with the node's, a file of the lines bound over it. False where
    that cannot be made (no CAP_SYS_ADMIN): the compile then reads the
    node's table."""
    if _libc.unshare(_CLONE_NEWNS) != 0:
        return False
    if _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    # the lines the thread that started this process bound there, if it did
    # (a file deleted since: nothing can be mounted on it)
    _libc.umount2(b"/proc/kallsyms", _MNT_DETACH)
    with tempfile.NamedTemporaryFile("w", prefix="spanlet-kallsyms-") as f:
        f.write(lines)
        f.flush()
        return _libc.mount(f.name.encode(), b"/proc/kallsyms", None, _MS_BIND, None) == 0


def own_kallsyms_in_this_thread() -> bool:
    """The compiles this thread makes read compile_ksyms()' lines, not the
    node's whole table (0.1 s of CPU a compile on the 2-core development
    VM, more on a node with the GPU driver's modules loaded): the thread
    alone gets a mount namespace of its own (_own_kallsyms), which ends with
    it. False where it could not be made (the compiles then read the node's
    table)."""
    lines = compile_ksyms()
    return bool(lines) and _own_kallsyms(lines)


class CompileCache:
    """data_dir/bpf-cache: one file per key, written whole (a temporary file
    renamed), read only from a folder and files of this user that nobody else
    can write (the agent loads what it reads into the kernel); at most
    MAX_FILES, the least recently used removed past it."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.hits = 0
        self.misses = 0
        # job → (process, pin folder, stderr); a job is its text, flags and templates (_job)
        self._aside: dict[str, tuple[subprocess.Popen, str, object]] = {}
        self._ksyms: str | None = None       # compile_ksyms(), read at the first compile_aside

    @staticmethod
    def _alone(fd: int) -> bool:
        st = os.fstat(fd)
        return st.st_uid == os.geteuid() and not st.st_mode & 0o022

    def _open_folder(self, create: bool) -> int | None:
        """The folder's fd (never through a symbolic link), or None where it
        is missing or not this user's alone (logged)."""
        if create:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        if not self._alone(fd):
            os.close(fd)
            log.warning("compile cache %s: not this user's alone; not used", self.folder)
            return None
        return fd

    def read(self, key: str) -> dict | None:
        name = f"{key}.json"
        try:
            folder = self._open_folder(create=False)
            if folder is None:
                return None
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
                with open(fd, "rb") as f:
                    if not (stat.S_ISREG(os.fstat(fd).st_mode) and self._alone(fd)):
                        log.warning("compile cache %s/%s: not this user's alone; not used",
                                    self.folder, name)
                        return None
                    image = json.load(f)
                os.utime(name, dir_fd=folder)      # used: the last to be removed
                return image
            finally:
                os.close(folder)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("compile cache %s/%s: %s; compiling", self.folder, name, e)
            return None

    def write(self, key: str, image: dict) -> None:
        tmp = f".{key}.{os.getpid()}.{threading.get_ident()}"
        folder = None
        try:
            folder = self._open_folder(create=True)
            if folder is None:
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
            try:
                with open(fd, "w") as f:
                    json.dump(image, f, separators=(",", ":"))
                os.replace(tmp, f"{key}.json", src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=folder)
                except OSError:
                    pass
                raise
            self._prune()
        except OSError as e:
            log.warning("compile cache %s: not written: %s", self.folder, e)
        finally:
            if folder is not None:
                os.close(folder)

    def remove(self, key: str) -> None:
        """A file that could not be used: the next start compiles and writes it again."""
        try:
            (self.folder / f"{key}.json").unlink()
        except OSError:
            pass

    def _prune(self) -> None:
        """Past MAX_FILES, the least recently used files go (each
        configuration, kernel or BCC makes its own)."""
        files = []
        for p in self.folder.glob("*.json"):
            try:
                files.append((p.stat().st_mtime_ns, p))
            except OSError:
                continue
        for _, p in sorted(files)[:max(0, len(files) - MAX_FILES)]:
            try:
                p.unlink()
            except OSError:
                pass

    def compile(self, text: str, flags: list[str], templates: dict[str, str] | None = None):
        """A bcc.BPF of the text and flags: from the cache where it holds this
        key (`hit` True), else compiled by BCC and its image written. Raises
        what BCC raises for a compile that fails."""
        from bcc import BPF
        templates = templates or {}
        self._await_aside(_job(text, flags, templates))
        key = cache_key(text, flags, templates)
        image = self.read(key)
        if image is not None:
            try:
                bpf = cached_bpf(image, text, flags, templates)
                self.hits += 1
                return bpf, True
            except Exception as e:    # bcc raises bare Exception; a file may hold anything
                log.warning("compile cache %s: %s; compiling", key[:12], e)
                self.remove(key)
        _install()
        bpf = BPF(text=text, cflags=flags)
        self.misses += 1
        try:
            image = capture(bpf.module, text, flags, templates)
        except Exception as e:        # the compile stands; only the cache goes without
            log.info("compile cache: not kept: %s", e)
            return bpf, False
        self.write(key, image)
        return bpf, False

    # -- compiles in processes of their own --------------------------------------
    def compile_aside(self, jobs: list[tuple[str, list[str], dict[str, str]]], pin_root: str | Path) -> int:
        """Begin, each in a process of its own, the compiles of the jobs
        ((text, flags, templates), as compile() takes them) whose key the
        cache does not hold. BCC compiles one module at a time in a process
        (iovisor/bcc#4500), but processes compile side by side: a node's
        first start compiles its probes on as many cores as it has. Each
        process writes its image to the cache and ends; compile() of the
        same key waits for it, then loads the image. A process's maps (BCC
        makes them at the compile) are its own and end with it, its pins in
        a folder of its own under pin_root (named by its pid, so that a
        start after a crash removes them as a dead agent's). Returns the
        number of processes begun; one that cannot begin is logged, and
        that probe is compiled in compile() as without this."""
        begun = 0
        if self._ksyms is None:
            self._ksyms = compile_ksyms() or ""
        # an empty cache (a node's first start) holds none of them: the keys,
        # which load libbcc (0.1 s), are then not needed before the processes begin
        empty = not any(self.folder.glob("*.json"))
        for text, flags, templates in jobs:
            job = _job(text, flags, templates)
            if job in self._aside or len(templates) > 1:
                continue
            if not empty and (self.folder / f"{cache_key(text, flags, templates)}.json").exists():
                continue
            stderr = None
            try:
                with tempfile.TemporaryFile() as request:
                    request.write(json.dumps({"folder": str(self.folder), "pin_root": str(pin_root),
                                              "text": text, "flags": flags, "templates": templates,
                                              "ksyms": self._ksyms or None}).encode())
                    request.seek(0)
                    stderr = tempfile.TemporaryFile()
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
                    proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=request,
                                            stdout=subprocess.DEVNULL, stderr=stderr, env=env)
            except OSError as e:
                log.warning("compile cache: no process of its own for a compile: %s", e)
                if stderr is not None:
                    stderr.close()
                continue
            self._aside[job] = (proc, os.path.join(pin_root, f"{proc.pid}-compile"), stderr)
            begun += 1
        return begun

    def aside_running(self, text: str, flags: list[str], templates: dict[str, str]) -> bool:
        """Whether a process begun by compile_aside still compiles this job."""
        entry = self._aside.get(_job(text, flags, templates))
        return entry is not None and entry[0].poll() is None

    def _await_aside(self, job: str, timeout_s: float = ASIDE_TIMEOUT_S) -> None:
        """Wait for the process compiling `job`, if one was begun; where it
        failed its reason is logged (the caller compiles)."""
        entry = self._aside.pop(job, None)
        if entry is None:
            return
        proc, pins, stderr = entry
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        self._end_aside(proc, pins)
        with stderr:
            stderr.seek(0)
            said = stderr.read().decode(errors="replace").strip()
        if rc == 0 and said:
            log.debug("compile cache: the compile in a process of its own said: %s", said)
        if rc != 0:
            log.info("compile cache: the compile in a process of its own %s%s; compiling here",
                     "took too long" if rc is None else f"ended with {rc}",
                     f": {said.splitlines()[-1]}" if said else "")

    @staticmethod
    def _end_aside(proc: subprocess.Popen, pins: str) -> None:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(pins, ignore_errors=True)     # what a killed process left

    def abandon_aside(self) -> None:
        """End the compiles in processes of their own nobody waited for (a
        probe that failed before its compile)."""
        for job in list(self._aside):
            proc, pins, stderr = self._aside.pop(job)
            self._end_aside(proc, pins)
            stderr.close()


def _compile_aside_main() -> int:
    """A compile_aside() process: the request on stdin; its image written
    to the cache under the key the agent computes for the same text and
    flags (the pin folder in them, this process's own, is a placeholder in
    the key). The module is made as bcc.BPF makes it, without loading or
    attaching anything; its maps and pins are removed when it ends."""
    request = json.load(sys.stdin)
    text, flags, templates = request["text"], request["flags"], request["templates"]
    if request.get("ksyms") and not _own_kallsyms(request["ksyms"]):
        print("compile cache: /proc/kallsyms of its own not made; the compile reads the node's",
              file=sys.stderr)
    pins = os.path.join(request["pin_root"], f"{os.getpid()}-compile")
    for real, placeholder in list(templates.items()):      # at most one: the pin folder
        flags = [f.replace(real, pins) for f in flags]
        templates = {pins: placeholder}
    os.makedirs(pins, exist_ok=True)
    try:
        lib = _module_calls()
        usdt = lib.bcc_usdt_genargs((C.c_void_p * 0)(), 0)
        cflags = (C.c_char_p * len(flags))(*(f.encode() for f in flags))
        module = lib.bpf_module_create_c_from_string(usdt + text.encode(), 0, cflags, len(flags), True, None)
        if not module:
            print("the compile failed", file=sys.stderr)
            return 1
        try:
            image = capture(module, text, flags, templates)
        finally:
            lib.bpf_module_destroy(module)
        CompileCache(request["folder"]).write(cache_key(text, flags, templates), image)
        return 0
    finally:
        shutil.rmtree(pins, ignore_errors=True)


_PIN_DIR_FLAG = re.compile(r'^-DSPANLET_PIN_DIR="(.+)"$')
_caches: dict[str, CompileCache] = {}


def pin_templates(flags: list[str]) -> dict[str, str]:
    """The agent's own pin folder (SPANLET_PIN_DIR, another at each start)
    as a placeholder: the instructions do not depend on it."""
    return {m.group(1): "{pin_dir}" for f in flags if (m := _PIN_DIR_FLAG.match(f))}


def cache_of(cfg) -> CompileCache:
    """The process's cache of cfg's data_dir (its hit and miss counts shared)."""
    folder = os.path.join(cfg.data_dir, CACHE_DIR)
    with _install_lock:
        return _caches.setdefault(folder, CompileCache(folder))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(_compile_aside_main())
