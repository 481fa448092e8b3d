"""What compiling leaves resident is given back after the start
(memory.release_startup_memory): the compiler libraries' file pages
paged out, the freed heap trimmed. Shown in a child process on a library
file only it maps, read in full first."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import mmap, os, sys
    from spanlet.memory import release_startup_memory

    def rss_kb(name):
        total, cur = 0, None
        for line in open("/proc/self/smaps"):
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
                cur = line.split()[-1]
            elif line.startswith("Rss:") and cur and cur.endswith(name):
                total += int(line.split()[1])
        return total

    path = sys.argv[1]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    sum(m[i] for i in range(0, len(m), 4096))          # every page read: resident
    before = rss_kb(os.path.basename(path))
    released = release_startup_memory()
    after = rss_kb(os.path.basename(path))
    print(before, after, released)
""")


def test_the_compiler_libraries_pages_are_given_back(tmp_path):
    lib = tmp_path / "libLLVM-99.so.1"          # named as BCC's LLVM is
    lib.write_bytes(bytes(range(256)) * (64 * 1024 * 4))  # 64 MB of file pages
    out = subprocess.run([sys.executable, "-c", CHILD, str(lib)], capture_output=True, text=True,
                         check=True).stdout.split()
    before, after, released = (int(x) for x in out)
    assert before >= 60 * 1024                   # resident once read
    assert released >= 64 * 2**20
    assert after < before // 10                  # paged out


def test_other_libraries_are_left_alone(tmp_path):
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * (8 * 2**20))
    out = subprocess.run([sys.executable, "-c", CHILD, str(lib)], capture_output=True, text=True,
                         check=True).stdout.split()
    before, after, released = (int(x) for x in out)
    assert before >= 7 * 1024 and after == before
