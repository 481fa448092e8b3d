"""Probe base: our headers are inlined so BCC rewrites their map calls."""

from spanlet.probes.base import BPF_DIR, expand_source


def test_expand_source_inlines_local_headers_with_line_markers(tmp_path):
    (tmp_path / "x.h").write_text("int from_header;\n")
    src = tmp_path / "p.bpf.c"
    src.write_text("/* p */\n#include \"x.h\"\n#include <uapi/linux/bpf.h>\nint after;\n")
    out = expand_source(src)
    assert '#line 1 "x.h"\nint from_header;' in out
    assert '#line 3 "p.bpf.c"\n#include <uapi/linux/bpf.h>' in out   # system includes stay
    assert '#include "x.h"' not in out



def test_expand_source_inlines_nested_headers_once(tmp_path):
    (tmp_path / "shared.h").write_text("int shared;\n")
    (tmp_path / "helper.bpf.h").write_text('#include "shared.h"\nint helper;\n')
    src = tmp_path / "p.bpf.c"
    src.write_text('#include "shared.h"\n#include "helper.bpf.h"\nint after;\n')
    out = expand_source(src)
    assert out.count("int shared;") == 1 and "int helper;" in out
    assert "#include" not in out
    assert out.index("int shared;") < out.index("int helper;") < out.index("int after;")
    assert '#line 3 "p.bpf.c"\nint after;' in out

def test_every_probe_source_includes_the_shared_header():
    for src in BPF_DIR.glob("*.bpf.c"):
        text = expand_source(src)
        assert "struct spanlet_hdr {" in text, src.name


def test_a_failing_consumer_does_not_stop_the_reader(cfg):
    from spanlet import events
    from spanlet.probes.base import Probe

    def broken(ev):
        raise RuntimeError("consumer bug")

    p = Probe(cfg, sink=broken)
    ev = events.GpuSync()
    ev.hdr.kind = events.Kind.GPU_SYNC
    raw = bytes(ev) * 2
    p._on_record(raw, 0, len(raw) // 2)
    p._on_record(raw, len(raw) // 2, len(raw) // 2)
    assert p.events_read == 2 and p.sink_errors == 2
    p._on_record(b"\0" * 8, 0, 8)
    assert p.decode_errors == 1
