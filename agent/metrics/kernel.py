"""Kernel-layer metrics (METRICS.md #1–#5), read from the probes' BPF maps at
the moment they are asked for. One function per metric, named after it."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from spanlet.metrics import Family, HistogramSample, Sample, labels
from spanlet import runtimes
from spanlet.metrics.catalogue import family

# The kernel keeps log2 µs buckets of sync waits (bucket i: below 2^i µs);
# every second one is exported: 1 µs × 4^n, up to ~67 s.
SYNC_WAIT_BOUNDS_S = tuple((2 ** i) / 1e6 for i in range(0, 27, 2))
# kernel bucket i (waits below 2^i µs) → index of the first exported bound above it
_FOLD = [next((j for j, b in enumerate(SYNC_WAIT_BOUNDS_S) if (2 ** i) / 1e6 <= b),
              len(SYNC_WAIT_BOUNDS_S)) for i in range(64)]
# exported bucket j ← the kernel buckets _SLICES[j] (_FOLD never goes down)
_SLICES = [slice(_FOLD.index(j), len(_FOLD) - _FOLD[::-1].index(j)) if j in _FOLD else slice(0, 0)
           for j in range(len(SYNC_WAIT_BOUNDS_S) + 1)]

Workload = Callable[[int], dict[str, str]]   # cgroup id → namespace, pod, container labels


def _gpu_counts(fam: Family, counts: dict, workload: Workload, with_api: bool = True) -> Family:
    sums: dict = defaultdict(int)
    for (cgroup, modality, api), n in counts.items():
        extra = {"api": api.name} if with_api else {}
        sums[labels(**workload(cgroup), modality=modality.name, **extra)] += n
    fam.samples = [Sample(k, v) for k, v in sorted(sums.items())]
    return fam


def spanlet_gpu_kernel_launches_total(gpu, workload: Workload) -> Family:
    return _gpu_counts(family("spanlet_gpu_kernel_launches_total"), gpu.launches(), workload)


def spanlet_gpu_graph_launches_total(gpu, workload: Workload) -> list[Family]:
    """#1's companion (graph replays) and the replays whose kernels are unknown."""
    return [_gpu_counts(family("spanlet_gpu_graph_launches_total"), gpu.graph_launches(), workload, False),
            _gpu_counts(family("spanlet_gpu_unknown_graph_launches_total"), gpu.unknown_graph_launches(),
                        workload, False)]


def spanlet_gpu_memcpy_bytes_total(gpu, workload: Workload) -> Family:
    sums: dict = defaultdict(int)
    for (cgroup, direction), n in gpu.memcpy_bytes().items():
        sums[labels(**workload(cgroup), direction=direction)] += n
    fam = family("spanlet_gpu_memcpy_bytes_total")
    fam.samples = [Sample(k, v) for k, v in sorted(sums.items())]
    return fam


def spanlet_gpu_sync_wait_seconds(gpu, workload: Workload) -> Family:
    fam = family("spanlet_gpu_sync_wait_seconds")
    acc: dict = {}
    for (cgroup, modality, api), (count, total_ns, kernel_buckets) in gpu.sync_waits().items():
        lab = labels(**workload(cgroup), modality=modality.name, api=api.name)
        # fold the log2 buckets into the exported ones
        per = [sum(kernel_buckets[sl]) for sl in _SLICES]
        prev = acc.get(lab)
        if prev is not None:
            per = [a + b for a, b in zip(prev[0], per)]
            count += prev[1]
            total_ns += prev[2]
        acc[lab] = (per, count, total_ns)
    fam.samples = [HistogramSample(lab, SYNC_WAIT_BOUNDS_S, tuple(per), total / 1e9, count)
                   for lab, (per, count, total) in sorted(acc.items())]
    return fam


def spanlet_network_bytes_total(tc) -> list[Family]:
    nbytes = family("spanlet_network_bytes_total")
    packets = family("spanlet_network_packets_total")
    for (direction, proto, modality), (p, b) in sorted(tc.totals().items()):
        lab = labels(direction=direction, protocol=proto, modality=modality)
        nbytes.samples.append(Sample(lab, b))
        packets.samples.append(Sample(lab, p))
    return [nbytes, packets]


def spanlet_jitter_sensitivity_score(tc) -> Family:
    fam = family("spanlet_jitter_sensitivity_score")
    fam.samples = [Sample(labels(protocol=p, modality=m), st.jss)
                   for (p, m), st in sorted(tc.jitter().items())]
    return fam


def _violations(fam: Family, counts: dict, workload: Workload) -> Family:
    sums: dict = defaultdict(int)
    for (cgroup, rule, action), n in counts.items():
        sums[labels(**workload(cgroup), rule=rule, action=action)] += n
    fam.samples = [Sample(k, v) for k, v in sorted(sums.items())]
    return fam


def spanlet_sandbox_violations_total(sandbox, workload: Workload) -> Family:
    """#5: judged at the mmap call, plus those only the /proc sweep found."""
    counts: dict = defaultdict(int, sandbox.violations())
    for key, n in sandbox.sweep_violations().items():
        counts[key] += n
    return _violations(family("spanlet_sandbox_violations_total"), counts, workload)


def sandbox_self_metrics(sandbox, workload: Workload) -> list[Family]:
    """How the sandbox saw what it judged: late (sweep), unresolved, adopted."""
    return [
        _violations(family("spanlet_sandbox_sweep_violations_total"),
                    sandbox.sweep_violations(), workload),
        family("spanlet_sandbox_unresolved_opens_total", [Sample((), sandbox.unresolved_opens())]),
        family("spanlet_sandbox_untracked_fds_total", [Sample((), sandbox.untracked_fds())]),
        family("spanlet_sandbox_adopted_fds_total", [Sample((), sandbox.adopted_fds)]),
        family("spanlet_sandbox_sweep_seconds", [Sample((), sandbox.sweep_seconds)]),
    ]


def spanlet_span_marks_total(span_ctx) -> list[Family]:
    """Marker calls the span context uprobe saw: zero while spans flow means
    the marker is not attached in the serving processes. And those no span
    can have (taken as leaving the span)."""
    return [family("spanlet_span_marks_total", [Sample((), span_ctx.marks())]),
            family("spanlet_span_marks_invalid_total", [Sample((), span_ctx.invalid_marks())])]


def spanlet_client_thread_only_processes(span_ctx) -> Family:
    """Processes followed per thread only, by each reason their marks carry
    (a process with two reasons counts under both); every reason present,
    0 where none."""
    counts = {name: 0 for name in runtimes.names(~0)}
    for flags in span_ctx.thread_only_processes().values():
        for name in runtimes.names(flags):
            counts[name] += 1
    return family("spanlet_client_thread_only_processes",
                  [Sample(labels(runtime=r), n) for r, n in counts.items()])


def tc_self_metrics(tc) -> list[Family]:
    """Packets and headers the classifier looked at and did not use, by reason."""
    rejected = family("spanlet_tc_rejected_total")
    rejected.samples = [Sample(labels(reason=r), n) for r, n in sorted(tc.rejected().items())]
    uncounted = family("spanlet_tc_uncounted_packets_total")
    uncounted.samples = [Sample(labels(reason=r), n) for r, n in sorted(tc.uncounted().items())]
    return [rejected, uncounted]
