"""GPT sampling: windows over shuffled documents, splits, epochs, cache, document-aware masks, megatron-core parity."""

import numpy as np
import pytest

import megajax.data.gpt_dataset as gd
from megajax.data.gpt_dataset import (GPTDataset, build_gpt_datasets, document_masks, parse_split,
                                      split_ranges)
from megajax.data.indexed import IndexedDataset, IndexedDatasetWriter
from megajax.errors import ConfigError, DataError

EOD = 999


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """1,000 documents of 1..60 tokens, each ending in EOD, a few empty ones."""
    prefix = tmp_path_factory.mktemp("gpt") / "corpus"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(1000):
            n = int(rng.integers(0, 60))
            w.add_document(np.append(rng.integers(0, EOD, n), EOD) if i % 97 else [])
    return IndexedDataset(prefix)


def _stream(ds: GPTDataset) -> np.ndarray:
    """The split's token stream: its documents concatenated in document_index order."""
    return np.concatenate([ds.indexed.get(int(d)) for d in ds.document_index])


@pytest.mark.parametrize("num_samples", [None, 100, 3000])
def test_samples_are_windows_of_the_shuffled_stream(corpus, num_samples):
    seq = 16
    ds = GPTDataset(corpus, seq_len=seq, seed=3, num_samples=num_samples)
    stream = _stream(ds)
    assert len(ds) == (len(stream) - 1) // seq >= (num_samples or 0)
    assert sorted(np.asarray(ds.shuffle_index).tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        sample = ds[i]["tokens"]
        assert sample.dtype == np.int32 and sample.shape == (seq + 1,)
        np.testing.assert_array_equal(sample, stream[k * seq:k * seq + seq + 1])


def test_epochs_cover_the_request_and_last_short_epoch_is_shuffled_alone(corpus):
    tokens = corpus.num_tokens
    per_epoch = (tokens - 1) // 16
    D = corpus.num_sequences
    # 2.1 epochs: the third is short (10 % < 80 %), shuffled on its own
    ds = GPTDataset(corpus, seq_len=16, seed=1, num_samples=int(2.1 * per_epoch))
    doc = np.asarray(ds.document_index)
    assert len(doc) == 3 * D
    assert sorted(doc[2 * D:].tolist()) == list(range(D))
    assert sorted(doc[:2 * D].tolist()) == sorted(2 * list(range(D)))
    head = ((2 * tokens - 1) // 16)
    shuffle = np.asarray(ds.shuffle_index)
    assert shuffle[:head].max() < head and shuffle[head:].min() >= head   # samples of the short epoch come last
    # 2.9 epochs: all three shuffled together
    ds = GPTDataset(corpus, seq_len=16, seed=1, num_samples=int(2.9 * per_epoch))
    doc = np.asarray(ds.document_index)
    assert len(doc) == 3 * D and sorted(doc[2 * D:].tolist()) != list(range(D))


def test_splits_are_disjoint_and_megatron_rounded(corpus):
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert split_ranges("98,2", 1000) == [(0, 980), (980, 1000), None]
    train, valid, test = build_gpt_datasets(corpus, split="90,8,2", num_samples=[50, 20, 5], seq_len=8, seed=0)
    ranges = [d.documents for d in (train, valid, test)]
    S = corpus.num_sequences
    assert ranges == split_ranges("90,8,2", S) == [(0, round(.9 * S)), (round(.9 * S), round(.98 * S)),
                                                    (round(.98 * S), S)]
    for d, (lo, hi) in zip((train, valid, test), ranges):
        ids = np.asarray(d.document_index)
        assert ids.min() >= lo and ids.max() < hi
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0"):
        with pytest.raises(ConfigError, match="data split"):
            parse_split(bad)


def test_deterministic_for_a_seed(corpus):
    a, b, c = (GPTDataset(corpus, seq_len=32, seed=s, num_samples=200) for s in (7, 7, 8))
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    np.testing.assert_array_equal(a[5]["tokens"], b[5]["tokens"])
    assert not np.array_equal(a.document_index, c.document_index)


def test_cache_is_reused(corpus, tmp_path, monkeypatch):
    first = GPTDataset(corpus, seq_len=16, seed=2, num_samples=500, cache_dir=tmp_path)
    assert not first.from_cache and len(list(tmp_path.glob("*.npy"))) == 3
    assert len(list(tmp_path.glob(f"{first.description_hash}-GPTDataset-train-*"))) == 4

    def fail(*args, **kwargs):
        raise AssertionError("indices recomputed despite a cache hit")
    monkeypatch.setattr(gd, "build_indices", fail)
    second = GPTDataset(corpus, seq_len=16, seed=2, num_samples=500, cache_dir=tmp_path)
    assert second.from_cache
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    np.testing.assert_array_equal(first[3]["tokens"], second[3]["tokens"])
    with pytest.raises(AssertionError, match="recomputed"):   # another seed is another cache entry
        GPTDataset(corpus, seq_len=16, seed=3, num_samples=500, cache_dir=tmp_path)


def test_document_aware_masks(corpus):
    tokens = np.array([5, 6, EOD, 7, EOD, EOD, 8, 9])
    m = document_masks(tokens, EOD)
    assert m["segment_ids"].tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    assert m["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    assert m["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 1, 1]
    ds = GPTDataset(corpus, seq_len=64, seed=0, document_aware=True, eod_id=EOD)
    sample = ds[0]
    assert set(sample) == {"tokens", "segment_ids", "positions", "loss_mask"}
    assert all(v.shape == (65,) for v in sample.values())
    assert sample["segment_ids"][-1] == np.sum(sample["tokens"][:-1] == EOD)
    with pytest.raises(ConfigError, match="eod_id"):
        GPTDataset(corpus, seq_len=64, seed=0, document_aware=True)


def test_too_small_split_is_a_clear_error(corpus):
    with pytest.raises(DataError, match="fewer than one sample"):
        GPTDataset(corpus, seq_len=10**6, seed=0)


def test_index_build_is_vectorised():
    """Index arrays for ~1e7 tokens in 2e5 documents build in well under a second."""
    lengths = np.random.default_rng(0).integers(1, 100, 200_000).astype(np.int32)
    import time
    start = time.perf_counter()
    doc, sample, shuffle = gd.build_indices(lengths, np.arange(len(lengths), dtype=np.int32), 128, 150_000, 0)
    assert time.perf_counter() - start < 2.0
    assert len(sample) - 1 == len(shuffle) >= 150_000


# --- parity with megatron-core ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mcore():
    pytest.importorskip("torch")
    return pytest.importorskip("megatron.core.datasets.gpt_dataset")


class _Tokenizer:
    vocab_size, eod, unique_identifiers = 1000, EOD, {"class": "test tokenizer"}


@pytest.mark.parametrize("seq, sizes, split", [
    (16, [5000, 500, 100], "969,30,1"),    # multi-epoch valid/test, separate and joint last epochs
    (32, [5, 5, 5], "80,15,5"),
    (7, [3000, 100, 1], "98,2"),
])
def test_same_samples_as_megatron_core(corpus, mcore, tmp_path, seq, sizes, split):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    config = mcore.GPTDatasetConfig(
        random_seed=1234, sequence_length=seq, blend=([corpus.prefix], None), split=split,
        tokenizer=_Tokenizer(), reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
        path_to_cache=str(tmp_path))
    theirs = BlendedMegatronDatasetBuilder(mcore.GPTDataset, sizes, lambda: True, config).build()
    ours = build_gpt_datasets(corpus, split=split, num_samples=sizes, seq_len=seq, seed=1234,
                              document_aware=True, eod_id=EOD)
    for t, o in zip(theirs, ours):
        assert (t is None) == (o is None)
        if t is None:
            continue
        for name in ("document_index", "sample_index", "shuffle_index"):
            a, b = getattr(t, name), getattr(o, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert len(t) == len(o)
        for i in range(0, len(o), max(1, len(o) // 50)):
            ts, os_ = t[i], o[i]
            np.testing.assert_array_equal(ts["tokens"].numpy(), os_["tokens"][:-1])
            np.testing.assert_array_equal(ts["labels"].numpy(), os_["tokens"][1:])
            np.testing.assert_array_equal(ts["position_ids"].numpy(), os_["positions"][:-1])
            np.testing.assert_array_equal(ts["loss_mask"].numpy(), os_["loss_mask"][:-1])
            seg = os_["segment_ids"][:-1]
            causal = np.tril(np.ones((seq, seq), bool))
            allowed = causal & (seg[:, None] == seg[None, :])
            np.testing.assert_array_equal(~ts["attention_mask"].numpy()[0], allowed)
