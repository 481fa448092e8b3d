"""Config: file, then SPANLET_* environment, then --set; bad input names key and source."""

import pytest

from spanlet import config


def write(tmp_path, text):
    p = tmp_path / "spanlet.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_documented_ones():
    cfg = config.load(env={})
    assert cfg.data_dir == "/var/lib/spanlet"
    assert cfg.sandbox.mode == "audit"
    assert cfg.sandbox.prefixes == ["/dev/shm/tensor_pool/"]
    assert cfg.tc.interfaces == []          # every non-loopback interface
    assert cfg.tc.tau_plc_ms + cfg.tc.delta_buffer_ms == 40.0
    assert cfg.gpu.launch_events == "off"
    # a bare YAML `off` is a boolean: still the mode "off", from the file and from --set
    assert config.load(env={}, overrides=["gpu.launch_events=off"]).gpu.launch_events == "off"
    assert not cfg.gpu.launch_timing and not cfg.gpu.runtime_hooks
    assert cfg.gpu.sampled_events_per_span == 4 and cfg.join.span_facts_max == 65_536
    assert cfg.join.span_facts_max_per_cgroup == 16_384
    assert (cfg.join.batch_max_pending_per_pod, cfg.join.batch_max_held_per_pod) == (16_384, 25_000)


def test_the_per_pod_bounds_come_from_the_environment_and_reach_the_kernel_programs():
    from spanlet.probes.gpu import GpuProbe

    cfg = config.load(env={"SPANLET_JOIN_SPAN_FACTS_MAX_PER_CGROUP": "500",
                           "SPANLET_JOIN_BATCH_MAX_PENDING_PER_POD": "70"})
    assert cfg.join.span_facts_max_per_cgroup == 500 and cfg.join.batch_max_pending_per_pod == 70
    flags = GpuProbe(cfg).compile_flags("/pins")
    assert "-DSPANLET_SPAN_FACTS_MAX_PER_CGROUP=500" in flags


def test_every_key_has_an_environment_variable():
    assert config.ENV_KEYS["SPANLET_DATA_DIR"] == ("data_dir",)
    assert config.ENV_KEYS["SPANLET_SANDBOX_MODE"] == ("sandbox", "mode")
    assert config.ENV_KEYS["SPANLET_TC_TAU_PLC_MS"] == ("tc", "tau_plc_ms")


def test_precedence_file_then_env_then_flags(tmp_path):
    f = write(tmp_path, "sandbox:\n  mode: enforce\ntc:\n  interfaces: [eth9]\ndata_dir: /x\n")
    cfg = config.load(f, env={"SPANLET_TC_INTERFACES": "eth0,eth1", "SPANLET_DATA_DIR": "/y"},
                      overrides=["data_dir=/z"])
    assert cfg.sandbox.mode == "enforce"          # file
    assert cfg.tc.interfaces == ["eth0", "eth1"]   # env over file, comma list
    assert cfg.data_dir == "/z"                    # flag over env


def test_env_values_are_typed():
    cfg = config.load(env={"SPANLET_TC_PORT_MODALITY": "{8000: audio, 9000: video}",
                           "SPANLET_TC_ENABLED": "false", "SPANLET_RINGBUF_PAGES": "64"})
    assert cfg.tc.port_modality == {8000: config.Modality.audio, 9000: config.Modality.video}
    assert cfg.tc.enabled is False
    assert cfg.ringbuf_pages == 64


@pytest.mark.parametrize("text, expected", [
    ("tc:\n  interfacez: [eth0]\n", "unknown key 'tc.interfacez'"),
    ("bogus: 1\n", "unknown key 'bogus'"),
    ("tc:\n  max_flows: lots\n", "key 'tc.max_flows': Input should be a valid integer"),
    ("tc:\n  max_flows: 1\n", "key 'tc.max_flows': Input should be greater than or equal to 64"),
    ("ringbuf_pages: 100\n", "key 'ringbuf_pages': 100 is not a power of two"),
    ("tc:\n  port_modality: {70000: audio}\n", "port 70000 is not in 1..65535"),
    ("tc:\n  port_modality: {80: smell}\n", "key 'tc.port_modality.80'"),
    ("sandbox:\n  mode: kill\n", "key 'sandbox.mode': Input should be 'audit' or 'enforce'"),
    ("sandbox:\n  pools: [{path: /etc/passwd}]\n", "is not under any of the prefixes"),
    ("sandbox:\n  pools: [{path: /dev/shm/tensor_pool/a, grants: [{access: rw}]}]\n",
     "a grant needs at least one of 'pids' or 'cgroups'"),
])
def test_bad_file_names_key_and_file(tmp_path, text, expected):
    f = write(tmp_path, text)
    with pytest.raises(config.ConfigError) as e:
        config.load(f, env={})
    assert expected in str(e.value)
    assert str(f) in str(e.value)


def test_bad_env_names_the_variable():
    with pytest.raises(config.ConfigError) as e:
        config.load(env={"SPANLET_SANDBOX_MODE": "kill"})
    assert "environment variable SPANLET_SANDBOX_MODE: key 'sandbox.mode'" in str(e.value)


def test_unknown_override_key():
    with pytest.raises(config.ConfigError, match="unknown key 'tc.nope'"):
        config.load(env={}, overrides=["tc.nope=1"])


@pytest.mark.parametrize("text, expected", [
    ("tc: [unclosed\n", "not valid YAML"),
    ("- just\n- a list\n", "top level must be a mapping"),
])
def test_malformed_files(tmp_path, text, expected):
    with pytest.raises(config.ConfigError, match=expected):
        config.load(write(tmp_path, text), env={})


def test_missing_file_is_named(tmp_path):
    with pytest.raises(config.ConfigError, match="nope.yaml"):
        config.load(tmp_path / "nope.yaml", env={})


def test_config_file_from_environment(tmp_path):
    f = write(tmp_path, "log_level: debug\n")
    assert config.load(env={"SPANLET_CONFIG": str(f)}).log_level == "debug"


def test_relative_paths_are_made_absolute_at_load(tmp_path, monkeypatch):
    """BCC changes the working directory while it compiles, beside the agent's
    other start-up work: a relative path must not depend on it."""
    from spanlet import config
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret/token").write_text("t0ken\n")
    cfg = config.load(env={}, overrides=["nvml.library=lib/libnvidia-ml.so.1", "data_dir=data",
                                         "otlp.bearer_token_file=secret/token"])
    assert cfg.nvml.library == str(tmp_path / "lib/libnvidia-ml.so.1")
    assert cfg.data_dir == str(tmp_path / "data")
    assert cfg.otlp.bearer_token_file == str(tmp_path / "secret/token")
    assert config.load(env={}, overrides=["nvml.library=libnvidia-ml.so.1"]).nvml.library == \
        "libnvidia-ml.so.1"                       # a name for the dynamic linker stays one
    assert config.load(env={}).admin_socket == "/run/spanlet/admin.sock"
