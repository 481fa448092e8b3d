"""Where to send OTLP: a signal's endpoint, protocol, headers, timeout, TLS and compression, from the
config first and the standard OTEL_EXPORTER_OTLP_* variables for what it leaves empty."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Callable, Mapping
from urllib.parse import unquote, urlsplit

from spanlet.config import OtlpConfig
from spanlet.exporters.otlp.common import METRICS_PATH, TRACES_PATH

log = logging.getLogger(__name__)

GRPC, HTTP_PROTOBUF = "grpc", "http/protobuf"
DEFAULT_PROTOCOL = HTTP_PROTOBUF   # the OTLP exporter specification's default


@dataclass(frozen=True)
class Upstream:
    protocol: str                   # GRPC or HTTP_PROTOBUF
    endpoint: str                   # gRPC: host:port target; HTTP: the full URL
    insecure: bool                  # gRPC: plaintext (no TLS)
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0
    compression: str = "none"       # "gzip" or "none"
    certificate: str = ""           # CA bundle file for TLS; empty: system roots
    client_key: str = ""
    client_certificate: str = ""


def _env(environ: Mapping[str, str], name: str, signal: str = "traces") -> tuple[str, str] | None:
    """The signal's form of an OTEL_EXPORTER_OTLP_ variable (TRACES_,
    METRICS_), else the generic one, as (variable name, value); empty values
    count as unset."""
    for var in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
        value = environ.get(var, "").strip()
        if value:
            return var, value
    return None


def parse_headers(text: str, source: str = "headers") -> dict[str, str]:
    """`k1=v1,k2=v2` (W3C baggage-like), keys and values URL-decoded; keys
    lower-cased (gRPC metadata requires it, HTTP ignores case). Entries
    without '=' or with an empty key are skipped with a warning."""
    out: dict[str, str] = {}
    for n, item in enumerate(text.split(","), 1):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = unquote(key).strip().lower()
        if not sep or not key:
            # Its position, not its text: a malformed entry may still be a token.
            log.warning("%s: ignoring malformed header entry %d (no 'key=value')", source, n)
            continue
        out[key] = unquote(value).strip()
    return out


def _parse_bool(var: str, value: str) -> bool | None:
    v = value.strip().lower()
    if v in ("true", "false"):
        return v == "true"
    log.warning("%s=%r is not true or false; ignored", var, value)
    return None


# The signal's variable lookup that resolve_upstream hands its helpers:
# `env("PROTOCOL")` is _env(environ, "PROTOCOL", signal).
EnvLookup = Callable[[str], tuple[str, str] | None]


def resolve_upstream(cfg: OtlpConfig, environ: Mapping[str, str] = os.environ,
                     signal: str = "traces") -> Upstream | None:
    """Where and how to export `signal` ("traces" or "metrics"), or None when
    no endpoint is configured.

    Explicit configuration wins and the environment fills what it leaves
    empty, key by key; each helper below states its key's rule (shown for
    traces; for metrics read METRICS_ for TRACES_ and /v1/metrics for
    /v1/traces; the other signal's forms play no part). The TRACES_ form of a
    variable wins over the generic one. Invalid values in the environment are
    logged and ignored, as the OTel SDK specification asks."""
    def env(name: str) -> tuple[str, str] | None:
        return _env(environ, name, signal)

    protocol = _protocol(cfg, env)
    found = _endpoint(cfg, environ, signal)
    if found is None:
        return None
    endpoint, append_path = found
    target, insecure = _target(endpoint, protocol, _insecure_flag(env), append_path, signal)
    return Upstream(protocol=protocol, endpoint=target, insecure=insecure,
                    headers=tuple(sorted(_headers(cfg, env).items())),
                    timeout_s=_timeout_s(cfg, env), compression=_compression(env),
                    certificate=_pem_file(env, "CERTIFICATE"),
                    client_key=_pem_file(env, "CLIENT_KEY"),
                    client_certificate=_pem_file(env, "CLIENT_CERTIFICATE"))


def _protocol(cfg: OtlpConfig, env: EnvLookup) -> str:
    """cfg.upstream_protocol, else OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else
    http/protobuf (the specification's default)."""
    protocol = cfg.upstream_protocol
    env_protocol = env("PROTOCOL")
    if not protocol and env_protocol:
        var, value = env_protocol
        if value in (GRPC, HTTP_PROTOBUF):
            protocol = value
        else:
            log.warning("%s=%r is not supported (grpc, http/protobuf); using %s",
                        var, value, DEFAULT_PROTOCOL)
    return protocol or DEFAULT_PROTOCOL


def _endpoint(cfg: OtlpConfig, environ: Mapping[str, str],
              signal: str) -> tuple[str, bool] | None:
    """(endpoint, whether /v1/traces is to be appended to it), or None when
    none is set: cfg.upstream_endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    (used as-is), else OTEL_EXPORTER_OTLP_ENDPOINT (for http/protobuf the
    path /v1/traces is appended to it). A config endpoint with no path gets
    /v1/traces too."""
    signal_endpoint = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    if cfg.upstream_endpoint.strip():
        endpoint = cfg.upstream_endpoint.strip()
        return endpoint, urlsplit(endpoint).path in ("", "/") if "://" in endpoint else True
    if environ.get(signal_endpoint, "").strip():
        return environ[signal_endpoint].strip(), False
    if environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return environ["OTEL_EXPORTER_OTLP_ENDPOINT"].strip(), True
    return None


def _insecure_flag(env: EnvLookup) -> bool | None:
    """OTEL_EXPORTER_OTLP_[TRACES_]INSECURE as a bool, None when unset or invalid."""
    env_insecure = env("INSECURE")
    return _parse_bool(*env_insecure) if env_insecure else None


def _target(endpoint: str, protocol: str, insecure_flag: bool | None, append_path: bool,
            signal: str) -> tuple[str, bool]:
    """(the sender's target, whether it is plaintext). An http:// endpoint is
    plaintext, https:// is TLS; an endpoint without a scheme is plaintext only
    when OTEL_EXPORTER_OTLP_[TRACES_]INSECURE=true. gRPC gets host:port,
    http/protobuf the full URL, with /v1/traces where `append_path`."""
    scheme = endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""
    insecure = scheme == "http" if scheme else bool(insecure_flag)
    if protocol == GRPC:
        return (urlsplit(endpoint).netloc if scheme else endpoint.rstrip("/")), insecure
    target = endpoint if scheme else ("http://" if insecure else "https://") + endpoint
    if append_path:
        target = target.rstrip("/") + f"/v1/{signal}"
    return target, insecure


def _headers(cfg: OtlpConfig, env: EnvLookup) -> dict[str, str]:
    """OTEL_EXPORTER_OTLP_[TRACES_]HEADERS, with cfg.upstream_headers set on
    top (a key in both takes the config value)."""
    env_headers = env("HEADERS")
    headers = parse_headers(env_headers[1], env_headers[0]) if env_headers else {}
    headers.update({k.lower(): v for k, v in cfg.upstream_headers.items()})
    return headers


def _timeout_s(cfg: OtlpConfig, env: EnvLookup) -> float:
    """cfg.upstream_timeout_s when set in the config, else
    OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT (milliseconds), else the config default."""
    env_timeout = env("TIMEOUT")
    if "upstream_timeout_s" in cfg.model_fields_set or not env_timeout:
        return cfg.upstream_timeout_s
    var, value = env_timeout
    try:
        ms = float(value)
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError
        return ms / 1000.0
    except ValueError:
        log.warning("%s=%r is not a positive number of milliseconds; ignored", var, value)
        return cfg.upstream_timeout_s


def _compression(env: EnvLookup) -> str:
    """OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION: gzip or none (the default)."""
    env_compression = env("COMPRESSION")
    if not env_compression:
        return "none"
    var, value = env_compression
    if value.lower() in ("gzip", "none"):
        return value.lower()
    log.warning("%s=%r is not supported (gzip, none); ignored", var, value)
    return "none"


def _pem_file(env: EnvLookup, name: str) -> str:
    """The variable's value, empty when unset: OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE,
    _CLIENT_KEY and _CLIENT_CERTIFICATE name PEM files."""
    found = env(name)
    return found[1] if found else ""


# ---------------------------------------------------------------------------
# Where to send: resolve_upstream's rules for the metrics signal.

def resolve_metrics_upstream(cfg: OtlpConfig,
                             environ: Mapping[str, str] = os.environ) -> Upstream | None:
    """Where and how to export metrics, or None when no endpoint is set:
    resolve_upstream(cfg, environ, signal="metrics") (the METRICS_ forms of
    the variables, /v1/metrics appended where /v1/traces would be), with one
    rule more: a config endpoint is the span upstream's, so for http/protobuf
    a path of its own ending in /v1/traces is turned into /v1/metrics; any
    other path is used as-is (with a warning)."""
    up = resolve_upstream(cfg, environ, signal="metrics")
    endpoint = cfg.upstream_endpoint.strip()
    if (up is None or up.protocol != HTTP_PROTOBUF or "://" not in endpoint
            or urlsplit(endpoint).path in ("", "/")):
        return up                       # not the config's own path: resolve_upstream's rules
    if up.endpoint.endswith(TRACES_PATH):
        return replace(up, endpoint=up.endpoint[:-len(TRACES_PATH)] + METRICS_PATH)
    log.warning("otlp.upstream_endpoint %r names a path other than %s; metrics are sent there "
                "as-is (set OTEL_EXPORTER_OTLP_METRICS_ENDPOINT to send them elsewhere)",
                up.endpoint, TRACES_PATH)
    return up
