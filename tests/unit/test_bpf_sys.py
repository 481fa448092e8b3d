"""bpf_sys, the one module that declares the bpf(2) interface: its calls
against the real kernel (a map made, an element written and read back, the
kernel's refusals as -1 and errno, ENOSYS where the number is unknown), and a
read of the package's source that finds no other declaration of the call's
number, its commands' attr structs or a raw bpf(2) call."""

from __future__ import annotations

import ast
import ctypes as C
import errno
import os
import re
from pathlib import Path

import pytest

from require import cannot_run
from spanlet.probes import bpf_sys

PACKAGE = Path(bpf_sys.__file__).resolve().parents[1]
# union bpf_attr's and struct bpf_*_info's own field names: a ctypes Structure
# with one of them declares a part of the interface
ATTR_FIELDS = {"map_fd", "prog_fd", "bpf_fd", "prog_type", "map_type", "insn_cnt", "info_len",
               "btf_vmlinux_value_type_id", "expected_attach_type"}
LITERAL_CALL = re.compile(r"syscall\(\s*\d+")


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "bpf_sys.py":
            yield path, ast.parse(path.read_text(), str(path))


def _declarations(tree: ast.AST) -> list[str]:
    """What a module declares of bpf(2) itself: a table of the call's number
    by architecture, a Structure with bpf_attr's fields, a syscall() whose
    number is a literal (in code, or in code run from a string)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in ("x86_64", "aarch64")
                                              for k in node.keys):
            if any(isinstance(v, ast.Constant) and isinstance(v.value, int) for v in node.values):
                found.append(f"line {node.lineno}: a syscall number by architecture")
        elif isinstance(node, ast.ClassDef):
            names = {e.elts[0].value for n in node.body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "_fields_" for t in n.targets)
                     and isinstance(n.value, ast.List)
                     for e in n.value.elts if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant)}
            if names & ATTR_FIELDS:
                found.append(f"line {node.lineno}: class {node.name} with {sorted(names & ATTR_FIELDS)}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "syscall":
            if node.args and isinstance(node.args[0], ast.Constant):
                found.append(f"line {node.lineno}: syscall({node.args[0].value}, ...)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"line {node.lineno}: {m.group(0)} in a string" for m in LITERAL_CALL.finditer(node.value)]
    return found


def test_no_module_but_bpf_sys_declares_the_bpf_call():
    found = {str(p.relative_to(PACKAGE)): d for p, tree in _sources() if (d := _declarations(tree))}
    assert found == {}


@pytest.mark.parametrize("source, what", [
    ('_NR = {"x86_64": 321, "aarch64": 280}', "a syscall number by architecture"),
    ('class A(C.Structure):\n    _fields_ = [("map_fd", C.c_uint32), ("key", C.c_uint64)]', "class A"),
    ("libc.syscall(321, 0, attr, 72)", "syscall(321, ...)"),
    ('PROBE = """\nfd = libc.syscall(321, 0, ctypes.byref(attr), 72)\n"""', "syscall(321 in a string"),
])
def test_the_source_check_finds_each_kind_of_declaration(source, what):
    """The check above is no empty pass: each kind of declaration it looks for,
    written as the modules wrote them before bpf_sys, is found."""
    found = _declarations(ast.parse(source))
    assert len(found) == 1 and what in found[0], found


def test_attr_layouts_are_the_kernels():
    """The offsets the kernel reads (uapi/linux/bpf.h)."""
    assert (bpf_sys.ElemAttr.key.offset, bpf_sys.ElemAttr.value.offset, C.sizeof(bpf_sys.ElemAttr)) == (8, 16, 32)
    assert (bpf_sys.ProgLoadAttr.prog_name.offset, bpf_sys.ProgLoadAttr.expected_attach_type.offset) == (48, 68)
    assert (bpf_sys.UprobeMultiLinkAttr.path.offset, bpf_sys.UprobeMultiLinkAttr.cnt.offset,
            bpf_sys.UprobeMultiLinkAttr.pid.offset) == (16, 48, 56)
    assert (bpf_sys.MapInfo.name.offset, bpf_sys.MapInfo.btf_id.offset, bpf_sys.MapInfo.map_extra.offset) == (24, 64, 80)


@pytest.fixture
def root():
    if os.geteuid() != 0:
        cannot_run("bpf(2) needs root")


def test_a_map_made_written_and_read_back(root):
    attr = bpf_sys.MapCreateAttr(map_type=bpf_sys.MAP_TYPE_ARRAY, key_size=4, value_size=8, max_entries=1,
                                 map_name=b"spanlet_t_sys")
    fd = bpf_sys.bpf(bpf_sys.MAP_CREATE, attr)
    assert fd >= 0, os.strerror(C.get_errno())
    try:
        key, value, out = C.c_uint32(0), C.c_uint64(0x5EED), C.c_uint64(0)
        put = bpf_sys.ElemAttr(map_fd=fd, key=C.addressof(key), value=C.addressof(value))
        assert bpf_sys.bpf(bpf_sys.MAP_UPDATE_ELEM, put) == 0
        get = bpf_sys.ElemAttr(map_fd=fd, key=C.addressof(key), value=C.addressof(out))
        assert bpf_sys.syscall(bpf_sys.NR, bpf_sys.MAP_LOOKUP_ELEM, C.addressof(get), C.sizeof(get)) == 0
        assert out.value == 0x5EED
        info = bpf_sys.MapInfo()
        assert bpf_sys.bpf(bpf_sys.OBJ_GET_INFO_BY_FD,
                           bpf_sys.InfoAttr(bpf_fd=fd, info_len=C.sizeof(info), info=C.addressof(info))) == 0
        assert (info.type, info.key_size, info.value_size, info.name) == (bpf_sys.MAP_TYPE_ARRAY, 4, 8,
                                                                          b"spanlet_t_sys")
        # past the array's one entry: the kernel's refusal, as -1 and errno
        key.value = 1
        assert bpf_sys.bpf(bpf_sys.MAP_UPDATE_ELEM, put) == -1 and C.get_errno() == errno.E2BIG
    finally:
        os.close(fd)


def test_a_refusal_is_minus_one_and_the_kernels_errno(root):
    bad = bpf_sys.MapCreateAttr(map_type=bpf_sys.MAP_TYPE_ARRAY, key_size=0, value_size=8, max_entries=1)
    assert bpf_sys.bpf(bpf_sys.MAP_CREATE, bad) == -1 and C.get_errno() == errno.EINVAL


def test_an_architecture_without_a_number_is_enosys(monkeypatch):
    monkeypatch.setattr(bpf_sys, "NR", None)
    attr = bpf_sys.MapCreateAttr(map_type=bpf_sys.MAP_TYPE_ARRAY, key_size=4, value_size=8, max_entries=1)
    assert bpf_sys.bpf(bpf_sys.MAP_CREATE, attr) == -1 and C.get_errno() == errno.ENOSYS
