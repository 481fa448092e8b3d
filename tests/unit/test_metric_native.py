"""metric_samples rows stored from the series as a Native block
(metric_native.py) are the rows rows.metric_rows builds in Python, value for
value: random families of every type (counters, gauges, histograms,
summaries, families mixing samples and histograms), odd label texts (empty,
unicode, quotes, zero bytes, long), labels out of order or with a name twice,
odd numbers (NaN, infinities, huge counts), stored both ways into two tables
of a real chdb store and read back column by column. Batches the Native
block cannot hold as given go the Python way, and are still exact."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spanlet.exporters.clickhouse import BackendError, metric_native, rows
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
from spanlet.exporters.clickhouse.sink import decode_batch, encode_batch
from spanlet.metrics import Family, HistogramSample, Sample, labels

NOW = time.time_ns() - 3600 * 1_000_000_000   # inside the TTL
READ = ("toUnixTimestamp64Nano(Timestamp), MetricName, MetricType, Unit, Labels, Value, Count, Sum, "
        "Bounds, BucketCounts, LabelsHash")


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    b = ChdbBackend(str(tmp_path_factory.mktemp("metrics") / "store"))
    b.ensure_schema()
    create = b.query("SELECT create_table_query FROM system.tables "
                     "WHERE database = 'spanlet' AND name = 'metric_samples'")[0][0]
    b.query(create.replace("spanlet.metric_samples", "spanlet.metric_samples_python"))
    yield b
    b.close()


def _clear(backend):
    for table in ("metric_samples", "metric_samples_python"):
        backend.query(f"TRUNCATE TABLE spanlet.{table}")


def _stored(backend, table: str) -> list[list]:
    # NaN reads back as null in JSON: compare its text
    got = backend.query(f"SELECT {READ}, toString(Value), toString(Sum), arrayMap(x -> toString(x), Bounds) "
                        f"FROM spanlet.{table} ORDER BY MetricName, LabelsHash, Count, toString(Value), "
                        "toString(Sum), toString(Bounds), toString(BucketCounts)")
    return [list(r) for r in got]


def _both_ways(backend, fams, ts=NOW) -> tuple[list, list]:
    _clear(backend)
    backend.insert("metric_samples", rows.METRIC_SERIES_COLUMNS, rows.metric_series_rows(fams, ts))
    backend.insert("metric_samples_python", rows.METRIC_COLUMNS, rows.metric_rows(fams, ts))
    return _stored(backend, "metric_samples"), _stored(backend, "metric_samples_python")


texts = st.one_of(st.sampled_from(["", "a", "pod-1", "x'\"`\\", "日本語", "é", "\t\n", "a" * 200, "{}", "[]",
                                   "\x00z", "NaN"]),
                  st.text(max_size=20))
names = st.one_of(st.sampled_from(["pod", "namespace", "container", "api", "", "le", "ü"]), st.text(max_size=8))
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**53, 2**53),
                    st.sampled_from([0.0, -0.0, 1e-300, 2.5e-9]))
counts = st.integers(0, 2**64 - 1)
sorted_labels = st.dictionaries(names, texts, max_size=6).map(lambda d: tuple(sorted(d.items())))   # as labels() makes them
any_labels = st.one_of(sorted_labels, st.lists(st.tuples(names, texts), max_size=5).map(tuple))


@st.composite
def histogram(draw, label_st):
    bounds = tuple(sorted(draw(st.lists(st.floats(allow_nan=False), max_size=6))))
    buckets = tuple(draw(st.lists(counts, min_size=len(bounds) + 1, max_size=len(bounds) + 1)))
    return HistogramSample(draw(label_st), bounds, buckets, draw(numbers), draw(counts))


@st.composite
def family(draw, label_st=sorted_labels):
    kind = draw(st.sampled_from(["counter", "gauge", "histogram", "summary", "mixed"]))
    plain = st.builds(Sample, label_st, numbers)
    if kind == "histogram":
        samples = draw(st.lists(histogram(label_st), max_size=8))
    elif kind in ("summary", "mixed"):
        samples = draw(st.lists(st.one_of(plain, histogram(label_st)), max_size=8))
    else:
        samples = draw(st.lists(plain, max_size=8))
    return Family(draw(st.sampled_from(["spanlet_a_total", "spanlet_b_seconds", "x", "日本"])),
                  kind if kind != "mixed" else "histogram", "", draw(st.sampled_from(["", "seconds", "bytes"])),
                  samples)


@pytest.mark.parametrize("repeat", range(4))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fams=st.lists(family(), max_size=6))
def test_series_are_stored_as_the_python_rows(backend, repeat, fams):
    native, python = _both_ways(backend, fams)
    assert native == python
    assert len(python) == sum(len(f.samples) for f in fams)


@pytest.mark.parametrize("repeat", range(3))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fams=st.lists(family(any_labels), max_size=5))
def test_labels_out_of_order_or_twice_are_stored_as_the_python_rows(backend, repeat, fams):
    native, python = _both_ways(backend, fams)
    assert native == python


@pytest.mark.parametrize("repeat", range(3))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fams=st.lists(family(), min_size=1, max_size=4))
def test_series_read_back_from_the_spool_are_stored_the_same(backend, repeat, fams):
    series = rows.metric_series_rows(fams, NOW)
    _, columns, spooled = decode_batch(encode_batch("metric_samples", rows.METRIC_SERIES_COLUMNS, series))
    assert tuple(columns) == rows.METRIC_SERIES_COLUMNS
    _clear(backend)
    backend.insert("metric_samples", columns, spooled)
    backend.insert("metric_samples_python", rows.METRIC_COLUMNS, rows.metric_rows(fams, NOW))
    assert _stored(backend, "metric_samples") == _stored(backend, "metric_samples_python")


def test_a_big_batch_with_many_distinct_texts(backend):
    n = 70_000          # past 65,536 distinct label values: 32-bit LowCardinality indexes
    fams = [Family("spanlet_big_total", "counter", "", "", [Sample(labels(pod=f"p{i}", ns="n"), i) for i in range(n)]),
            Family("spanlet_big_seconds", "histogram", "", "seconds",
                   [HistogramSample(labels(pod=f"p{i}"), (0.5, 1.0), (i, 1, 2), 0.25 * i, i + 3)
                    for i in range(0, n, 7)])]
    native, python = _both_ways(backend, fams)
    assert native == python


@pytest.mark.parametrize("fams", [
    [Family("m", "gauge", "", "", [Sample((("a", 1), ("b", 2.5)), 1.0)])],                 # values not str
    [Family("m", "gauge", "", "", [Sample((("b", "x"), ("a", "y")), 1.0)])],               # out of order
    [Family("m", "gauge", "", "", [Sample((("a", "x"), ("a", "y")), 1.0)])],               # a name twice
    [Family("m", "gauge", "", "", [Sample(labels(a="x"), "2.5")])],                        # a value float() reads
    [Family("m", "histogram", "", "", [HistogramSample((), (1.0,), (1, 2), 1.0, 3.0)])],    # a float count
], ids=["int-values", "order", "twice", "str-value", "float-count"])
def test_batches_native_cannot_hold_go_the_python_way(backend, fams):
    native, python = _both_ways(backend, fams)
    assert native == python and native


def test_unsuitable_is_raised_for_what_native_cannot_hold():
    for fams in ([Family("m", "gauge", "", "", [Sample((("b", "x"), ("a", "y")), 1.0)])],
                 [Family("m", "gauge", "", "", [Sample((("a", 1),), 1.0)])],
                 [Family("m", "histogram", "", "", [HistogramSample((), (), (1,), 1.0, -1)])]):
        with pytest.raises(metric_native.Unsuitable):
            metric_native.encode(rows.metric_series_rows(fams, NOW))
    metric_native.encode(rows.metric_series_rows(
        [Family("m", "gauge", "", "", [Sample(labels(a="x", b="y"), 1.0), Sample((), math.nan)])], NOW))


def test_rows_of_another_width_are_refused(backend):
    with pytest.raises(BackendError):
        backend.insert("metric_samples", rows.METRIC_SERIES_COLUMNS, [(("t", "n", "g", ""), (), 1.0)])


def test_a_replayed_batch_is_stored_once(backend):
    _clear(backend)
    series = rows.metric_series_rows([Family("m_total", "counter", "", "", [Sample(labels(a=str(i)), i)
                                                                            for i in range(50)])], NOW)
    for _ in range(3):
        backend.insert("metric_samples", rows.METRIC_SERIES_COLUMNS, series)
    assert backend.query("SELECT count() FROM spanlet.metric_samples") == [(50,)]


@pytest.mark.parametrize("repeat", range(3))
@settings(max_examples=40, deadline=None)
@given(fams=st.lists(family(any_labels), max_size=6))
def test_other_backends_get_the_python_rows_of_the_series(repeat, fams):
    """What the server backend sends for series rows (rows_from_metric_series) is metric_rows' rows."""
    assert repr(rows.rows_from_metric_series(rows.metric_series_rows(fams, NOW))) == repr(rows.metric_rows(fams, NOW))
