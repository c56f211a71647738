"""Blends: data.path parsing, Megatron's greedy weighting, sizes, caching, megatron-core parity."""

import numpy as np
import pytest

from megajax.data.blend import (BlendedDataset, blend_sizes, blending_indices, build_datasets,
                                parse_data_path)
from megajax.data.indexed import IndexedDatasetWriter
from megajax.errors import ConfigError, DataError


def test_parse_data_path():
    assert parse_data_path("data/a_text_document") == (["data/a_text_document"], [1.0])
    assert parse_data_path(["d/a"]) == (["d/a"], [1.0])
    assert parse_data_path([30, "d/a", 70, "d/b"]) == (["d/a", "d/b"], [0.3, 0.7])
    assert parse_data_path("1 d/a 3 d/b") == (["d/a", "d/b"], [0.25, 0.75])
    for bad, why in [([], "expected a dataset prefix"), ([0.3, "d/a", 0.7], "3 entries"),
                     (["x", "d/a"], "'x' is not a positive number"), ([0, "d/a"], "not a positive"),
                     ([1, "d/a", -2, "d/b"], "not a positive"), ([1, 2], "2 is not a dataset prefix"),
                     (5, "expected a dataset prefix")]:
        with pytest.raises(ConfigError, match=why):
            parse_data_path(bad)


class _Fake:
    def __init__(self, n, tag):
        self.n, self.tag = n, tag

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (self.tag, i)


def test_counts_follow_weights():
    weights, size = [0.5, 0.3, 0.2], 100_000
    target, build = blend_sizes(weights, size)
    assert target == [50_000, 30_000, 20_000] and build == [50_250, 30_150, 20_100]
    blend = BlendedDataset([_Fake(n, j) for j, n in enumerate(build)], weights, sum(target))
    assert np.abs(blend.counts - np.array(weights) * blend.size).max() <= 1
    # every prefix of the blend is within one sample of the weights
    idx = np.asarray(blend.dataset_index[:5000])
    for j, w in enumerate(weights):
        running = np.cumsum(idx == j)
        assert np.abs(running - w * np.arange(1, 5001)).max() <= 1.5
    # each dataset's samples are taken in order 0, 1, 2, ...
    assert [blend[i] for i in range(4)] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert "weight 0.5000" in blend.report()


def test_overdrawn_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="asked for 50 samples but holds 10"):
        BlendedDataset([_Fake(10, 0), _Fake(100, 1)], [1, 1], 100, names=["small", "big"])


def test_build_datasets_blend_and_cache(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        with IndexedDatasetWriter(tmp_path / name, np.uint16) as w:
            for _ in range(300):
                w.add_document(np.append(rng.integers(0, 99, int(rng.integers(1, 40))), 99))
    path = [2, str(tmp_path / "a"), 1, str(tmp_path / "b")]
    train, valid, test = build_datasets(path, split="90,10,0", num_samples=[600, 60, 0], seq_len=16, seed=1,
                                        cache_dir=tmp_path / "cache", document_aware=True, eod_id=99)
    assert test is None and len(train) >= 600 and len(valid) >= 60
    assert train.counts.tolist() == [400, 200]
    assert train[0]["tokens"].shape == (17,) and "loss_mask" in train[0]
    again = build_datasets(path, split="90,10,0", num_samples=[600, 60, 0], seq_len=16, seed=1,
                           cache_dir=tmp_path / "cache", document_aware=True, eod_id=99)[0]
    assert again.from_cache and all(d.from_cache for d in again.datasets)
    np.testing.assert_array_equal(again[7]["tokens"], train[7]["tokens"])
    with pytest.raises(ConfigError, match="sample count for every split"):
        build_datasets(path, split="90,10,0", num_samples=[600, None, 0], seq_len=16, seed=1)


def test_same_blend_as_megatron_core():
    pytest.importorskip("torch")
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    for weights in ([0.5, 0.5], [0.3, 0.7], [1 / 3] * 3, [0.1, 0.2, 0.3, 0.4], [0.999, 0.001]):
        size = 20_000
        dataset_index, sample_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(dataset_index, sample_index, weights, len(weights), size, False)
        ours = blending_indices(weights, size)
        np.testing.assert_array_equal(ours[0], dataset_index)
        np.testing.assert_array_equal(ours[1], sample_index)
