"""Hostile configuration: malformed, mis-shaped, huge or binary files, bad
SPANLET_* variables and bad --set keys each stop `spanlet run` with exit
code 2 and one clear line per problem naming the key (or the line), never a
traceback and never a probe; and a property test over random YAML documents:
loading gives a Config or a ConfigError, nothing else."""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from spanlet import config

ROOT = Path(__file__).resolve().parents[2]
SPANLET = [str(Path(sys.executable).with_name("spanlet"))]
if not Path(SPANLET[0]).exists():     # not installed as a console script: the same entry point
    SPANLET = [sys.executable, "-m", "spanlet.cli"]


def laughs(levels: int = 9) -> str:
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\ntc:\n  port_modality: {{80: *l{levels - 1}}}\n"


def mapping_laughs(levels: int = 9) -> str:
    lines = ["m0: &m0 {a: 1, b: 2, c: 3, d: 4, e: 5, f: 6, g: 7, h: 8, i: 9, j: 10}"]
    for i in range(1, levels):
        lines.append(f"m{i}: &m{i} {{" + ", ".join(f"k{j}: *m{i - 1}" for j in range(10)) + "}")
    return "\n".join(lines) + f"\nsandbox:\n  mode: *m{levels - 1}\n"


# (name, file content, text every problem line must hold, problems)
FILES = [
    ("unclosed", "tc:\n  interfaces: [eth0\n", "not valid YAML: line 3, column 1", 1),
    ("tab", "tc:\n\tenabled: true\n", "not valid YAML: line 2, column 1", 1),
    ("two_documents", "a: 1\n---\nb: 2\n", "not valid YAML: line 2", 1),
    ("python_tag", "!!python/object/apply:os.system ['true']\n", "could not determine a constructor", 1),
    ("top_list", "- tc\n- sandbox\n", "top level must be a mapping of keys, not list", 1),
    ("top_scalar", "spanlet\n", "top level must be a mapping of keys, not str", 1),
    ("unknown_top", "colour: blue\n", "unknown key 'colour'", 1),
    ("unknown_nested", "tc:\n  colour: blue\n", "unknown key 'tc.colour'", 1),
    # the harmless-run variables set tc.enabled: they must not replace the broken section
    ("section_list", "tc: [1, 2]\n", "key 'tc': must be a mapping of keys, not list", 1),
    ("section_scalar", "sandbox: 7\n", "key 'sandbox': must be a mapping of keys, not int", 1),
    ("wrong_type", "tc:\n  max_flows: lots\n", "key 'tc.max_flows': Input should be a valid integer", 1),
    ("bool_number", "tc:\n  max_flows: true\n", "key 'tc.max_flows': expected a number, not true", 1),
    ("bad_enum", "sandbox:\n  mode: kill\n", "key 'sandbox.mode': Input should be 'audit' or 'enforce'", 1),
    ("out_of_range", "otlp:\n  max_message_bytes: 1\n",
     "key 'otlp.max_message_bytes': Input should be greater than or equal to 1024", 1),
    ("nan", "window_s: .nan\n", "key 'window_s': Input should be a finite number", 1),
    ("infinite", "join:\n  ttl_s: .inf\n", "key 'join.ttl_s': Input should be a finite number", 1),
    ("not_power_of_two", "ringbuf_pages: 3\n", "key 'ringbuf_pages': 3 is not a power of two", 1),
    ("int_key", "1: 2\n", "key '1': Keys should be strings", 1),
    ("two_problems", "window_s: -1\ntc:\n  colour: blue\n", "config file", 2),
    ("binary", None, "line 1: not UTF-8 text (byte 0xff)", 1),
    ("huge", "# padding\n" * 120_000, f"larger than {config.MAX_CONFIG_BYTES} bytes", 1),
    ("deep_flow", "tc: " + "[" * 20_000 + "]" * 20_000 + "\n", "not valid YAML: line 1", 1),
    ("deep_block", "".join("  " * i + f"k{i}:\n" for i in range(3000)), "config file", 1),
    ("billion_laughs_lists", laughs(), "expands to more than 1000000 values (YAML aliases)", 1),
    ("billion_laughs_maps", mapping_laughs(), "expands to more than 1000000 values (YAML aliases)", 1),
    ("self_alias", "tc: &t\n  port_modality: *t\n", "a YAML alias refers to a mapping or list that contains it", 1),
    ("many_problems", "".join(f"unknown{i}: 1\n" for i in range(500)), "config file", 21),
    ("key_with_newline", '"bad\\nkey": 1\n', "unknown key 'bad\\nkey'", 1),
    ("url_with_password", "store:\n  backend: clickhouse\n  url: http://ops:hunter2-s3cret@ch:8123\n",
     "key 'store.url': must not carry a password", 1),
]

# (name, environment, --set arguments, text, problems)
FLAGS = [
    ("env_wrong_type", {"SPANLET_HTTP_PORT": "abc"}, [],
     "environment variable SPANLET_HTTP_PORT: key 'http_port': Input should be a valid integer", 1),
    ("env_unparsable", {"SPANLET_TC_MAX_FLOWS": "[[[{"}, [],
     "environment variable SPANLET_TC_MAX_FLOWS: key 'tc.max_flows'", 1),
    ("env_nan", {"SPANLET_WINDOW_S": "nan"}, [],
     "environment variable SPANLET_WINDOW_S: key 'window_s': Input should be a finite number", 1),
    ("env_self_alias", {"SPANLET_TC_PORT_MODALITY": "&a {80: *a}"}, [],
     "environment variable SPANLET_TC_PORT_MODALITY: key 'tc.port_modality': a YAML alias", 1),
    ("env_bad_enum", {"SPANLET_GPU_LAUNCH_EVENTS": "some"}, [],
     "environment variable SPANLET_GPU_LAUNCH_EVENTS: key 'gpu.launch_events'", 1),
    ("env_config_missing", {"SPANLET_CONFIG": "/nonexistent/spanlet.yaml"}, [],
     "config file /nonexistent/spanlet.yaml: No such file or directory", 1),
    ("set_unknown", {}, ["--set", "nope=1"], "--set: unknown key 'nope'", 1),
    ("set_unknown_nested", {}, ["--set", "tc.nope=1"], "--set: unknown key 'tc.nope'", 1),
    ("set_underscore", {}, ["--set", "tc_interfaces=eth0"], "--set: unknown key 'tc_interfaces'", 1),
    ("set_upper", {}, ["--set", "TC.INTERFACES=eth0"], "--set: unknown key 'TC.INTERFACES'", 1),
    ("set_section", {}, ["--set", "tc=1"], "--set: unknown key 'tc'", 1),
    ("set_no_value", {}, ["--set", "http_port"], "--set: unknown key 'http_port'", 1),
    ("set_bad_value", {}, ["--set", "sandbox.mode=kill"], "--set sandbox.mode: key 'sandbox.mode'", 1),
    ("set_secret_to_typo", {}, ["--set", "store.pasword=hunter2-s3cret"],
     "--set: unknown key 'store.pasword'", 1),
]


def clean_env(extra: dict, tmp: Path) -> dict:
    """The environment of one refused run. Should a case wrongly pass, the
    agent it starts must be harmless: no TC, sandbox, GPU probes or store,
    its own socket and data directory, free ports. (Variables win over the
    file: no case tests a key set here.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANLET_", "OTEL_"))}
    env.update({"SPANLET_TC_ENABLED": "false", "SPANLET_SANDBOX_ENABLED": "false",
                "SPANLET_GPU_ENABLED": "false", "SPANLET_STORE_ENABLED": "false",
                "SPANLET_NVML_ENABLED": "false", "SPANLET_DATA_DIR": str(tmp / "data"),
                "SPANLET_ADMIN_SOCKET": str(tmp / "admin.sock"), "SPANLET_HTTP_PORT": "0",
                "SPANLET_HTTP_ADDRESS": "127.0.0.1", "SPANLET_OTLP_GRPC_PORT": "0",
                "SPANLET_OTLP_HTTP_PORT": "0"})
    env.update(extra)
    return env


def check_refusal(proc: subprocess.CompletedProcess, text: str, problems: int) -> None:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and proc.stdout == ""
    lines = err.splitlines()
    assert len(lines) == problems, err[-3000:]
    assert all(line.startswith("spanlet: ") for line in lines), err[-3000:]
    assert all(len(line) < 700 for line in lines)
    assert text in lines[0], err[-3000:]
    assert "hunter2-s3cret" not in err
    # refused before anything started: no log line (probes, receiver, store) was written
    assert "running" not in err and " INFO " not in err and "probe" not in err


def test_spanlet_run_refuses_each_bad_config_with_one_line_per_problem(tmp_path):
    procs = []
    for name, text, expected, problems in FILES:
        f = tmp_path / f"{name}.yaml"
        if text is None:
            f.write_bytes(b"\xff\xfe\x00" + random.Random(1).randbytes(5000))
        else:
            f.write_text(text)
        procs.append((name, expected, problems, subprocess.Popen(
            [*SPANLET, "run", "--config", str(f)], cwd=ROOT, env=clean_env({}, tmp_path),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for name, env, flags, expected, problems in FLAGS:
        procs.append((name, expected, problems, subprocess.Popen(
            [*SPANLET, "run", *flags], cwd=ROOT, env=clean_env(env, tmp_path),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    try:
        for name, expected, problems, p in procs:
            try:
                out, err = p.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name}: spanlet run did not refuse the config") from None
            check_refusal(subprocess.CompletedProcess(p.args, p.returncode, out, err),
                          expected, problems)
    finally:
        for *_, p in procs:      # a run that wrongly started: stopped as an operator would
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def test_the_config_file_problem_names_the_file_and_every_problem_its_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("http_port: -1\ntc:\n  colour: blue\n  max_flows: 1\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(f, env={})
    assert str(e.value).splitlines() == [
        f"config file {f}: key 'http_port': Input should be greater than or equal to 0",
        f"config file {f}: key 'tc.max_flows': Input should be greater than or equal to 64",
        f"config file {f}: unknown key 'tc.colour'",
    ]


@pytest.mark.parametrize("text", ["tc: [1, 2]\n", "tc: eth0\n", "tc:\n"])
def test_a_variable_never_replaces_a_broken_section_of_the_file(tmp_path, text):
    """SPANLET_TC_ENABLED used to swap the file's `tc:` for {} and start with defaults."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(f, env={"SPANLET_TC_ENABLED": "false"})
    assert str(e.value).startswith(f"config file {f}: key 'tc': must be a mapping of keys")
    with pytest.raises(config.ConfigError, match="--set tc.enabled sets a key inside it"):
        config.load(f, env={}, overrides=["tc.enabled=false"])


def test_a_yaml_error_never_quotes_the_line(tmp_path):
    """PyYAML's messages quote the offending source line, which may hold a credential."""
    f = tmp_path / "c.yaml"
    f.write_text("otlp:\n  upstream_headers: {authorization: Bearer tok-hunter2-s3cret\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(f, env={})
    assert "hunter2-s3cret" not in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"config file {f}: not valid YAML: line 3")


def test_aliases_within_bounds_still_work(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("sandbox:\n  pools:\n"
                 "    - {path: /dev/shm/tensor_pool/a, grants: [&g {pids: [1, 2], access: ro}]}\n"
                 "    - {path: /dev/shm/tensor_pool/b, grants: [*g]}\n")
    cfg = config.load(f, env={})
    assert [p.grants[0].pids for p in cfg.sandbox.pools] == [[1, 2], [1, 2]]


# ---------------------------------------------------------------------------
# property: any YAML document loads to a Config or raises ConfigError

def _keys(model: type[BaseModel]) -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        out.append(name)
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out += _keys(f.annotation)
    return out


KEYS = sorted(set(_keys(config.Config)) | {"pools", "grants", "pids", "cgroups", "path", "access",
                                            "modality", "clock_hz", "max_bytes"})
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["audit", "enforce", "text", "audio", "ro", "rw", "grpc", "http/protobuf",
                     "/dev/shm/tensor_pool/x", "/etc/passwd", "../..", "eth0", "debug", "all"]),
    st.binary(max_size=20))
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=12), st.integers(-5, 200), st.booleans())
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(keys, inner, max_size=6)),
    max_leaves=40)
sections = st.dictionaries(st.sampled_from(KEYS), documents, max_size=8)


def assert_loads_or_config_error(path: Path, env=None, overrides=None) -> None:
    try:
        cfg = config.load(path, env=env or {}, overrides=overrides)
    except config.ConfigError as e:
        lines = str(e).splitlines()
        assert lines and all(line.strip() for line in lines)
        assert len(lines) <= config.MAX_PROBLEMS + 1
        assert all(len(line) < 1000 for line in lines), lines
    else:
        assert isinstance(cfg, config.Config)


YAML_TOKENS = ["\x00", "\xff", "\ufeff", "é", "&a ", "*a", "!!", "!!str ", "!!binary ",
               "!!python/name:os.system ", "---\n", "...\n", "%YAML 1.2\n", "? ", ": ", "- ",
               "\n  ", "\n    - ", "[", "]", "{", "}", "|\n  ", ">-\n  ", "<<: *a\n", "~", ".nan",
               "0x1F", "1e999", "'", '"', "\\u0000", "#"]
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(doc=st.one_of(sections, documents))
def test_any_yaml_document_loads_or_raises_config_error(tmp_path, doc):
    f = tmp_path / "fuzz.yaml"
    f.write_text(yaml.safe_dump(doc, allow_unicode=True))
    assert_loads_or_config_error(f)


@FUZZ
@given(text=st.lists(st.sampled_from(list(string.printable) + YAML_TOKENS + KEYS),
                    max_size=120).map("".join),
       prefix=st.sampled_from(["", "tc:\n  ", "sandbox:\n  pools:\n    - ", "otlp: "]))
def test_any_text_loads_or_raises_config_error(tmp_path, text, prefix):
    f = tmp_path / "fuzz.yaml"
    f.write_text(prefix + text, encoding="utf-8", errors="surrogateescape")
    assert_loads_or_config_error(f)


@FUZZ
@given(env=st.dictionaries(st.sampled_from(sorted(config.ENV_KEYS)),
                           st.one_of(st.text(max_size=30), st.sampled_from(
                               ["[", "&a [*a]", "{a: 1}", "1e999", "-1", "true", "~", ".nan"])),
                           max_size=4),
       sets=st.lists(st.tuples(st.one_of(st.sampled_from(sorted(config.DOTTED_KEYS)),
                                         st.text(max_size=15)),
                               st.text(max_size=20)), max_size=3))
def test_any_environment_and_flags_load_or_raise_config_error(tmp_path, env, sets):
    f = tmp_path / "fuzz.yaml"
    f.write_text("log_level: info\n")
    assert_loads_or_config_error(f, env=env, overrides=[f"{k}={v}" for k, v in sets])
