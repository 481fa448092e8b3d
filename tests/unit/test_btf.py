"""BTF read in Python (spanlet.probes.btf): the layouts of a CO-RE object's
structs, as ctypes types, agree member by member with gcc's for the same C
(tests/support/core/fixture.h, compiled into the object for both
architectures by clang-16 and opened by libbpf, and into a program by gcc
that prints offsetof);
the settings' places in .rodata; bytes that are not BTF refused clearly."""

from __future__ import annotations

import ctypes as C
import struct
import subprocess

import pytest

import core_fixture
from spanlet.probes import btf as B
from spanlet.probes.libbpf import Object
STRUCTS = {"fixture_seen": ["switches_out", "sum_exec_runtime", "tgid", "kind", "tag", "last"],
           "fixture_calls": ["n", "args_sum"],
           "fixture_event": ["tgid", "tid", "a", "small", "bytes"]}


@pytest.fixture(scope="module", params=core_fixture.ARCHES)
def obj_btf(request, tmp_path_factory) -> B.BTF:
    """The object's BTF as libbpf opens it (no kernel needed: nothing is loaded),
    with its data sections' offsets filled in from the symbols, as libbpf does."""
    out = core_fixture.build(tmp_path_factory.mktemp("core"), request.param)
    with Object.open_file(out) as obj:
        return obj.btf


@pytest.fixture(scope="module")
def gcc_layout(tmp_path_factory) -> dict[str, tuple[int, dict[str, int]]]:
    """Each struct's size and members' offsets, as gcc lays them out."""
    d = tmp_path_factory.mktemp("gcc")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include <linux/types.h>', '#include "fixture.h"',
             "int main(void) {"]
    for s, members in STRUCTS.items():
        lines.append(f'printf("{s} size %zu\\n", sizeof(struct {s}));')
        lines += [f'printf("{s} {m} %zu\\n", offsetof(struct {s}, {m}));' for m in members]
    lines.append("return 0; }")
    (d / "layout.c").write_text("\n".join(lines))
    subprocess.run(["gcc", "-I", str(core_fixture.DIR), "-o", str(d / "layout"), str(d / "layout.c")], check=True)
    out: dict[str, tuple[int, dict[str, int]]] = {}
    for line in subprocess.run([str(d / "layout")], capture_output=True, text=True, check=True).stdout.splitlines():
        s, m, v = line.split()
        size, offs = out.get(s, (0, {}))
        out[s] = (int(v), offs) if m == "size" else (size, {**offs, m: int(v)})
    return out


def test_each_struct_has_gccs_layout(obj_btf, gcc_layout):
    for s, (size, offsets) in gcc_layout.items():
        t = obj_btf.ctype(obj_btf.find(s).id)
        assert C.sizeof(t) == size, s
        assert {m: getattr(t, m).offset for m in offsets} == offsets, s


def test_values_round_trip_through_the_ctypes_type(obj_btf):
    t = obj_btf.ctype(obj_btf.find("fixture_seen").id)
    v = t(switches_out=3, sum_exec_runtime=2**40, tgid=7, kind=200, last=9)
    v.tag[:] = [1, 2, 3]
    raw = bytes(v)
    assert struct.unpack_from("<QQIB3sQ", raw, 0) == (3, 2**40, 7, 200, b"\x01\x02\x03", 9)
    assert t.from_buffer_copy(raw).tag[2] == 3


def test_the_settings_are_found_in_rodata(obj_btf):
    where = obj_btf.datasec_vars(".rodata")
    assert where["target_tgid"][1] == 4 and where["call_weight"][1] == 8 and where["signed_setting"][1] == 4
    offs = sorted(o for o, _ in where.values())
    assert len(set(offs)) == len(offs)


def test_bytes_that_are_not_btf_are_refused():
    with pytest.raises(B.BTFError, match="header"):
        B.BTF(b"\x9f\xeb")
    with pytest.raises(B.BTFError, match="magic"):
        B.BTF(b"\0" * 32)
    hdr = struct.pack("<HBBIIIII", B.MAGIC, 1, 0, 24, 0, 12, 12, 1)
    with pytest.raises(B.BTFError, match="unknown kind"):
        B.BTF(hdr + struct.pack("<III", 0, 31 << 24, 0) + b"\0")
    with pytest.raises(B.BTFError, match="past"):
        B.BTF(hdr + b"\0" * 4)


def test_a_type_without_a_ctypes_form_is_named(obj_btf):
    prog = next(t for t in obj_btf.types[1:] if t.kind == B.FUNC)
    with pytest.raises(B.BTFError, match="no ctypes form"):
        obj_btf.ctype(prog.id)
    with pytest.raises(B.BTFError, match="no struct nowhere"):
        obj_btf.find("nowhere")
