"""metric_samples rows from the series as the metric engine holds them: the
embedded store's insert of rows.METRIC_SERIES_COLUMNS.

The rows are laid out column by column as one block of ClickHouse's Native
format, which the engine reads as its own columns in one INSERT ... SELECT
of plain columns (a function there that works on each row's labels cost
the engine more than the Python it saves). Python's part is a few passes
over whole columns in C, little per row: the family's time, name, type and
unit once per family (its rows are a run of one LowCardinality index);
label names as LowCardinality indexes, label values as one text of
length-prefixed strings (for ASCII); numbers packed a column at a time;
histograms' bounds and bucket counts as the offsets and values of arrays.

The stored values are those of rows.metric_rows, exactly (the tests
compare both ways on random series). A batch whose values a Native column
cannot take as they are, or whose labels metric_rows would store otherwise
than given (names out of order or twice: it sorts the pairs into a dict;
values that are not str: it stores their str()), raises `Unsuitable`: the
caller stores that batch through the Python rows instead. The metric
engine's labels (spanlet.metrics.labels) are sorted pairs of str.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from itertools import accumulate, chain, groupby, islice, repeat
from operator import is_not, itemgetter, lt

from spanlet.exporters.clickhouse import BackendError, schema
from spanlet.exporters.clickhouse.rows import METRIC_COLUMNS, METRIC_SERIES_COLUMNS
from spanlet.exporters.otlp.common import varint

_LITTLE = sys.byteorder == "little"
_ONE_BYTE = [bytes([i]) for i in range(128)]
_ONE_CHAR = [chr(i) for i in range(128)]
# LowCardinality's serialization (SerializationLowCardinality): the keys'
# version, then per block the index type and its flags (the block carries
# its own keys, to be added to the column's dictionary), keys and indexes.
_LC_VERSION = (1).to_bytes(8, "little")
_LC_FLAGS = 0x200 | 0x400          # HasAdditionalKeysBit | NeedUpdateDictionary
_LC_INDEX = ((0xFF + 1, "B", 0), (0xFFFF + 1, "H", 1), (0xFFFFFFFF + 1, "I", 2))


class Unsuitable(Exception):
    """The batch holds a value Native cannot take as given: store its rows the Python way."""


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _packed(code: str, values: Sequence) -> bytes:
    """The values as one little-endian array; Unsuitable for any that is not of the type as given."""
    try:
        if code == "d":
            return struct.pack(f"<{len(values)}d", *values)
        data = array(code, values)
    except (struct.error, TypeError, OverflowError) as e:
        raise Unsuitable(str(e)) from e
    if not _LITTLE:
        data.byteswap()
    return data.tobytes()


def _strings(values: Sequence[str]) -> bytes:
    """A String column: each value's UTF-8 length as a varint, then its bytes
    (ASCII texts shorter than 128, the common case, laid out as one text)."""
    try:
        try:
            return "".join(chain.from_iterable(zip(map(_ONE_CHAR.__getitem__, map(len, values)), values))
                           ).encode("ascii")
        except (IndexError, UnicodeEncodeError):      # a text of 128 or more, or not ASCII
            data = list(map(str.encode, values))
    except (TypeError, UnicodeEncodeError) as e:      # not a str, or not encodable
        raise Unsuitable(str(e)) from e
    sizes = list(map(len, data))
    heads = map(_ONE_BYTE.__getitem__, sizes) if max(sizes) < 128 else map(varint, sizes)
    return b"".join(chain.from_iterable(zip(heads, data)))


def _dictionary(values: Sequence[str]) -> tuple[dict[str, int], str, bytes]:
    """The distinct values of a LowCardinality(String) column (the default,
    '', first, as the engine writes them): {value: index}, the indexes'
    array type and the column's keys, as serialized."""
    keys = dict.fromkeys(("",))
    try:
        keys.update(dict.fromkeys(values))
    except TypeError as e:         # unhashable
        raise Unsuitable(str(e)) from e
    for limit, code, kind in _LC_INDEX:
        if len(keys) <= limit:
            break
    head = b"".join((_u64(_LC_FLAGS | kind), _u64(len(keys)), _strings(list(keys))))
    return dict(zip(keys, range(len(keys)))), code, head


def _column(name: str, ctype: str, data: bytes) -> bytes:
    return b"".join((varint(len(name)), name.encode(), varint(len(ctype)), ctype.encode(), data))


def _lc_runs(values: Sequence[str], counts: Sequence[int]) -> bytes:
    """A LowCardinality(String) column of counts[i] rows of values[i], for each i."""
    index, code, head = _dictionary(values)
    return b"".join((_LC_VERSION, head, _u64(sum(counts)),
                     *[_packed(code, (index[v],)) * n for v, n in zip(values, counts)]))


# A byte per label of a row: 1 where the next label is in the same row.
_SAME_ROW = [b"\x01" * (n - 1) + b"\x00" if n else b"" for n in range(65)]


def _labels(labels: Sequence[Sequence[Sequence[str]]]) -> bytes:
    """A Map(LowCardinality(String), String) column of the rows' (name, value) pairs, which
    must be as rows.metric_rows stores them: names in order, each once (the
    metric engine's labels are); Unsuitable otherwise."""
    try:
        if set(map(len, chain.from_iterable(labels))) - {2}:
            raise Unsuitable("a label that is not a (name, value) pair")
        items = list(chain.from_iterable(chain.from_iterable(labels)))
        names = items[0::2]
        ascending = bytes(map(lt, names, islice(names, 1, None)))
    except TypeError as e:            # labels that are not pairs, a name that is not a str
        raise Unsuitable(str(e)) from e
    per_row = list(map(len, labels))
    try:
        same_row = b"".join(map(_SAME_ROW.__getitem__, per_row))[:-1]
    except IndexError:
        same_row = b"".join(b"\x01" * (n - 1) + b"\x00" if n else b"" for n in per_row)[:-1]
    # each name less than the next one of its row (the bytes are 0 or 1: no carries)
    need = int.from_bytes(same_row, "little")
    if need & int.from_bytes(ascending, "little") != need:
        raise Unsuitable("labels out of order or a name twice")
    index, code, head = _dictionary(names)
    return b"".join((_LC_VERSION, _packed("Q", list(accumulate(per_row))),
                     head + _u64(len(names)) + _packed(code, list(map(index.__getitem__, names))) if names else b"",
                     _strings(items[1::2])))


_ITEMS = [itemgetter(i) for i in range(4)]


def _columns(rows: Sequence[Sequence]) -> list[list]:
    """The first four columns of the rows (one pass a column: zip(*rows) makes an iterator a row)."""
    return [list(map(item, rows)) for item in _ITEMS]


def _histograms(hist: Sequence) -> tuple[bytes, bytes, bytes, bytes]:
    """Count, Sum, Bounds and BucketCounts of the rows (None for a series that is not a histogram)."""
    counts, sums, bounds_at, bounds, buckets_at, buckets = [], [], [], [], [], []
    n_bounds = n_buckets = at = 0
    for is_hist, g in groupby(map(is_not, hist, repeat(None))):
        n = len(list(g))
        if not is_hist:
            counts.append(bytes(8 * n))
            sums.append(bytes(8 * n))          # 0.0
            bounds_at.append(_packed("Q", (n_bounds,)) * n)
            buckets_at.append(_packed("Q", (n_buckets,)) * n)
        else:
            c, s, b, bc = _columns(hist[at:at + n])
            counts.append(_packed("Q", c))
            sums.append(_packed("d", s))
            bounds_at.append(_packed("Q", list(accumulate(map(len, b), initial=n_bounds))[1:]))
            buckets_at.append(_packed("Q", list(accumulate(map(len, bc), initial=n_buckets))[1:]))
            flat_b, flat_bc = list(chain.from_iterable(b)), list(chain.from_iterable(bc))
            bounds.append(_packed("d", flat_b))
            buckets.append(_packed("Q", flat_bc))
            n_bounds += len(flat_b)
            n_buckets += len(flat_bc)
        at += n
    return (b"".join(counts), b"".join(sums), b"".join(bounds_at) + b"".join(bounds),
            b"".join(buckets_at) + b"".join(buckets))


def encode(series_rows: Sequence[Sequence]) -> bytes:
    """rows.METRIC_SERIES_COLUMNS rows → one Native block (the input of insert_sql)."""
    width = len(METRIC_SERIES_COLUMNS)
    if set(map(len, series_rows)) != {width}:
        raise BackendError(f"a row without {width} values for {width} columns")
    family, labels, value, hist = _columns(series_rows)
    families, counts = zip(*[(f, len(list(g))) for f, g in groupby(family)])   # runs of one family's rows
    try:
        ts, name, mtype, unit = zip(*families)
    except (TypeError, ValueError) as e:
        raise Unsuitable(f"a family that is not (time, name, type, unit): {e}") from e
    try:
        count, total, bounds, buckets = _histograms(hist)
    except (TypeError, ValueError, IndexError) as e:     # not (count, sum, bounds, bucket counts) of sequences
        raise Unsuitable(f"a histogram that is not (count, sum, bounds, bucket counts): {e}") from e
    columns = [
        _column("ts", "DateTime64(9)", b"".join(_packed("q", (t,)) * n for t, n in zip(ts, counts))),
        _column("name", "LowCardinality(String)", _lc_runs(name, counts)),
        _column("type", "LowCardinality(String)", _lc_runs(mtype, counts)),
        _column("unit", "LowCardinality(String)", _lc_runs(unit, counts)),
        _column("labels", "Map(LowCardinality(String), String)", _labels(labels)),
        _column("value", "Float64", _packed("d", value)),
        _column("count", "UInt64", count),
        _column("sum", "Float64", total),
        _column("bounds", "Array(Float64)", bounds),
        _column("buckets", "Array(UInt64)", buckets),
    ]
    return b"".join((varint(len(columns)), varint(len(series_rows)), *columns))


_SELECT = {"Timestamp": "ts", "MetricName": "name", "MetricType": "type", "Unit": "unit", "Labels": "labels",
           "Value": "value", "Count": "count", "Sum": "sum", "Bounds": "bounds", "BucketCounts": "buckets"}


def insert_sql(database: str, table: str, path: str) -> str:
    """INSERT of the Native block in the file at `path` (written by encode)."""
    cols = ", ".join(schema.quote_identifier(c) for c in METRIC_COLUMNS)
    select = ", ".join(_SELECT[c] for c in METRIC_COLUMNS)
    return f"INSERT INTO {database}.{table} ({cols}) SELECT {select} FROM file({schema.quote_string(path)}, 'Native')"
