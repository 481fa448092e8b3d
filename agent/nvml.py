"""NVML device layer (METRICS.md metrics 6-8): a thread that samples each GPU's SM
utilisation, memory and PCIe throughput through pynvml, keyed by GPU UUID.
Whatever NVML cannot give is absent, logged once and counted; nothing raises."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from spanlet.config import NvmlSettings

log = logging.getLogger("spanlet.nvml")

# Usable GB/s (10^9 bytes) per lane and direction, after line encoding (8b/10b for
# gen 1-2, 128b/130b for gen 3-5, FLIT mode for gen 6). Source: the PCI-SIG base
# specifications as tabulated in https://en.wikipedia.org/wiki/PCI_Express
# ("Comparison table": 250 MB/s, 500 MB/s, 984.6 MB/s, 1.969, 3.938, 7.563 GB/s).
PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# nvmlDeviceGetPcieThroughput answers KB/s measured over 20 ms; NVML does not say
# which kilo, we take the SI one, like the per-lane table above.
PCIE_THROUGHPUT_UNIT_BYTES = 1000

DEFAULT_LIBRARY = "libnvidia-ml.so.1"


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one poll; None where the NVML call behind a value failed."""
    gpu: str                        # UUID, the `gpu` label
    index: int
    name: str | None = None
    sm_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    pcie_tx_ratio: float | None = None
    pcie_rx_ratio: float | None = None

    @property
    def memory_used_ratio(self) -> float | None:
        if self.memory_used_bytes is None or not self.memory_total_bytes:
            return None
        return self.memory_used_bytes / self.memory_total_bytes


@dataclass(frozen=True)
class NvmlStatus:
    available: bool
    reason: str = ""                # why not, when not available
    gpus: int = 0


@dataclass(frozen=True)
class _Device:
    index: int
    uuid: str
    name: str | None
    handle: Any


def pcie_link_bytes_per_s(generation: int, width: int) -> float | None:
    """Capacity of one direction of a link; None for an unknown generation."""
    lane = PCIE_LANE_GB_PER_S.get(generation)
    if lane is None or width <= 0:
        return None
    return lane * 1e9 * width


class NvmlPoller:
    """Samples every GPU each poll_interval_s on its own thread. Read it with
    snapshot() (current values), window() (memory peak since the last window),
    status and errors (failed NVML calls by name, for self-metrics)."""

    def __init__(self, settings: Any = NvmlSettings()):
        self.settings = settings
        self._lock = threading.Lock()        # guards the values below it
        self._latest: dict[str, GpuSample] = {}
        self._peaks: dict[str, float] = {}
        self._errors: Counter[str] = Counter()
        self.polls = 0
        self._open_lock = threading.Lock()   # one open, one shutdown
        self._status = NvmlStatus(False, "not started")
        self._nvml: Any = None               # pynvml, once nvmlInit succeeded
        self._devices: list[_Device] = []
        self._memory_v2 = True               # until the driver refuses nvmlDeviceGetMemoryInfo_v2
        self._opened = False
        self._logged: set[tuple[str, str]] = set()   # (call, gpu) said once
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def status(self) -> NvmlStatus:
        return self._status

    @property
    def errors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._errors)

    def snapshot(self) -> dict[str, GpuSample]:
        with self._lock:
            return dict(self._latest)

    def window(self) -> dict[str, float]:
        """Peak used/total memory per GPU since the previous call. The next
        window starts from the latest sample, so it is never empty while the
        GPU answers."""
        with self._lock:
            peaks = self._peaks
            self._peaks = {gpu: r for gpu, s in self._latest.items()
                           if (r := s.memory_used_ratio) is not None}
            return peaks

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="nvml", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the thread and shuts NVML down; safe twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():      # stuck in the driver: leave NVML be
                log.warning("NVML poller did not stop within %.1f s", timeout_s)
                return
        with self._open_lock:
            if self._nvml is not None:
                self._call("nvmlShutdown", "")
                self._nvml = None
                self._status = NvmlStatus(False, "stopped")

    def _run(self) -> None:
        while self.open().available:
            self.poll_once()
            if self._stop.wait(self.settings.poll_interval_s):
                return

    def open(self) -> NvmlStatus:
        """Initialises NVML and lists the GPUs on the first call; later calls
        return that outcome (said once in the log when NVML is unusable)."""
        with self._open_lock:
            if not self._opened and not self._stop.is_set():
                self._opened = True
                self._status = self._init()
                if not self._status.available:
                    level = logging.INFO if not self.settings.enabled else logging.WARNING
                    log.log(level, "%s: GPU device metrics are off", self._status.reason)
            return self._status

    def _init(self) -> NvmlStatus:
        if not self.settings.enabled:
            return NvmlStatus(False, "NVML disabled by config (nvml.enabled)")
        try:
            import pynvml
        except ImportError as e:
            return NvmlStatus(False, f"NVML not available (pynvml not importable: {e})")
        library = self.settings.library
        if library:
            # pynvml opens libnvidia-ml.so.1 by name; the dynamic linker hands it
            # this copy, already loaded under that soname.
            try:
                ctypes.CDLL(library)
            except OSError as e:
                self._count("nvmlInit")
                return NvmlStatus(False, f"NVML not available ({library} not loadable: {e})")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            self._count("nvmlInit")
            return NvmlStatus(False, f"NVML not available ({library or DEFAULT_LIBRARY} not found)")
        except Exception as e:
            self._count("nvmlInit")
            return NvmlStatus(False, f"NVML not available (nvmlInit failed: {e})")
        self._nvml = pynvml
        count = self._call("nvmlDeviceGetCount", "")
        devices = [d for i in range(count or 0) if (d := self._device(i)) is not None]
        self._devices = devices
        if not devices:
            return NvmlStatus(False, "NVML found no usable GPU")
        log.info("NVML: %d GPU(s): %s", len(devices), ", ".join(d.uuid for d in devices))
        return NvmlStatus(True, "", len(devices))

    def _device(self, index: int) -> _Device | None:
        where = f"GPU index {index}"
        handle = self._call("nvmlDeviceGetHandleByIndex", where, index)
        if handle is None:
            return None
        uuid = self._call("nvmlDeviceGetUUID", where, handle)
        if not uuid:
            return None
        return _Device(index, uuid, self._call("nvmlDeviceGetName", uuid, handle), handle)

    # -- sampling ------------------------------------------------------------

    def poll_once(self) -> None:
        """Samples every GPU once (the thread calls this every poll_interval_s)."""
        if not self.open().available:
            return
        samples = {d.uuid: self._sample(d) for d in self._devices}
        with self._lock:
            self._latest = samples
            for gpu, s in samples.items():
                if (r := s.memory_used_ratio) is not None:
                    self._peaks[gpu] = max(r, self._peaks.get(gpu, r))
            self.polls += 1

    def _sample(self, d: _Device) -> GpuSample:
        util = self._call("nvmlDeviceGetUtilizationRates", d.uuid, d.handle)
        mem = self._memory(d)
        tx, rx = self._pcie_ratios(d)
        return GpuSample(
            gpu=d.uuid, index=d.index, name=d.name,
            sm_utilization_ratio=None if util is None else util.gpu / 100,
            memory_used_bytes=None if mem is None else mem.used,
            memory_total_bytes=None if mem is None else mem.total,
            memory_free_bytes=None if mem is None else mem.free,
            pcie_tx_ratio=tx, pcie_rx_ratio=rx)

    def _memory(self, d: _Device) -> Any:
        """The device's memory as nvidia-smi shows it: version 2 of the call,
        whose `used` leaves out what the driver reserves (616 MiB on an H200
        with driver 580; version 1 counts it as used, and as not free). A
        driver without version 2 (before 510) is asked version 1 from then on."""
        version = getattr(self._nvml, "nvmlMemory_v2", None)
        if self._memory_v2 and version is not None:
            try:
                return self._nvml.nvmlDeviceGetMemoryInfo(d.handle, version=version)
            except Exception as e:      # NVMLError: FunctionNotFound, NotSupported, a version mismatch
                self._memory_v2 = False
                log.info("NVML nvmlDeviceGetMemoryInfo_v2 unavailable (%s: %s): GPU memory used "
                         "includes what the driver reserves", type(e).__name__, e)
        return self._call("nvmlDeviceGetMemoryInfo", d.uuid, d.handle)

    def _pcie_ratios(self, d: _Device) -> tuple[float | None, float | None]:
        # Read every poll: an idle GPU drops its link to a lower generation.
        gen = self._call("nvmlDeviceGetCurrPcieLinkGeneration", d.uuid, d.handle)
        width = self._call("nvmlDeviceGetCurrPcieLinkWidth", d.uuid, d.handle)
        if gen is None or width is None:
            return None, None
        capacity = pcie_link_bytes_per_s(gen, width)
        if capacity is None:
            self._report("pcie_link_capacity", d.uuid,
                         f"no known capacity for PCIe gen {gen} x{width}")
            return None, None

        def ratio(counter: int) -> float | None:
            kbps = self._call("nvmlDeviceGetPcieThroughput", d.uuid, d.handle, counter)
            if kbps is None:
                return None
            return min(1.0, kbps * PCIE_THROUGHPUT_UNIT_BYTES / capacity)

        return ratio(self._nvml.NVML_PCIE_UTIL_TX_BYTES), ratio(self._nvml.NVML_PCIE_UTIL_RX_BYTES)

    # -- failures ------------------------------------------------------------

    def _call(self, name: str, gpu: str, *args: Any) -> Any:
        """pynvml.<name>(*args), or None when it fails (logged once per call
        name and GPU, counted each time under the name)."""
        try:
            return getattr(self._nvml, name)(*args)
        except Exception as e:          # NVMLError, or anything from ctypes
            self._report(name, gpu, f"{type(e).__name__}: {e}")
            return None

    def _report(self, name: str, gpu: str, what: str) -> None:
        with self._lock:
            self._errors[name] += 1
            first = (name, gpu) not in self._logged
            self._logged.add((name, gpu))
        if first:
            log.warning("NVML %s failed%s: %s; that value is absent (further failures "
                        "are only counted)", name, f" for {gpu}" if gpu else "", what)

    def _count(self, name: str) -> None:
        with self._lock:
            self._errors[name] += 1
