"""Started OTLP receivers on free loopback ports, for the receiver's tests."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from spanlet.config import OtlpConfig
from spanlet.exporters.otlp.receiver import OtlpReceiver


@contextmanager
def receivers() -> Iterator[Callable[..., OtlpReceiver]]:
    """make(on_request, **cfg) -> a started receiver; every one is stopped after."""
    made: list[OtlpReceiver] = []

    def make(on_request, **kw) -> OtlpReceiver:
        cfg = OtlpConfig(receiver_address="127.0.0.1", grpc_port=0, http_port=0, **kw)
        rx = OtlpReceiver(cfg, on_request)
        made.append(rx)
        rx.start()
        return rx

    try:
        yield make
    finally:
        for rx in made:
            rx.stop(0)
