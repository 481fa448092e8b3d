"""Run by wheel_check.sh in a fresh venv holding `pip install 'spanlet[agent]'`:
`spanlet run --dump-bpf` (its output file given) showed the installed package's BPF sources, and the
CO-RE objects it names are in the package."""

from __future__ import annotations

import re
import sys
import sysconfig
from pathlib import Path

PROBE_HEADER = re.compile(r"^/\* ==== probe (\w+): (\S+)", re.M)
# a CO-RE probe's header names its object, relative to the package's bpf folder
OBJECT = re.compile(r"^/\* ==== probe (\w+): \S+  object: (\S+) ====", re.M)


def problems(dump: str, bpf_dir: Path, site: Path | None) -> list[str]:
    """What is wrong with `dump` as the output of the package installed at
    `site` whose BPF sources are in `bpf_dir` (site None: do not check where)."""
    found = []
    if site is not None and site not in bpf_dir.resolve().parents:
        found.append(f"the BPF sources come from {bpf_dir}, not from {site}")
    dumped = dict((file, name) for name, file in PROBE_HEADER.findall(dump))
    shipped = sorted(p.name for p in bpf_dir.glob("*.bpf.c"))
    if not shipped:
        found.append(f"no *.bpf.c in {bpf_dir}")
    found += [f"{f} is in the package but not in the dump" for f in shipped if f not in dumped]
    found += [f"probe {name} loads {rel}, which the package does not hold (built without its objects?)"
              for name, rel in OBJECT.findall(dump) if not (bpf_dir / rel).is_file()]
    dump_lines = set(dump.splitlines())
    for file in sorted(dumped):
        if file not in shipped:
            found.append(f"probe {dumped[file]} dumped {file}, which the package does not hold")
            continue
        lines = [ln for ln in (bpf_dir / file).read_text().splitlines()
                 if ln.strip() and not ln.startswith('#include "')]
        missing = [ln for ln in lines if ln not in dump_lines]
        if missing:
            found.append(f"{len(missing)} lines of {bpf_dir / file} are not in the dump, "
                         f"the first: {missing[0]!r}")
    return found


def main() -> int:
    import spanlet.daemon  # noqa: F401 - the daemon and its dependencies import
    from spanlet.probes import base

    dump = Path(sys.argv[1]).read_text()
    found = problems(dump, base.BPF_DIR, Path(sysconfig.get_paths()["purelib"]).resolve())
    for p in found:
        print(f"wheel check (agent): {p}", file=sys.stderr)
    if not found:
        names = [name for name, _ in PROBE_HEADER.findall(dump)]
        print(f"   agent ok: the installed spanlet dumped {', '.join(names)} from {base.BPF_DIR}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
