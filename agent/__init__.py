"""spanlet: per-node eBPF observability agent for multimodal model serving.

The client API for serving processes is ``from spanlet import
SpanletSpanProcessor``; it is imported on first use, so that ``import spanlet``
(the daemon's parts, the CLI) costs nothing and the client pulls in nothing
but the OpenTelemetry SDK and the marker.
"""

__version__ = "0.1.0"
__all__ = ["SpanletSpanProcessor", "__version__"]


def __getattr__(name: str):
    if name == "SpanletSpanProcessor":
        from spanlet.client import SpanletSpanProcessor

        return SpanletSpanProcessor
    raise AttributeError(f"module 'spanlet' has no attribute {name!r}")
