"""Megatron .bin/.idx: round trips, interop with megatron-core both ways, crash safety, clear errors."""

import os
import pickle
import struct
import time

import numpy as np
import pytest

from megajax.data.indexed import (DTYPE_CODES, HEADER_BYTES, IndexedDataset, IndexedDatasetWriter,
                                  merge, optimal_dtype)
from megajax.errors import DataError


def _docs(dtype, n=40, seed=0):
    """n documents of 0..30 tokens (some empty), valid values for `dtype`."""
    rng = np.random.default_rng(seed)
    hi = 120 if np.dtype(dtype).itemsize == 1 else 30000
    out = [rng.integers(0, hi, int(rng.integers(0, 30))).astype(dtype) for _ in range(n)]
    out[3] = out[3][:0]
    return out


def _write(prefix, dtype, docs):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(prefix)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_CODES[code]
    docs = _docs(dtype)
    prefix = tmp_path / "ds"
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
        w.add_item(docs[0][:5])            # a document of two sequences
        w.add_item(docs[1])
        w.end_document()
    assert (tmp_path / "ds.idx").read_bytes()[HEADER_BYTES - 17] == code
    ds = IndexedDataset(prefix).verify()
    nonempty = [d for d in docs if len(d)]
    assert ds.dtype == dtype and ds.num_documents == len(docs) + 1
    assert ds.num_sequences == len(nonempty) + 2
    assert ds.document_indices[-2] == len(nonempty) and list(ds.document_sequences(len(docs))) == [
        len(nonempty), len(nonempty) + 1]
    for i, d in enumerate(nonempty):
        np.testing.assert_array_equal(ds[i], d)
        assert ds[i].dtype == dtype
    np.testing.assert_array_equal(ds.get(len(nonempty)), docs[0][:5])
    d = nonempty[2]
    np.testing.assert_array_equal(ds.get(2, offset=1, length=len(d) - 2), d[1:-1])
    assert ds.num_tokens == sum(map(len, nonempty)) + 5 + len(docs[1])


def test_add_documents_matches_add_document(tmp_path):
    docs = _docs(np.uint16)
    _write(tmp_path / "a", np.uint16, docs)
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as w:
        w.add_documents(np.concatenate(docs[:10]), [len(d) for d in docs[:10]])
        w.add_documents(np.concatenate(docs[10:]), [len(d) for d in docs[10:]])
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a.{ext}").read_bytes() == (tmp_path / f"b.{ext}").read_bytes()


def test_optimal_dtype():
    assert optimal_dtype(50257) == np.uint16 and optimal_dtype(128256) == np.int32


def test_open_is_lazy_and_get_is_a_view(tmp_path):
    """A 2 GiB (sparse) data file opens instantly; reads are views of the mapping, not copies."""
    n = 2**30
    prefix = tmp_path / "big"
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 1, 2))
        f.write(struct.pack("<i", n) + struct.pack("<q", 0) + struct.pack("<qq", 0, 1))
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * n)
    start = time.perf_counter()
    ds = IndexedDataset(prefix)
    tail = ds.get(0, offset=n - 3)
    assert time.perf_counter() - start < 0.5
    assert tail.tolist() == [0, 0, 0] and not tail.flags.owndata and not tail.flags.writeable


def test_pickles_by_prefix(tmp_path):
    ds = _write(tmp_path / "p", np.int32, _docs(np.int32))
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again[5], ds[5])


def test_writer_never_leaves_partial_files(tmp_path):
    good = _docs(np.uint16)
    _write(tmp_path / "ds", np.uint16, good)
    before = {p: (tmp_path / p).read_bytes() for p in ("ds.bin", "ds.idx")}
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
            w.add_document(np.arange(1000))
            assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" not in p.name) == ["ds.bin", "ds.idx"]
            raise RuntimeError("crash mid-write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]
    assert {p: (tmp_path / p).read_bytes() for p in before} == before
    _write(tmp_path / "ds", np.uint16, good[:5])        # a finished write replaces it
    assert IndexedDataset(tmp_path / "ds").num_documents == 5


def test_token_that_does_not_fit_is_an_error(tmp_path):
    with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        with pytest.raises(DataError, match="70000 does not fit .*uint16"):
            w.add_document(np.array([1, 70000]))


def test_merge(tmp_path):
    a = _write(tmp_path / "a", np.uint16, _docs(np.uint16, seed=1))
    b = _write(tmp_path / "b", np.uint16, _docs(np.uint16, seed=2))
    m = merge([a.prefix, b.prefix], tmp_path / "m").verify()
    assert m.num_documents == a.num_documents + b.num_documents
    for i in range(len(b)):
        np.testing.assert_array_equal(m[len(a) + i], b[i])
    _write(tmp_path / "c", np.int32, _docs(np.int32))
    with pytest.raises(DataError, match="share one dtype"):
        merge([a.prefix, tmp_path / "c"], tmp_path / "m2")


# --- corrupt input: one clear DataError naming the file -------------------------------------

def _corrupt(prefix, what):
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    raw = bytearray(open(idx, "rb").read())
    if what == "missing idx":
        os.remove(idx)
    elif what == "missing bin":
        os.remove(bin_)
    elif what == "short header":
        open(idx, "wb").write(raw[:20])
    elif what == "truncated index":
        open(idx, "wb").write(raw[:-9])
    elif what == "bad magic":
        open(idx, "wb").write(b"TNTIDX\x00\x00\x00" + raw[9:])
    elif what == "bad version":
        open(idx, "wb").write(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    elif what == "bad dtype code":
        raw[17] = 9
        open(idx, "wb").write(raw)
    elif what == "truncated bin":
        os.truncate(bin_, os.path.getsize(bin_) - 2)
    elif what == "bad boundaries":
        raw[-8:] = struct.pack("<q", 3)
        open(idx, "wb").write(raw)
    return idx, bin_


@pytest.mark.parametrize("what, file, pattern", [
    ("missing idx", "idx", "does not exist"), ("missing bin", "bin", "does not exist"),
    ("short header", "idx", "truncated index of 20 bytes"), ("truncated index", "idx", "truncated or corrupt"),
    ("bad magic", "idx", "not a Megatron indexed-dataset index"), ("bad version", "idx", "version 2"),
    ("bad dtype code", "idx", "unknown dtype code 9; accepted codes are 1 uint8"),
    ("truncated bin", "bin", "do not belong together or one of them is truncated"),
    ("bad boundaries", "idx", "document boundaries run from 0 to 3"),
])
def test_corrupt_files_give_a_clear_error(tmp_path, what, file, pattern):
    _write(tmp_path / "ds", np.uint16, _docs(np.uint16))
    paths = dict(zip(("idx", "bin"), _corrupt(tmp_path / "ds", what)))
    with pytest.raises(DataError, match=pattern) as info:
        IndexedDataset(tmp_path / "ds")
    assert paths[file] in str(info.value)


# --- interop with megatron-core ---------------------------------------------------------------

@pytest.fixture(scope="module")
def mcore():
    pytest.importorskip("torch")
    return pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.float32])
def test_megatron_reads_ours(tmp_path, mcore, dtype):
    docs = _docs(dtype)
    ours = _write(tmp_path / "ds", dtype, docs)
    theirs = mcore.IndexedDataset(str(tmp_path / "ds"))
    assert len(theirs) == len(ours)
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    np.testing.assert_array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    for i in range(len(ours)):
        np.testing.assert_array_equal(theirs[i], ours[i])
    assert theirs.get(4, offset=1, length=2).tolist() == ours.get(4, offset=1, length=2).tolist()


@pytest.mark.parametrize("dtype", [np.uint16, np.int64])
def test_we_read_megatron_and_write_the_same_bytes(tmp_path, mcore, dtype):
    docs = _docs(dtype)
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for d in docs:
        builder.add_document(d, [len(d)] if len(d) else [])
    builder.finalize(str(tmp_path / "m.idx"))
    theirs = IndexedDataset(tmp_path / "m").verify()
    for i, d in enumerate(d for d in docs if len(d)):
        np.testing.assert_array_equal(theirs[i], d)
    _write(tmp_path / "o", dtype, docs)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"o.{ext}").read_bytes() == (tmp_path / f"m.{ext}").read_bytes()
    # merge agrees with megatron's add_index
    merge([tmp_path / "m", tmp_path / "o"], tmp_path / "merged")
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=dtype)
    builder.add_index(str(tmp_path / "m"))
    builder.add_index(str(tmp_path / "o"))
    builder.finalize(str(tmp_path / "mm.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"mm.{ext}").read_bytes()
