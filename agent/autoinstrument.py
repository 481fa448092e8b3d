"""Zero-code instrumentation: under `opentelemetry-instrument` (the OpenTelemetry
Python auto-instrumentation, package opentelemetry-distro) an app gets the
spanlet span processor on its tracer provider without a line of code.

The package declares this instrumentor under the `opentelemetry_instrumentor`
entry points (pyproject.toml), which the auto-instrumentation loads after its
configurator has made the SDK tracer provider from the OTEL_* settings, so
exporters, sampler and resource stay as those settings say; this only adds the
processor to that provider. Turned off like any instrumentation,
OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=spanlet, or with SPANLET_AUTOINSTRUMENT=off.

Nothing here runs unless the auto-instrumentation loads it: importing spanlet
alone imports neither this module nor opentelemetry-instrumentation."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from spanlet.client import SpanletSpanProcessor

log = logging.getLogger("spanlet.autoinstrument")
OFF = {"0", "off", "false", "no", "disabled"}


def _processors(provider) -> list:
    """The span processors of an SDK provider (its multi-processor's list)."""
    multi = getattr(provider, "_active_span_processor", None)
    return list(getattr(multi, "_span_processors", ()))


class SpanletInstrumentor(BaseInstrumentor):
    """Adds one SpanletSpanProcessor to the global (or given) SDK tracer provider."""

    _processor: SpanletSpanProcessor | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return []     # instruments no library: the tracer provider itself

    def _instrument(self, **kwargs) -> None:
        if os.environ.get("SPANLET_AUTOINSTRUMENT", "").strip().lower() in OFF:
            log.info("spanlet: SPANLET_AUTOINSTRUMENT=off, no span processor added")
            return
        provider = kwargs.get("tracer_provider") or trace.get_tracer_provider()
        if not hasattr(provider, "add_span_processor"):
            log.warning("spanlet: the tracer provider is a %s, not the OpenTelemetry SDK's, so the "
                        "spanlet processor is not added (opentelemetry-distro, or another "
                        "configurator, makes the SDK's)", type(provider).__name__)
            return
        if any(isinstance(p, SpanletSpanProcessor) for p in _processors(provider)):
            return    # the app added one itself
        processor = SpanletSpanProcessor()
        provider.add_span_processor(processor)
        type(self)._processor = processor
        if not processor.active:
            log.warning("spanlet: the span marker library could not be loaded; spans get no "
                        "kernel facts")

    def _uninstrument(self, **kwargs) -> None:
        # The SDK cannot remove a processor: this one stops marking instead.
        processor, type(self)._processor = type(self)._processor, None
        if processor is not None:
            processor.shutdown()
