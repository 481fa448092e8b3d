"""Run by wheel_check.sh in a fresh venv holding `pip install spanlet` (no extra):
the public client import marks spans, and nothing of the daemon is installed."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import sysconfig
from pathlib import Path

# Each needs the [agent] extra (or is the daemon itself): none may import here.
DAEMON_ONLY = ("chdb", "pyroute2", "yaml", "pydantic", "prometheus_client", "clickhouse_connect",
               "kubernetes", "bcc", "spanlet.daemon")
NEVER_INSTALLED = ("agent", "exporters", "bpf", "native")  # the checkout's folders, as top-level names


def site_dirs() -> set[Path]:
    return {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}


def problems() -> list[str]:
    found = []
    from opentelemetry.sdk.trace import TracerProvider

    import spanlet
    from spanlet import SpanletSpanProcessor

    if Path(spanlet.__file__).resolve().parent.parent not in site_dirs():
        found.append(f"spanlet imports from {spanlet.__file__}, not from this venv's site-packages")
    provider = TracerProvider()
    processor = SpanletSpanProcessor()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("spanlet.wheel-check")
    with tracer.start_as_current_span("request", attributes={"mm.modality": "image"}):
        with tracer.start_as_current_span("decode"):
            pass
    if not processor.active:  # before shutdown, which stops marking
        found.append("the processor is a no-op: the marker extension did not load")
    provider.shutdown()
    marker = sys.modules.get("spanlet.libspanlet_marker")
    if marker is None or not Path(marker.__file__).name.startswith("libspanlet_marker.cpython-"):
        found.append(f"the marker is not the package's extension: {marker}")
    for name in DAEMON_ONLY:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        found.append(f"{name} imports in a client-only install")
    for site in site_dirs():
        found += [f"{site / top} is installed" for top in NEVER_INSTALLED if (site / top).exists()]
    tops = {f.parts[0] for f in importlib.metadata.files("spanlet") if f.parts[0] != ".."}
    if {t for t in tops if not t.endswith(".dist-info")} != {"spanlet"}:
        found.append(f"the wheel installs top-level names {sorted(tops)}, not spanlet alone")
    return found


def main() -> int:
    found = problems()
    for p in found:
        print(f"wheel check (client): {p}", file=sys.stderr)
    if not found:
        print("   client ok: from spanlet import SpanletSpanProcessor marks spans through "
              f"{Path(sys.modules['spanlet.libspanlet_marker'].__file__).name}; "
              f"none of {', '.join(DAEMON_ONLY)} imports; site-packages holds spanlet alone")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
