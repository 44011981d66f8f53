import numpy as np
import pytest
import torch
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

from eagle3lib import batches, train_data
from eagle3lib.shards import open_shard


def loader_over(paths, dtype, storage, max_len, packing="multipack"):
    shards = [open_shard(p) for p in paths]
    pairs, _ = train_data.split_indices(shards, 0.1)
    ds = train_data.ShardDataset(paths, pairs, max_len, dtype, storage)
    return train_data.make_loader(ds, max_len, 64, 3, seed=0, packing=packing)


def assert_same_batch(ours: dict, theirs: dict):
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


@pytest.mark.parametrize(
    "storage, dtype",
    [("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp8", torch.float32)],
    ids=["bf16-bytes", "bf16-to-fp32", "fp8"],
)
def test_shard_collator_writes_speculators_collate_output(pipeline, fp8_shards, storage, dtype):
    """Bit for bit speculators' CollateFn (with shift_batch / shift_fp8_batch) on the same
    samples: the sampler's batches, an overfull one (last sample truncated), a sample longer
    than the batch, one sample; all into one reused buffer set (stale bytes would show)."""
    paths = pipeline["shards"] if storage == "bf16" else fp8_shards[0]
    max_len = 64
    loader = loader_over(paths, dtype, storage, max_len)
    ds = loader.dataset
    collator = batches.shard_collator(ds, loader.collate_fn, pin=False)
    assert collator is not None
    lengths = np.asarray(ds.approx_lengths)
    longest, shortest = int(lengths.argmax()), int(lengths.argmin())
    assert lengths[longest] > max_len + 1 > lengths[shortest]
    cases = [*loader.batch_sampler, [shortest, longest, 0], [longest], [shortest]]
    buffers = collator.buffers()
    truncated = 0
    for indices in cases:
        theirs = loader.collate_fn([ds[int(i)] for i in indices])
        ours = collator(indices, buffers)
        assert_same_batch(ours, theirs)
        truncated += int((ours["document_ids"] != -1).sum()) < (lengths[indices] - 1).sum()
    assert truncated >= 2


def test_no_shard_collator_where_it_would_differ(pipeline):
    from speculators.train.data import CollateFn

    loader = loader_over(pipeline["shards"], torch.float32, "bf16", 256)
    other = CollateFn(256, 64, num_target_layers=3, dtype=torch.float32, preprocess=None)
    assert batches.shard_collator(loader.dataset, other, pin=False) is None
    wrong_dtype = CollateFn(
        256, 64, num_target_layers=3, dtype=torch.bfloat16, preprocess=loader.collate_fn.preprocess
    )
    assert batches.shard_collator(loader.dataset, wrong_dtype, pin=False) is None


@pytest.mark.parametrize("threads, fast", [(1, True), (3, True), (2, False)])
def test_threaded_batches_are_the_dataloaders_in_order(pipeline, threads, fast, monkeypatch):
    """The DataLoader's own batches, in its order; buffers reused (at most depth + 2 sets)
    once released. Without a ShardCollator (another dataset or collate), the loader's
    collate itself."""
    if not fast:
        monkeypatch.setattr(batches, "shard_collator", lambda *_: None)
    loader = loader_over(pipeline["shards"], torch.float32, "bf16", 128)
    loader.batch_sampler.set_epoch(1)
    expected = list(loader)
    made = []
    real = batches.ShardCollator.buffers

    def counting(self):
        made.append(1)
        return real(self)

    pipeline_ = batches.ThreadedBatches(loader, threads, depth=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batches.ShardCollator, "buffers", counting)
        got = 0
        for (batch, release), theirs in zip(pipeline_, expected, strict=True):
            assert_same_batch(batch, theirs)
            release(None)
            got += 1
    assert got == len(expected) == len(pipeline_) >= 8
    assert 1 <= len(made) <= 4 if fast else not made


def test_threaded_batches_raise_the_loaders_error_in_the_caller(pipeline, monkeypatch):
    loader = loader_over(pipeline["shards"], torch.float32, "bf16", 128)

    class Broken(Exception):
        pass

    def broken(*_):
        raise Broken("bad sample")

    monkeypatch.setattr(batches.ShardCollator, "__call__", broken)
    with pytest.raises(Broken):
        next(iter(batches.ThreadedBatches(loader, 2)))


def test_the_pool_counts_the_loaders_wait_for_a_free_buffer_set():
    """A set is made while fewer than ``size`` exist; after that a loader thread waits for one
    to come back and for its copy's event: both waits add up in ``wait_seconds`` (a CUDA
    event stood in for by one whose synchronize sleeps)."""
    import threading
    import time

    class Copy:
        def synchronize(self):
            time.sleep(0.05)

    pool = batches._Pool(dict, size=1)  # noqa: SLF001
    first = pool.get()
    assert pool.wait_seconds == 0.0  # made, not waited for
    threading.Timer(0.05, pool.put, (first, Copy())).start()  # handed back later
    assert pool.get() is first
    assert 0.09 <= pool.wait_seconds < 1.0


# ---- packing ---------------------------------------------------------------------------------


def bench_mix(n=300, seed=0):
    """bench/train.py's length mix: uniform 256-2048 tokens."""
    return np.random.default_rng(seed).integers(256, 2049, n)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_ffd_packs_every_sample_once_whole_and_deterministically(replicas):
    lengths = np.concatenate([bench_mix(301), [2049, 2048, 1]])  # whole after the shift too
    per_rank = []
    for rank in range(replicas):
        sampler = batches.make_sampler("ffd", lengths, 2048, replicas, rank, seed=7)
        again = batches.make_sampler("ffd", lengths, 2048, replicas, rank, seed=7)
        epoch0, epoch1 = sampler._generate_batches(0), sampler._generate_batches(1)
        assert [b.tolist() for b in epoch0] == [b.tolist() for b in again._generate_batches(0)]
        assert [b.tolist() for b in epoch0] != [b.tolist() for b in epoch1]
        per_rank.append(epoch0)
        for batch in epoch0:
            assert (lengths[batch] - 1).sum() <= 2048  # nothing truncated by the collate
    assert len({len(b) for b in per_rank}) == 1  # every rank the same number of steps
    seen = np.concatenate([b for rank in per_rank for b in rank])
    assert sorted(seen.tolist()) == list(range(len(lengths)))


def test_ffd_splits_batches_for_the_ranks_and_drops_only_lone_remainders():
    # 5 samples that each fill a batch, 2 ranks: speculators would drop 1 sample, so do we
    alone = np.full(5, 2049)
    got = [batches.make_sampler("ffd", alone, 2048, 2, r, 0)._generate_batches(0) for r in (0, 1)]
    assert [len(g) for g in got] == [2, 2]
    # 3 batches' worth of small samples over 2 ranks: one batch is split, nothing dropped
    small = np.full(12, 513)
    got = [batches.make_sampler("ffd", small, 2048, 2, r, 0)._generate_batches(0) for r in (0, 1)]
    assert [len(g) for g in got] == [2, 2]
    assert sorted(np.concatenate(got[0] + got[1]).tolist()) == list(range(12))


def test_ffd_fills_batches_fuller_than_speculators_multipack():
    """On the bench's mix: speculators' sampler leaves about a quarter of 2048 positions
    empty; best-fit decreasing windows fill over 90 % (and at 8192 nearly all)."""
    lengths = bench_mix(400)
    speculators_fill = batches.pack_fill("multipack", lengths, 2048)
    ffd_fill = batches.pack_fill("ffd", lengths, 2048)
    assert speculators_fill < 0.8 and ffd_fill > 0.9
    assert batches.pack_fill("ffd", lengths, 8192) > batches.pack_fill("multipack", lengths, 8192)
    assert batches.pack_fill("ffd", lengths, 2048, replicas=2) > 0.9
    # pack_fill counts what speculators' own sampler gives
    sampler = MultipackDistributedBatchSamplerV2(2048, lengths, 1, 0, seed=0)
    tokens = sum(batches.real_tokens(sampler._generate_batches(0), lengths, 2048))
    assert speculators_fill == tokens / (2048 * len(sampler))


def test_ffd_supports_speculators_resume_skip_and_max_batches():
    lengths = bench_mix(100)
    sampler = batches.make_sampler("ffd", lengths, 2048, 1, 0, 0)
    sampler.set_epoch(2)
    full = [b.tolist() for b in sampler]
    assert len(sampler) == len(full)
    sampler._cached_generated_batches = (2, sampler._generate_batches(2)[3:])  # what it does
    assert [b.tolist() for b in sampler] == full[3:]
    capped = batches.FirstFitDecreasingSampler(2048, lengths, 1, 0, seed=0, max_batches=4)
    assert len(capped) == 4


def test_best_fit_decreasing_puts_each_sample_into_the_fullest_bin_that_holds_it():
    """Longest first, each into the bin with the least room that still holds it (an exact fit
    included), a new bin when none does; ties go to the earlier position and the older bin."""
    # 7 -> bin 0 (room 3); 5 -> bin 1 (room 5); 3 fits bin 0 exactly (room 0); the second 3
    # goes to bin 1 (room 2), and the 2 fills it exactly
    assert batches.best_fit_decreasing(np.array([5, 3, 7, 2, 3]), 10) == [[2, 1], [0, 4, 3]]
    # equal rooms: the older bin first; equal costs: the earlier position first
    assert batches.best_fit_decreasing(np.array([4, 4, 2, 2]), 6) == [[0, 2], [1, 3]]
    assert batches.best_fit_decreasing(np.array([3, 3, 3, 3]), 6) == [[0, 1], [2, 3]]


def test_ffd_costs_each_sample_its_length_after_speculators_shift():
    """Two 1025-token samples are 1024 positions each after shift_batch: they fill one
    2048-position batch exactly; 1026 + 1025 tokens (2049 positions) take two batches."""
    fit = batches.make_sampler("ffd", [1025, 1025], 2048, 1, 0, 0)._generate_batches(0)
    assert [sorted(b.tolist()) for b in fit] == [[0, 1]]
    over = batches.make_sampler("ffd", [1026, 1025], 2048, 1, 0, 0)._generate_batches(0)
    assert sorted(b.tolist() for b in over) == [[0], [1]]


def test_ffd_packs_speculators_shuffled_order_window_by_window():
    """The epoch's samples in speculators' order (a permutation seeded with seed + epoch) are
    packed ``window`` at a time: consecutive batches hold exactly the first 16 shuffled
    samples, then the next 16, ...; every sample once, the last window partial (100 = 6 x 16
    + 4)."""
    lengths = bench_mix(100)
    sampler = batches.FirstFitDecreasingSampler(2048, lengths, 1, 0, seed=3, window=16)
    got = sampler._generate_batches(1)
    order = np.random.default_rng(3 + 1).permutation(100)
    assert sorted(np.concatenate(got).tolist()) == list(range(100))
    rest = iter(got)
    for start in range(0, 100, 16):
        want, seen = set(order[start : start + 16].tolist()), set()
        while len(seen) < len(want):
            seen |= set(next(rest).tolist())
        assert seen == want, start
    assert next(rest, None) is None


def test_ffd_batches_come_in_random_order_not_longest_first():
    """Best-fit decreasing opens batches longest sample first; the batches are then put in a
    random order, so an epoch does not start with the longest samples."""
    lengths = bench_mix(300)
    epoch = batches.make_sampler("ffd", lengths, 2048, 1, 0, seed=0)._generate_batches(0)
    longest = [int(lengths[b].max()) for b in epoch]
    assert len(epoch) > 100
    assert longest != sorted(longest, reverse=True)


def test_ffd_drops_every_lone_batch_left_over_by_the_ranks():
    """5 samples that each fill a batch over 3 ranks: 2 batches are left over and cannot be
    split, so both are dropped (as speculators drops < replicas samples): one step each."""
    alone = np.full(5, 2049)
    got = [batches.make_sampler("ffd", alone, 2048, 3, r, 0)._generate_batches(0) for r in range(3)]
    assert [len(g) for g in got] == [1, 1, 1]
    assert len(set(np.concatenate([b for g in got for b in g]).tolist())) == 3


def test_make_sampler_refuses_an_unknown_packing():
    with pytest.raises(ValueError, match="packing 'bfd': choose from ffd, multipack"):
        batches.make_sampler("bfd", [10, 20], 2048, 1, 0, 0)


def test_real_tokens_are_the_shifted_lengths_capped_at_the_batch():
    """Per batch: each sample's length minus one (a 1-token sample adds none), the batch at most
    total_seq_len (a sample longer than the batch is truncated)."""
    lengths = np.array([10, 1, 3000, 20])
    got = batches.real_tokens([np.array([0, 1, 3]), np.array([2]), np.array([3, 0])], lengths, 2048)
    assert got == [9 + 0 + 19, 2048, 19 + 9]


def test_pack_fill_counts_every_ranks_batches():
    """A full batch (2049 tokens: 2048 after the shift) and a half one (1025) over 2 ranks:
    3072 real tokens in 2 x 2048 positions, whichever rank gets which."""
    assert batches.pack_fill("ffd", [2049, 1025], 2048, replicas=2) == 0.75
    assert batches.pack_fill("multipack", [2049, 1025], 2048, replicas=2) == 0.75


def test_no_shard_collator_for_another_hidden_size_or_layer_count(pipeline):
    """CollateFn's hidden_size and num_target_layers must be the shards' (64, 3 aux slots);
    otherwise speculators' collate is used (and reports the mismatch), not ShardCollator."""
    from speculators.train.data import CollateFn

    loader = loader_over(pipeline["shards"], torch.float32, "bf16", 256)
    preprocess = loader.collate_fn.preprocess
    same = CollateFn(256, 64, num_target_layers=3, dtype=torch.float32, preprocess=preprocess)
    assert batches.shard_collator(loader.dataset, same, pin=False) is not None
    for hidden, layers in ((32, 3), (64, 2)):
        other = CollateFn(256, hidden, layers, dtype=torch.float32, preprocess=preprocess)
        assert batches.shard_collator(loader.dataset, other, pin=False) is None, (hidden, layers)


def test_ffd_never_truncates_a_sample_next_to_one_longer_than_the_batch():
    """A 2049-token sample fills 2048 positions after the shift: a 2-token sample (1 position)
    never shares its batch, where CollateFn would truncate it to nothing (speculators'
    sampler clips its lengths to the batch: the costs come from the lengths as given)."""
    lengths = np.array([2049, 2])
    got = batches.make_sampler("ffd", lengths, 2048, 1, 0, 0)._generate_batches(0)
    assert sorted(b.tolist() for b in got) == [[0], [1]]


def test_loader_workers_give_the_same_batches_as_the_training_threads(pipeline):
    """train.loader_workers > 0 (speculators' loader settings: spawned worker processes,
    persistent, prefetch 4): the same batches in the same order, over two epochs, as the
    loader of the training process (loader_workers 0, whose batches ThreadedBatches yields
    bit for bit: test above). A worker process is spawned here for real."""
    paths = pipeline["shards"]
    shards = [open_shard(p) for p in paths]
    pairs, _ = train_data.split_indices(shards, 0.1)

    def loader(workers):
        ds = train_data.ShardDataset(paths, pairs, 128, torch.float32, "bf16")
        return train_data.make_loader(ds, 128, 64, 3, seed=0, workers=workers, packing="ffd")

    in_process, spawned = loader(0), loader(1)
    assert spawned.num_workers == 1 and spawned.persistent_workers
    assert spawned.multiprocessing_context.get_start_method() == "spawn"
    for epoch in (0, 1):
        in_process.batch_sampler.set_epoch(epoch)
        spawned.batch_sampler.set_epoch(epoch)
        expected = list(in_process)
        got = list(spawned)
        assert len(got) == len(expected) >= 4
        for ours, theirs in zip(got, expected, strict=True):
            assert_same_batch(ours, theirs)
    # the persistent worker lives until stopped (the train job stops it with the training,
    # or the job's wrapper would find it running); the in-process loader has none to stop
    workers = spawned._iterator._workers
    assert [w.is_alive() for w in workers] == [True]
    train_data.stop_workers(spawned, in_process)
    assert spawned._iterator is None and [w.is_alive() for w in workers] == [False]
