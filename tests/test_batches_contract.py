"""batches' contract beyond test_batches.py: best-fit decreasing's choice of bin, which batches
each DDP rank gets, how a batch is split or dropped for the ranks, max_batches and the default
window; pack_fill's epoch; shard_collator's refusals; the buffer pool's reuse and waits;
ThreadedBatches' read-ahead, its buffer sets, its copies' events, errors and shutdown. Cheap:
tiny shards, no pipeline."""

import threading
import time
import types

import numpy as np
import pytest
import torch
from conftest import wait_until

from eagle3lib import batches, shard_writer, shards, train_data

# ---- packing ---------------------------------------------------------------------------------


def ffd(lengths, replicas=1, rank=0, seed=0, epoch=0, **kwargs):
    sampler = batches.FirstFitDecreasingSampler(2048, lengths, replicas, rank, seed=seed, **kwargs)
    return [b.tolist() for b in sampler._generate_batches(epoch)]


def all_ranks(lengths, replicas):
    return [ffd(lengths, replicas, rank) for rank in range(replicas)]


# Catches: first fit (the oldest bin that holds it) instead of best fit; a bin's room left one
# too large after a sample (overfilled by one); ties broken by an unstable sort on long inputs.
def test_best_fit_decreasing_takes_the_fullest_bin_not_the_oldest_and_never_overfills():
    """7 opens bin 0 (room 3), both 4s go to bin 1 (room 2): the 2 fits both and takes bin 1,
    the fuller, not bin 0, the older. Two 5s fill a bin of 10: a 1 opens a new one. Forty
    costs 1, 2, 1, 2, ... into bins of 2: each 2 alone, the 1s in pairs, all in position order
    (a stable sort, however long the window)."""
    assert batches.best_fit_decreasing(np.array([7, 4, 4, 2]), 10) == [[0], [1, 2, 3]]
    assert batches.best_fit_decreasing(np.array([5, 5, 1]), 10) == [[0, 1], [2]]
    twos, ones = [[k] for k in range(1, 40, 2)], [[k, k + 2] for k in range(0, 40, 4)]
    assert batches.best_fit_decreasing(np.array([1, 2] * 20), 2) == twos + ones


# Catches: the ranks given contiguous runs of the epoch's batches, or the ranks' order
# reversed; the batches left over by the ranks dropped from the front instead of the end.
@pytest.mark.parametrize("n, replicas", [(6, 2), (6, 3), (7, 2), (7, 3)])
def test_ffd_ranks_take_the_one_rank_epochs_batches_in_turn(n, replicas):
    """Samples that each fill a batch: one rank's epoch is a sequence of single-sample batches;
    over ``replicas`` ranks step k gives rank r batch ``k * replicas + r`` of that sequence,
    the last ``n % replicas`` (lone samples, not splittable) dropped."""
    lengths = np.full(n, 2049)
    one = ffd(lengths)
    kept = one[: n - n % replicas]
    assert all_ranks(lengths, replicas) == [kept[r::replicas] for r in range(replicas)]


# Catches: the split halves taken shortest first or as the two halves of the sorted bin (or the
# longest alone); a 2-sample batch dropped instead of split; only one split where two are
# needed (the ranks then get different numbers of steps).
def test_ffd_splits_the_widest_batch_longest_first_alternately():
    """Two full batches and one of 4 samples (800 + 600 + 400 + 200 positions) over 2 ranks:
    the 4-sample batch is split into 800 + 400 and 600 + 200. A 2-sample batch is split too
    (not dropped); over 3 ranks 4 batches take two splits: 6 batches, 2 a rank."""
    lengths = [2049, 2049, 801, 601, 401, 201]
    got = all_ranks(lengths, 2)
    assert [len(g) for g in got] == [2, 2]
    assert sorted(sorted(b) for g in got for b in g) == [[0], [1], [2, 4], [3, 5]]
    got = all_ranks([2049, 2049, 1025, 1025], 2)
    assert sorted(sorted(b) for g in got for b in g) == [[0], [1], [2], [3]]
    got = all_ranks([2049, 2049, 2049, 801, 601, 401, 201], 3)
    assert [len(g) for g in got] == [2, 2, 2]
    assert sorted(i for g in got for b in g for i in b) == list(range(7))


# Catches: max_batches keeping the epoch's last batches instead of its first.
def test_ffd_max_batches_keeps_the_epochs_first_batches():
    lengths = np.random.default_rng(0).integers(256, 2049, 100)
    assert ffd(lengths, max_batches=4) == ffd(lengths)[:4]


# Catches: the window's batches put shortest first (reversed) instead of in a random order.
def test_ffd_batches_come_neither_longest_nor_shortest_first():
    lengths = np.random.default_rng(0).integers(256, 2049, 300)
    longest = [max(lengths[b]) for b in ffd(lengths)]
    assert longest not in (sorted(longest), sorted(longest, reverse=True))


# Catches: another default window (the whole epoch packed at once, say).
def test_ffd_packs_1024_samples_at_a_time_by_default():
    """1100 samples: the first batches hold exactly the first 1024 of the shuffled order."""
    lengths = np.random.default_rng(1).integers(2, 400, 1100)
    got = ffd(lengths, seed=5)
    first = set(np.random.default_rng(5).permutation(1100)[:1024].tolist())
    seen, rest = set(), iter(got)
    while len(seen) < len(first):
        seen |= set(next(rest))
    assert seen == first


# Catches: pack_fill's epoch ignored (epoch 0's batches counted); an epoch with no batch at all
# (a lone sample dropped by 2 ranks) giving a fill other than 0.
def test_pack_fill_counts_the_given_epochs_batches_and_none_as_zero():
    """speculators' sampler packs 50 samples into 34 batches in epoch 0, 38 in epoch 1."""
    lengths = np.random.default_rng(0).integers(256, 2049, 50)
    fills = []
    for epoch in (0, 1):
        sampler = batches.make_sampler("multipack", lengths, 2048, 1, 0, 0)
        epoch_batches = sampler._generate_batches(epoch)
        tokens = sum(batches.real_tokens(epoch_batches, lengths, 2048))
        fills.append(tokens / (2048 * len(epoch_batches)))
        assert batches.pack_fill("multipack", lengths, 2048, epoch=epoch) == fills[-1]
    assert fills[0] != fills[1]
    assert batches.pack_fill("ffd", [2049], 2048, replicas=2) == 0.0


# ---- building batches ------------------------------------------------------------------------


def tiny_loader(tmp_path, n=24, max_len=16):
    """A ShardDataset of n samples of 3-9 tokens (2 layer slots of 4 values, random states) and
    make_loader's loader over it (speculators' sampler: about n / 2 batches of 16 positions)."""
    lengths = tuple(int(x) for x in np.random.default_rng(0).integers(3, 10, n))
    layout = shards.ShardLayout(lengths, 2, 4)
    path = tmp_path / "s.safetensors"
    writer = shard_writer.ShardWriter(path, layout, {"format": "test"})
    gen = torch.Generator().manual_seed(0)
    for i in layout.put_order:
        writer.put_states(i, torch.randn(layout.lengths[i], 2, 4, generator=gen))
    tokens = layout.tokens
    writer.close(np.arange(tokens) % 97, (np.arange(tokens) % 3 != 0).astype(np.uint8))
    ds = train_data.ShardDataset([path], [(0, i) for i in range(n)], max_len, torch.float32)
    return train_data.make_loader(ds, max_len, 4, 1, seed=0)


def same(ours: dict, theirs: dict) -> bool:
    return list(ours) == list(theirs) and all(
        torch.equal(ours[k], v) if isinstance(v, torch.Tensor) else ours[k] == v
        for k, v in theirs.items()
    )


def loader_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("batch-loader")]


# Catches: a subclass of CollateFn (which may build its batches otherwise) or another
# preprocess function taken for speculators' own.
def test_no_shard_collator_for_a_collate_subclass_or_another_preprocess(tmp_path):
    from speculators.train.data import CollateFn

    from eagle3lib.train_data import shift_fp8_batch

    loader = tiny_loader(tmp_path)
    ds, collate = loader.dataset, loader.collate_fn
    assert batches.shard_collator(ds, collate, pin=False) is not None

    class Mine(CollateFn):
        pass

    mine = Mine(16, 4, num_target_layers=1, dtype=torch.float32, preprocess=collate.preprocess)
    assert batches.shard_collator(ds, mine, pin=False) is None
    fp8 = CollateFn(16, 4, num_target_layers=1, dtype=torch.float32, preprocess=shift_fp8_batch)
    assert batches.shard_collator(ds, fp8, pin=False) is None


# Catches: a fresh set made while a handed-back one is free; wait_seconds keeping only the
# last wait instead of adding them up.
def test_the_pool_reuses_a_free_set_before_making_one_and_adds_up_its_waits():
    class Copy:
        def synchronize(self):
            time.sleep(0.05)

    pool = batches._Pool(dict, size=2)  # noqa: SLF001
    first = pool.get()
    pool.put(first)
    assert pool.get() is first and pool.made == 1  # no event: no wait either
    assert pool.wait_seconds < 0.05
    for _ in range(2):
        pool.put(first, Copy())
        assert pool.get() is first
    assert 0.095 <= pool.wait_seconds < 1.0


# Catches: a default depth other than max(2, threads), a window started with fewer or more
# than ``depth`` batches or refilled by more than one a batch, a pool of fewer than depth + 2
# sets (the loader then stalls while the caller holds the batch being copied and the current
# one); the copy's event of a handed-back set not waited for before the set is written again;
# a held batch overwritten.
def test_threaded_batches_read_depth_ahead_into_depth_plus_two_sets(tmp_path, monkeypatch):
    """3 threads (depth 3 by default): with the first batch taken, the next 3 are built and no
    more; with two held (the one being copied to the GPU and the current one) the loader still
    builds 3 ahead, into a fifth set, and neither held batch changes. Every set handed back
    with an event is written again only after the event's synchronize; the batches are the
    loader's own, in order; at most depth + 2 sets are made."""
    loader = tiny_loader(tmp_path)
    expected = list(loader)
    assert len(expected) >= 8
    built, made, synced = [], [], []
    real_call, real_buffers = batches.ShardCollator.__call__, batches.ShardCollator.buffers

    def building(self, indices, buffers):
        assert buffers["input_ids"].data_ptr() not in held, "a held set written"
        built.append(list(indices))
        return real_call(self, indices, buffers)

    def making(self):
        made.append(1)
        return real_buffers(self)

    class Copied:
        def synchronize(self):
            synced.append(1)

    monkeypatch.setattr(batches.ShardCollator, "__call__", building)
    monkeypatch.setattr(batches.ShardCollator, "buffers", making)
    held: set = set()
    threaded = batches.ThreadedBatches(loader, 3)
    epoch = iter(threaded)
    unreleased = []  # handed back before closing, so that no loader thread waits for a set
    try:
        first, release_first = next(epoch)
        unreleased.append(release_first)
        held.add(first["input_ids"].data_ptr())
        assert wait_until(lambda: len(built) >= 4, 5)
        time.sleep(0.1)
        assert len(built) == 4  # the one taken and 3 ahead
        second, release_second = next(epoch)
        unreleased.append(release_second)
        held.add(second["input_ids"].data_ptr())
        assert wait_until(lambda: len(built) >= 5, 5), "no set for the batch 3 ahead"
        assert same(first, expected[0]) and same(second, expected[1])
        held.clear()
        while unreleased:
            unreleased.pop(0)(Copied())
        for k, (batch, release) in enumerate(epoch, start=2):
            assert same(batch, expected[k]), k
            release(Copied())
        assert k == len(expected) - 1
    finally:
        held.clear()
        for release in unreleased:
            release(None)
        epoch.close()
    assert len(made) <= 3 + 2
    assert len(synced) == len(expected) - len(made)  # every reuse after its copy's event


# Catches: threads 0 given to the executor (it refuses) instead of one thread; the executor
# shut down without waiting for its threads (they outlive the epoch); an error surfacing
# before the batches ahead of it, or its threads left running.
def test_threaded_batches_end_their_threads_and_raise_an_error_after_the_batches_before_it(
    tmp_path, monkeypatch
):
    loader = tiny_loader(tmp_path)
    expected = list(loader)
    got = 0
    for _batch, release in batches.ThreadedBatches(loader, 0):  # one thread
        release(None)
        got += 1
    assert got == len(expected)
    epoch = iter(batches.ThreadedBatches(loader, 2))
    next(epoch)
    assert loader_threads()
    epoch.close()
    assert not loader_threads()

    class Damaged(Exception):
        pass

    bad = expected[3]["input_ids"]
    real_call = batches.ShardCollator.__call__

    def failing(self, indices, buffers):
        batch = real_call(self, indices, buffers)
        if torch.equal(batch["input_ids"], bad):
            raise Damaged("a damaged shard")
        return batch

    monkeypatch.setattr(batches.ShardCollator, "__call__", failing)
    got = []
    with pytest.raises(Damaged, match="a damaged shard"):
        for batch, release in batches.ThreadedBatches(loader, 3):
            got.append(batch["input_ids"].clone())
            release(None)
    assert len(got) == 3 and not loader_threads()
    assert all(torch.equal(g, e["input_ids"]) for g, e in zip(got, expected[:3], strict=True))


# Catches: a caller holding a third batch left waiting forever (the loader thread waits for a
# set that never comes back and the epoch's close waits for that thread); a set released twice
# handed out twice (two batches then written into one set).
def test_threaded_batches_refuse_a_third_held_batch_and_a_second_release(tmp_path, monkeypatch):
    """One thread, depth 2: four sets. Three batches taken, none released, the loader's thread
    waiting for a set for the fifth: the fourth ``next`` raises (naming the three held and the
    limit of two) instead of waiting, and the loader's thread ends. A release called twice
    raises; every set went back once."""
    loader = tiny_loader(tmp_path)
    outcome = {}
    waiting = threading.Event()  # a loader thread asks for a set when all four are out
    real_get = batches._Pool.get  # noqa: SLF001

    def get(self):
        if self.made == self.size and self.free.empty():
            waiting.set()
        return real_get(self)

    monkeypatch.setattr(batches._Pool, "get", get)  # noqa: SLF001

    def hold_three():
        epoch = iter(batches.ThreadedBatches(loader, 1))
        held = [next(epoch) for _ in range(3)]
        outcome["waiting"] = waiting.wait(10)
        try:
            next(epoch)
        except RuntimeError as error:
            outcome["error"] = str(error)
        outcome["held"] = len(held)

    caller = threading.Thread(target=hold_three, daemon=True)
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "the caller waits for a batch that never comes"
    assert outcome == {
        "waiting": True,
        "held": 3,
        "error": "ThreadedBatches: the caller holds 3 batches whose buffers it has not released;"
        " release each (release(event)) once its copy to the GPU is recorded: at most 2 may be"
        " held",
    }
    assert wait_until(lambda: not loader_threads(), 5), "a loader thread still waits for a set"

    threaded = batches.ThreadedBatches(loader, 1)
    epoch = iter(threaded)
    _batch, release = next(epoch)
    release(None)
    with pytest.raises(
        RuntimeError, match="^ThreadedBatches: a batch's buffers were released twice$"
    ):
        release(None)
    assert threaded.pool.held == 0
    for _batch, release in epoch:
        release(None)
    pool = threaded.pool  # every set back once, then close's wake-up for each of the four
    assert pool.held == 0 and pool.made <= 4 and pool.free.qsize() == pool.made + 4


# Catches: buffers pinned because the loader pins, on a host without CUDA (torch then refuses).
@pytest.mark.skipif(torch.cuda.is_available(), reason="pins on a GPU host")
def test_threaded_batches_pin_nothing_without_cuda(tmp_path):
    loader = tiny_loader(tmp_path)
    expected = list(loader)
    pinning = types.SimpleNamespace(
        dataset=loader.dataset,
        collate_fn=loader.collate_fn,
        batch_sampler=loader.batch_sampler,
        pin_memory=True,
    )
    got = []
    for batch, release in batches.ThreadedBatches(pinning, 2):
        got.append(same(batch, expected[len(got)]))
        release(None)
    assert got == [True] * len(expected)
