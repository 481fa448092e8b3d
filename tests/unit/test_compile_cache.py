"""The compile cache without the kernel: pin paths read from the program text,
the key, the files (whole, this user's alone), and the stand-in of libbcc's
module calls. tests/kernel/test_compile_cache.py loads cached modules."""

from __future__ import annotations

import json
import os

import pytest

from spanlet.probes import compile_cache as cc

TEXT = '''
#ifdef SPANLET_PIN_DIR
BPF_TABLE_PINNED("lru_hash", __u32, struct span_ctx_val, span_ctx, SPANLET_SPAN_CTX_MAX,
                 SPANLET_PIN_DIR "/span_ctx");
BPF_TABLE_PINNED("percpu_array", int, __u64, span_facts_created, 1,
                 SPANLET_PIN_DIR "/span_facts_created");
#endif
#ifdef SPANLET_OTEL_MAP
BPF_TABLE_PINNED("lru_hash", __u64, struct otel_ctx_val, traces_ctx_v1, 16384, SPANLET_OTEL_MAP);
#endif
BPF_TABLE_PINNED("hash", __u64, __u64, fixed, 8, "/sys/fs/bpf/x/fixed");
'''


def test_pin_paths_come_from_the_text_and_the_flags_string_macros():
    flags = ['-DSPANLET_PIN_DIR="/sys/fs/bpf/spanlet/12-1"', "-DSPANLET_SPAN_CTX_MAX=4096"]
    assert cc.pinned_candidates(TEXT, flags) == {
        "span_ctx": "/sys/fs/bpf/spanlet/12-1/span_ctx",
        "span_facts_created": "/sys/fs/bpf/spanlet/12-1/span_facts_created",
        "fixed": "/sys/fs/bpf/x/fixed"}      # SPANLET_OTEL_MAP undefined: not compiled
    flags.append('-DSPANLET_OTEL_MAP="/sys/fs/bpf/otel/traces_ctx_v1"')
    assert cc.pinned_candidates(TEXT, flags)["traces_ctx_v1"] == "/sys/fs/bpf/otel/traces_ctx_v1"


def test_a_pinned_table_it_cannot_read_is_not_cached():
    # a path with flags after it is read; a declaration of another shape refuses the cache
    text = 'BPF_TABLE_PINNED("hash", u64, u64, t, 8, "/sys/fs/bpf/t", BPF_F_NO_PREALLOC);'
    assert cc.pinned_candidates(text, []) == {"t": "/sys/fs/bpf/t"}
    with pytest.raises(cc.CacheError):
        cc.pinned_candidates('BPF_TABLE_PINNED("hash", u64, u64, t, 8);', [])
    with pytest.raises(cc.CacheError):
        cc.pinned_candidates("#define P(n) BPF_TABLE_PINNED(n)\nP(x);", [])


def test_the_agents_own_pin_folder_is_a_placeholder_in_the_key():
    a = ['-DSPANLET_PIN_DIR="/sys/fs/bpf/spanlet/12-1"', "-DX=1"]
    b = ['-DSPANLET_PIN_DIR="/sys/fs/bpf/spanlet/99-3"', "-DX=1"]
    ta, tb = cc.pin_templates(a), cc.pin_templates(b)
    assert ta == {"/sys/fs/bpf/spanlet/12-1": "{pin_dir}"}
    assert cc.cache_key("int x;", a, ta) == cc.cache_key("int x;", b, tb)
    # without the placeholder the folders differ, and so do the keys
    assert cc.cache_key("int x;", a, {}) != cc.cache_key("int x;", b, {})


@pytest.mark.parametrize("change", ["text", "flag", "headers"])
def test_the_key_changes_with_what_the_compile_depends_on(change, monkeypatch, tmp_path):
    flags = ["-DX=1"]
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path))
    (tmp_path / "include/generated").mkdir(parents=True)
    conf = tmp_path / "include/generated/autoconf.h"
    conf.write_text("#define CONFIG_A 1\n")
    before = cc.cache_key("int x;", flags, {})
    if change == "text":
        after = cc.cache_key("int y;", flags, {})
    elif change == "flag":
        after = cc.cache_key("int x;", ["-DX=2"], {})
    else:
        conf.write_text("#define CONFIG_A 1\n#define CONFIG_B 1\n")
        after = cc.cache_key("int x;", flags, {})
    assert before != after
    assert cc.cache_key("int x;", flags, {}) == cc.cache_key("int x;", flags, {})   # and is stable


def test_files_are_written_whole_and_read_back(tmp_path):
    cache = cc.CompileCache(tmp_path / "bpf-cache")
    assert cache.read("k") is None
    cache.write("k", {"format": cc.FORMAT, "x": [1, 2]})
    assert cache.read("k") == {"format": cc.FORMAT, "x": [1, 2]}
    assert oct((tmp_path / "bpf-cache").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "bpf-cache/k.json").stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in (tmp_path / "bpf-cache").iterdir()] == ["k.json"]   # no temporary left


def test_a_file_others_can_write_or_that_does_not_parse_is_not_used(tmp_path, caplog):
    cache = cc.CompileCache(tmp_path / "bpf-cache")
    cache.write("k", {"format": cc.FORMAT})
    path = tmp_path / "bpf-cache/k.json"
    os.chmod(path, 0o666)
    assert cache.read("k") is None
    assert "not this user's alone" in caplog.text
    os.chmod(path, 0o600)
    path.write_text("{not json")
    assert cache.read("k") is None
    assert "compiling" in caplog.text
    os.chmod(tmp_path / "bpf-cache", 0o777)
    path.write_text(json.dumps({"format": cc.FORMAT}))
    assert cache.read("k") is None                     # the folder is writable by all


def test_a_folder_that_cannot_be_made_is_logged_and_nothing_else(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    cc.CompileCache(tmp_path / "file" / "bpf-cache").write("k", {})
    assert "not written" in caplog.text


class FakeLib:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):          # any other libbcc call: must not be reached here
        def reached(*args):
            raise AssertionError(f"{name} reached libbcc")
        return reached

    def bpf_table_fd(self, module, name):
        self.calls.append(("bpf_table_fd", module, name))
        return 7

    def bpf_lookup_elem(self, fd, k, v):
        self.calls.append(("bpf_lookup_elem", fd))
        return 0

    def bpf_num_functions(self, module):
        raise AssertionError("a cached module's call reached libbcc")

    bpf_module_license = bpf_num_functions

    def bpf_module_create_c_from_string(self, *args):
        self.calls.append(("compile",))
        return 1234


def image():
    return {"format": cc.FORMAT, "license": "GPL", "kern_version": 0, "functions": [],
            "tables": []}


def test_the_stand_in_answers_a_cached_modules_calls_and_passes_on_the_rest():
    real = FakeLib()
    lib = cc._Lib(real)
    module = cc.CachedModule(image(), {})
    assert lib.bpf_table_fd(module, b"nothing") == -1          # answered by the module
    assert lib.bpf_table_fd(99, b"t") == 7                     # a real module: libbcc's
    assert lib.bpf_lookup_elem(3, None, None) == 0
    assert lib.__dict__["bpf_lookup_elem"] == real.bpf_lookup_elem   # looked up once, then plain
    assert lib.bpf_module_create_c_from_string(b"text") == 1234
    lib.pending.module = module
    assert lib.bpf_module_create_c_from_string(b"text") is module
    assert lib.bpf_num_functions(module) == 0 and lib.bpf_module_license(module) == b"GPL"
    assert real.calls == [("bpf_table_fd", 99, b"t"), ("bpf_lookup_elem", 3), ("compile",)]


def test_an_image_of_another_format_is_refused():
    with pytest.raises(cc.CacheError):
        cc.CachedModule({**image(), "format": cc.FORMAT + 1}, {})


def test_past_its_bound_the_least_recently_used_files_go(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "MAX_FILES", 3)
    cache = cc.CompileCache(tmp_path)
    for i, key in enumerate("abc"):
        cache.write(key, {"n": i})
        os.utime(tmp_path / f"{key}.json", ns=(10**18 + i, 10**18 + i))
    assert cache.read("a") == {"n": 0}        # used now: the newest
    cache.write("d", {"n": 3})
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["a", "c", "d"]


def test_a_folder_or_file_reached_through_a_link_is_not_used(tmp_path, caplog):
    real = cc.CompileCache(tmp_path / "real")
    real.write("k", {"format": cc.FORMAT})
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert cc.CompileCache(tmp_path / "link").read("k") is None
    (tmp_path / "real" / "j.json").symlink_to(tmp_path / "real" / "k.json")
    assert real.read("j") is None and "compiling" in caplog.text
    assert real.read("k") == {"format": cc.FORMAT}


def test_a_name_the_module_does_not_have_is_answered_as_libbcc_does():
    lib = cc._Lib(FakeLib())
    module = cc.CachedModule(image(), {})
    missing = lib.bpf_table_id(module, b"nothing")
    assert lib.bpf_table_fd(module, b"nothing") == -1
    assert (lib.bpf_table_type_id(module, missing), lib.bpf_table_max_entries_id(module, missing)) == (-1, 0)
