"""An OTel SDK process that exports spans to the agent's receiver, for the
tests of how the agent establishes a span's sender from the connection.

    otlp_sender_child.py grpc|http ENDPOINT NAME
    commands on stdin (child_loop): "spans N" ends N spans named NAME-<i>, each
    exported at once (SimpleSpanProcessor) on the exporter's one connection.
"""

import sys

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import child_loop

transport, endpoint, name = sys.argv[1], sys.argv[2], sys.argv[3]
if transport == "grpc":
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
else:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    exporter = OTLPSpanExporter(endpoint=endpoint)
provider = TracerProvider(resource=Resource.create({"service.name": name}))
provider.add_span_processor(SimpleSpanProcessor(exporter))
tracer = provider.get_tracer("otlp-sender-child")


def spans(args) -> None:
    for i in range(int(args[0])):
        with tracer.start_as_current_span(f"{name}-{i}"):
            pass


child_loop.serve(provider, {"spans": spans})
