"""The zero-code instrumentor (spanlet.autoinstrument): declared where the
OpenTelemetry auto-instrumentation looks, it adds one spanlet processor to the
SDK provider it is given, none to a provider that is not the SDK's, and none
when turned off."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import ProxyTracerProvider

from spanlet import SpanletSpanProcessor
from spanlet.autoinstrument import SpanletInstrumentor, _processors


@pytest.fixture
def instrumentor():
    inst = SpanletInstrumentor()
    yield inst
    inst.uninstrument()


def _spanlet(provider) -> list:
    return [p for p in _processors(provider) if isinstance(p, SpanletSpanProcessor)]


def test_the_entry_point_is_the_instrumentor():
    [ep] = [e for e in entry_points(group="opentelemetry_instrumentor") if e.name == "spanlet"]
    assert ep.load() is SpanletInstrumentor


def test_adds_one_processor_to_the_sdk_provider(instrumentor):
    provider = TracerProvider()
    instrumentor.instrument(tracer_provider=provider)
    [p] = _spanlet(provider)
    assert p.active            # the package's marker loaded
    instrumentor.uninstrument()
    assert not p.active        # stops marking: the SDK cannot remove a processor


def test_a_processor_the_app_added_is_not_doubled(instrumentor):
    provider = TracerProvider()
    mine = SpanletSpanProcessor()
    provider.add_span_processor(mine)
    instrumentor.instrument(tracer_provider=provider)
    assert _spanlet(provider) == [mine]
    mine.shutdown()


def test_a_provider_that_is_not_the_sdks_gets_nothing_and_a_warning(instrumentor, caplog):
    with caplog.at_level(logging.WARNING, logger="spanlet.autoinstrument"):
        instrumentor.instrument(tracer_provider=ProxyTracerProvider())
    assert "not the OpenTelemetry SDK's" in caplog.text


@pytest.mark.parametrize("value", ["off", "0", "false", "OFF"])
def test_spanlet_autoinstrument_off(instrumentor, monkeypatch, value):
    monkeypatch.setenv("SPANLET_AUTOINSTRUMENT", value)
    provider = TracerProvider()
    instrumentor.instrument(tracer_provider=provider)
    assert _spanlet(provider) == []
