"""Blends and loaders over token folders: O(1) mixture, seek, dp slices, workers, epochs, continue_from, memory."""

import logging
import math
import threading

import numpy as np
import pytest
import torch
from data_helpers import BYTES, documents, load, stage, write_folder
from hypothesis import given, settings
from hypothesis import strategies as st
from log_helpers import logged

from nanoflow.data import open_stage, sample_order
from nanoflow.data.blend import Blend
from nanoflow.schedule import Schedule

# ---------------------------------------------------------------------------------------------
# The blend itself

weights_strategy = st.lists(st.floats(0.001, 1000, allow_nan=False), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(weights=weights_strategy, start=st.integers(0, 10**15))
def test_each_source_reads_its_samples_in_order_without_gaps(weights, start):
    blend = Blend(weights)
    n = 3000
    sources, local = blend.assign(np.arange(start, start + n))
    before = blend.counts(start)
    after = blend.counts(start + n)
    for k in range(len(weights)):
        mine = local[sources == k]
        assert mine.tolist() == list(range(before[k], after[k]))   # consecutive, continuing from earlier samples


@settings(max_examples=40, deadline=None)
@given(weights=weights_strategy, seed=st.integers(0, 2**32 - 1))
def test_any_window_of_10000_samples_is_within_2_percent_of_the_weights(weights, seed):
    blend = Blend(weights)
    target = np.array(weights) / sum(weights)
    rng = np.random.default_rng(seed)
    starts = np.concatenate([rng.integers(0, 10**6, 20), rng.integers(0, 10**15, 20), [0]])
    for start in starts:
        sources, _ = blend.assign(np.arange(start, start + 10_000))
        realised = np.bincount(sources, minlength=len(weights))
        # The proven bound: within depth = ceil(log2 k) samples (+ the weights' rounding to 2**-20) of the exact share.
        depth = math.ceil(math.log2(len(weights)))
        assert np.all(np.abs(realised - 10_000 * target) <= depth + 1), (start, realised, 10_000 * target)
        assert np.all(np.abs(realised / 10_000 - target) <= 0.02)


def test_counts_agree_with_assign_and_with_the_largest_deficit_order():
    blend = Blend([0.5, 0.3, 0.2])
    sources, _ = blend.assign(np.arange(1000))
    for n in (0, 1, 7, 999, 1000):
        assert blend.counts(n) == np.bincount(sources[:n], minlength=3).tolist()
    assert sources[:10].tolist() == [0, 1, 0, 2, 0, 1, 0, 2, 0, 1] or len(set(sources[:10].tolist())) == 3
    with pytest.raises(ValueError, match="not all zero"):
        Blend([0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        Blend([1, -1])
    with pytest.raises(IndexError):
        blend.assign([-1])


def test_assign_costs_the_same_at_any_offset():
    blend = Blend([0.7, 0.2, 0.1])
    far = blend.assign(np.arange(10**17, 10**17 + 64))
    assert np.bincount(far[0], minlength=3).tolist() in ([45, 13, 6], [44, 13, 7], [45, 12, 7], [44, 14, 6],
                                                         [45, 13, 6])
    assert far[1].max() < 10**17


# ---------------------------------------------------------------------------------------------
# Loaders over blended token folders. Folder "a" holds token ids 0..99, "b" 100..199, "c" 200..255, so the
# first token of a window says which folder it came from (end-of-text, 256, is shared: skipped).

def folder_of(window: torch.Tensor) -> int:
    first = int(next(t for t in window.tolist() if t != 256))
    return first // 100


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    rng = np.random.default_rng(7)
    streams = {}
    for name, (low, high, count) in {"a": (0, 100, 300), "b": (100, 200, 200), "c": (200, 256, 60)}.items():
        streams[name] = write_folder(root / name, documents(rng, count, low, high, length=(40, 120)), files=3)
    return root, streams


def stage_of(config):
    """The loader of the config's first stage."""
    return open_stage(config, 0, BYTES, Schedule.from_config(config))


def blend_config(tmp_path, folders, weights=(0.6, 0.3, 0.1), workers=0, **kwargs):
    root, _ = folders
    dataset = {"dataset_folder": [str(root / n) for n in "abc"], "dataset_weights": list(weights)}
    return load(tmp_path, [stage("pretrain", 1, dataset, data={"num_loading_workers": workers, "seed": 3}),
                           stage("anneal", 40, {"dataset_folder": str(root / "b")})], train_steps=60,
                micro_batch_size=4, accumulation=5, **kwargs)     # global batch 20


def test_blended_batches_follow_the_weights_and_come_from_the_folders(tmp_path, folders):
    config = blend_config(tmp_path, folders)
    _, streams = folders
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as loader:
        assert [len(p.source) for p in loader.parts] == [(len(streams[n]) - 1) // 16 for n in "abc"]
        seen = np.zeros(3, int)
        for step in loader.steps:
            batch = loader.batch_at(step)
            origin = [folder_of(row) for row in batch["input_ids"]]
            seen += np.bincount(origin, minlength=3)
            counts = np.bincount(origin, minlength=3)
            assert np.all(np.abs(counts - 20 * np.array([0.6, 0.3, 0.1])) <= 2)   # every batch, not just on average
            for row, labels in zip(batch["input_ids"], batch["labels"], strict=True):
                assert torch.equal(row[1:], labels[:-1])
        assert seen.tolist() == Blend([0.6, 0.3, 0.1]).counts(39 * 20)


def test_folders_without_weights_blend_in_proportion_to_their_size(tmp_path, folders):
    root, streams = folders
    config = load(tmp_path, [stage("pretrain", 1, {"dataset_folder": [str(root / "a"), str(root / "c")]})])
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as loader:
        sizes = [len(p.source) for p in loader.parts]
        assert np.allclose(loader.blend.weights, np.array(sizes) / sum(sizes), atol=1e-5)


@pytest.mark.parametrize("k", [1, 5, 17])
def test_a_fresh_blended_loader_seeks_to_any_step_and_sample(tmp_path, folders, k):
    config = blend_config(tmp_path, folders)
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as walker, open_stage(config, 0, BYTES, Schedule.from_config(config)) as fresh:
        walked = [walker.batch_at(step) for step in range(1, k + 3)]
        for step in range(k, k + 3):
            assert torch.equal(fresh.batch_at(step)["input_ids"], walked[step - 1]["input_ids"])
        rows = torch.cat([b["input_ids"] for b in walked])
        skip = 20 * k - 7                                   # not a step boundary
        assert torch.equal(fresh.samples(skip, len(rows) - skip)["input_ids"], rows[skip:])


@pytest.mark.parametrize("world", [2, 4])
def test_dp_slices_of_a_blended_batch_concatenate_to_the_global_batch(tmp_path, folders, world):
    config = blend_config(tmp_path, folders)
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as loader:
        for step in (1, 2, 33):
            whole = loader.batch_at(step)
            parts = [loader.batch_at(step, rank, world) for rank in range(world)]
            for key in ("input_ids", "labels"):
                assert torch.equal(torch.cat([p[key] for p in parts]), whole[key])


def test_background_workers_change_nothing_but_when_and_are_joined_at_close(tmp_path, folders):
    plain = stage_of(blend_config(tmp_path, folders))
    loader = stage_of(blend_config(tmp_path, folders, workers=3))
    order = [1, 2, 3, 10, 11, 4, 39, 5, 5, 6]           # in order, jumps forward and back, a repeat
    for step in order:
        for rank, world in ((0, 1), (1, 2)):
            a, b = plain.batch_at(step, rank, world), loader.batch_at(step, rank, world)
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert any(t.name.startswith("nanoflow-data-pretrain") for t in threading.enumerate())
    loader.close()
    plain.close()
    assert not any(t.name.startswith("nanoflow-data-pretrain") for t in threading.enumerate())
    with pytest.raises(RuntimeError, match='the loader of stage "pretrain" is closed'):
        loader.batch_at(7)


def test_a_worker_error_reaches_the_caller_with_the_file_and_sample(tmp_path, folders):
    loader = stage_of(blend_config(tmp_path, folders, workers=2))
    part = loader.parts[1]
    bad = int(part.order.take([5])[0])
    one, many = part.source.sample, part.source.samples

    def sample(i):                       # as if the disk failed under one window of folder b
        if i == bad:
            raise OSError("disk read failed")
        return one(i)

    def samples(indices):
        if bad in indices:
            raise OSError("disk read failed")
        return many(indices)

    part.source.sample, part.source.samples = sample, samples
    with pytest.raises(Exception, match=r'stage "pretrain": sample \d+ \(dataset_folder .*/b, window \d+: '
                                        r'.*/b/0000\d_unshuffled\.ds at token \d+\): OSError: disk read failed'):
        for step in loader.steps:
            loader.batch_at(step)
    loader.close()


def test_epochs_wrap_in_a_fresh_deterministic_order_and_say_so_once(tmp_path, folders):
    root, _ = folders
    config = load(tmp_path, [stage("pretrain", 1, {"dataset_folder": [str(root / "a"), str(root / "c")],
                                                   "dataset_weights": [0.5, 0.5]})], train_steps=700)
    with open_stage(config, 0, BYTES, Schedule.from_config(config)) as loader, open_stage(config, 0, BYTES, Schedule.from_config(config)) as again:
        c = loader.parts[1]
        n = len(c.source)
        with logged(logging.INFO) as logs:
            reads = [loader.batch_at(step)["input_ids"] for step in loader.steps[:3 * n // 2 + 2]]   # c: 2 a step
        rows = torch.cat(reads)
        from_c = [row for row in rows if folder_of(row) == 2]
        epochs = [from_c[e * n:(e + 1) * n] for e in range(3)]
        windows = {tuple(c.source.sample(i)[0].tolist()) for i in range(n)}
        for epoch in epochs:
            assert {tuple(r.tolist()) for r in epoch} == windows            # each epoch: every window once
        assert [tuple(r.tolist()) for r in epochs[0]] != [tuple(r.tolist()) for r in epochs[1]]
        assert torch.equal(again.samples(0, len(rows))["input_ids"], rows)  # deterministic
    wraps = [line for line in logs if "wrapped around" in line]
    assert len(wraps) == 1 and "dataset_folder" in wraps[0] and "/c" in wraps[0] and f"{n:,} samples an epoch" in wraps[0]


# ---------------------------------------------------------------------------------------------
# continue_from

def test_continue_from_reads_on_where_the_earlier_stage_stopped(tmp_path, folders):
    root, _ = folders
    a, b = str(root / "a"), str(root / "b")
    stages = [
        stage("pretrain", 1, {"dataset_folder": [a, b], "dataset_weights": [0.75, 0.25]}, data={"seed": 9}),
        stage("anneal", 8, {"dataset_folder": b}, data={"continue_from": "pretrain", "seed": 123}),
        stage("cooldown", 12, {"dataset_folder": [b, a], "dataset_weights": [1, 1]},
              data={"continue_from": "anneal"}),
        stage("fresh", 15, {"dataset_folder": b}),
    ]
    config = load(tmp_path, stages, train_steps=18)            # global batch 4
    schedule = Schedule.from_config(config)
    loaders = [open_stage(config, i, BYTES, schedule) for i in range(4)]
    pretrain, anneal, cooldown, fresh = loaders
    b_in_pretrain = Blend([0.75, 0.25]).counts(7 * 4)[1]        # 7 steps of 4 samples
    assert anneal.parts[0].offset == b_in_pretrain
    assert cooldown.parts[0].offset == b_in_pretrain + 4 * 4    # + anneal's 4 steps, all from b
    assert cooldown.parts[1].offset == Blend([0.75, 0.25]).counts(7 * 4)[0]   # a: pretrain's share (anneal read none)
    assert fresh.parts[0].offset == 0

    # The samples of b, in the order the stages read them, are one run of pretrain's permutation of b.
    read_b = []
    for loader in (pretrain, anneal, cooldown):
        for step in loader.steps:
            read_b += [tuple(r.tolist()) for r in loader.batch_at(step)["input_ids"] if folder_of(r) == 1]
    b_source = pretrain.parts[1].source
    expected = [tuple(b_source.sample(int(i))[0].tolist())
                for i in pretrain.parts[1].order.take(range(len(read_b)))]
    assert read_b == expected
    assert len(set(read_b)) == len(read_b)                      # nothing re-read (all within b's first epoch)
    assert anneal.parts[0].order.seed == 9                      # the continued source keeps pretrain's order
    first = tuple(fresh.batch_at(15)["input_ids"][0].tolist())
    assert first == tuple(b_source.sample(int(sample_order(5, "fresh", len(b_source))[0]))[0].tolist())
    for loader in loaders:
        loader.close()


