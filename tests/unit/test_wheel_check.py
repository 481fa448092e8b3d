"""The wheel check (scripts/wheel_check.sh and its two Python checks): run by
`make test` before pytest, and its checks catch what they are there to catch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import wheel_check_agent

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def test_make_test_runs_the_wheel_check_before_pytest_and_ci_runs_make_test():
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "test"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    check = next(i for i, line in enumerate(out) if "scripts/wheel_check.sh" in line)
    pytest_run = next(i for i, line in enumerate(out) if "-m pytest" in line)
    assert check < pytest_run
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"


def test_the_client_check_fails_in_a_venv_with_the_daemon_and_an_editable_spanlet(tmp_path):
    """This venv is everything a client-only install must not be: the check says so."""
    env = {k: v for k, v in os.environ.items() if k != "SPANLET_MARKER_LIB"}
    out = subprocess.run([sys.executable, "-I", str(SCRIPTS / "wheel_check_client.py")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    for problem in ("not from this venv's site-packages", "chdb imports in a client-only install",
                    "pyroute2 imports in a client-only install", "spanlet.daemon imports in a client-only install"):
        assert problem in out.stderr
    assert "the processor is a no-op" not in out.stderr  # the marker itself loads here


def _bpf_dir(tmp_path: Path) -> Path:
    d = tmp_path / "site" / "spanlet" / "bpf"
    d.mkdir(parents=True)
    (d / "one.bpf.c").write_text('#include "spanlet.h"\nint one(void) { return 1; }\n')
    (d / "two.bpf.c").write_text("int two(void) { return 2; }\n")
    return d


def test_the_agent_check_accepts_a_dump_of_every_shipped_probe(tmp_path):
    d = _bpf_dir(tmp_path)
    dump = ("/* ==== probe one: one.bpf.c  flags: -DX ==== */\n#line 1 \"spanlet.h\"\n"
            "int one(void) { return 1; }\n/* ==== probe two: two.bpf.c  flags: ==== */\n"
            "int two(void) { return 2; }\n")
    assert wheel_check_agent.problems(dump, d, (tmp_path / "site").resolve()) == []


def test_the_agent_check_finds_an_object_the_package_does_not_hold(tmp_path):
    d = _bpf_dir(tmp_path)
    (d / "objects" / "x86").mkdir(parents=True)
    (d / "objects" / "x86" / "one.bpf.o").write_bytes(b"\x7fELF")
    dump = ("/* ==== probe one: one.bpf.c  object: objects/x86/one.bpf.o ==== */\nint one(void) { return 1; }\n"
            "/* ==== probe two: two.bpf.c  object: objects/x86/two.bpf.o ==== */\nint two(void) { return 2; }\n")
    found = wheel_check_agent.problems(dump, d, (tmp_path / "site").resolve())
    assert found == ["probe two loads objects/x86/two.bpf.o, which the package does not hold "
                     "(built without its objects?)"]


def test_the_agent_check_finds_missing_probes_other_sources_and_the_wrong_place(tmp_path):
    d = _bpf_dir(tmp_path)
    dump = ("/* ==== probe one: one.bpf.c  flags: ==== */\nint one(void) { return 0; }\n"
            "/* ==== probe three: three.bpf.c  flags: ==== */\n")
    found = wheel_check_agent.problems(dump, d, (tmp_path / "elsewhere").resolve())
    assert any("not from" in p and "elsewhere" in p for p in found)
    assert "two.bpf.c is in the package but not in the dump" in found
    assert any(p.startswith("probe three dumped three.bpf.c") for p in found)
    assert any("1 lines of" in p and "one.bpf.c" in p and "return 1" in p for p in found)


def test_the_agent_check_reads_the_real_dump_bpf(tmp_path):
    """The format it parses is the one `spanlet run --dump-bpf` prints, for every
    probe this checkout ships."""
    from spanlet.probes import base
    spanlet = Path(sys.executable).parent / "spanlet"
    out = subprocess.run([str(spanlet), "run", "--dump-bpf"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, check=True).stdout
    assert len(wheel_check_agent.PROBE_HEADER.findall(out)) == len(list(base.BPF_DIR.glob("*.bpf.c")))
    assert wheel_check_agent.problems(out, base.BPF_DIR, None) == []
