import numpy as np
import pytest
import torch

from eagle3lib import vocab
from eagle3lib.errors import UserError


def freq_of(counts: dict[int, int], size: int) -> np.ndarray:
    f = np.zeros(size, dtype=np.int64)
    for t, c in counts.items():
        f[t] = c
    return f


def test_top_k_by_frequency_with_id_tie_break():
    freq = freq_of({50: 9, 7: 5, 90: 5, 3: 1, 60: 1}, 100)
    d2t, t2d = vocab.build(freq, 4)
    targets = (torch.arange(4) + d2t).tolist()
    assert targets == [3, 7, 50, 90]  # 50, then 7 and 90 (tie on 5), then 3 before 60 (tie on 1)
    assert torch.nonzero(t2d).flatten().tolist() == targets
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool


def test_fewer_distinct_tokens_than_draft_vocab_pads_deterministically():
    freq = freq_of({40: 3, 41: 2}, 64)
    d2t, t2d = vocab.build(freq, 6)
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 40, 41]
    again = vocab.build(freq, 6)
    assert torch.equal(again[0], d2t) and torch.equal(again[1], t2d)
    info = vocab.coverage(freq, t2d)
    assert info["padded_with_unseen_ids"] == 4
    assert info["token_coverage"] == 1.0


def test_draft_vocab_is_the_most_frequent_tokens_on_random_counts():
    """An independent reference: the K ids with the largest counts (ties: smaller id first)."""
    rng = np.random.default_rng(0)
    freq = rng.integers(0, 50, size=500) * (rng.random(500) < 0.6)
    d2t, t2d = vocab.build(freq, 128)
    order = np.lexsort((np.arange(500), -freq))  # by count descending, then id
    expected = np.sort(order[:128])
    assert (torch.arange(128) + d2t).tolist() == expected.tolist()
    assert np.flatnonzero(t2d.numpy()).tolist() == expected.tolist()


def test_draft_vocab_larger_than_verifier_vocab_is_a_config_error():
    with pytest.raises(
        UserError, match=r"train.draft_vocab_size: 200 is larger than the verifier vocab \(100\)"
    ):
        vocab.build(freq_of({1: 1}, 100), 200)


def test_invariant_checks_catch_broken_maps():
    d2t, t2d = vocab.build(freq_of({5: 2, 9: 1}, 20), 4)
    vocab.check(d2t, t2d, 4, 20)
    broken = t2d.clone()
    broken[19] = True
    with pytest.raises(ValueError, match="t2d marks 5 tokens, expected 4"):
        vocab.check(d2t, broken, 4, 20)
    with pytest.raises(ValueError, match="increasing, in-range"):
        vocab.check(d2t.flip(0), t2d, 4, 20)
    moved = t2d.clone()  # the right count, another id: t2d no longer what d2t maps to
    last = int(torch.nonzero(t2d).flatten()[-1])
    moved[last], moved[last + 1] = False, True
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        vocab.check(d2t, moved, 4, 20)
    with pytest.raises(ValueError, match=r"d2t has 4 entries \(expected 5\)"):
        vocab.check(d2t, t2d, 5, 20)
    with pytest.raises(ValueError, match="expected int64/bool"):
        vocab.check(d2t.int(), t2d, 4, 20)
    with pytest.raises(ValueError, match=r"d2t has shape \[4, 1\], t2d \[20\] \(expected 1-D"):
        vocab.check(d2t[:, None], t2d, 4, 20)
    with pytest.raises(ValueError, match=r"d2t has shape \[\], t2d \[20\]"):
        vocab.check(d2t[0], t2d, 4, 20)


def test_save_load_round_trip(tmp_path):
    d2t, t2d = vocab.build(freq_of({5: 2, 9: 1}, 20), 4)
    vocab.save(tmp_path / "v.safetensors", d2t, t2d)
    loaded = vocab.load(tmp_path / "v.safetensors")
    assert torch.equal(loaded["d2t"], d2t) and torch.equal(loaded["t2d"], t2d)


# Catches: the size check rejecting a draft vocab equal to the verifier vocab (> made >=).
def test_draft_vocab_as_large_as_the_verifier_vocab_is_allowed():
    """train.draft_vocab_size may equal the verifier's vocab ("use at most N"): every id is in
    the draft vocab, d2t is all zero offsets, and the coverage is complete."""
    freq = freq_of({5: 2, 9: 1}, 20)
    d2t, t2d = vocab.build(freq, 20)
    assert d2t.tolist() == [0] * 20
    assert bool(t2d.all())
    assert vocab.coverage(freq, t2d)["token_coverage"] == 1.0


# Catches: token_coverage counting every supervised token as covered (covered = total);
# padded_with_unseen_ids losing its max(0, ...) (negative when more distinct tokens were seen
# than the draft vocab holds); verifier_vocab_size reporting another size; token_coverage of
# no supervised tokens becoming 0.0 instead of None.
def test_coverage_when_the_draft_vocab_drops_supervised_tokens():
    """The usual case: more distinct supervised tokens than the draft vocab holds. Coverage is
    the share of supervised tokens (with their counts) in the draft vocab, nothing is padded,
    and the sizes are the draft's and the verifier's; no supervised tokens: no coverage."""
    freq = freq_of({50: 9, 7: 5, 90: 5, 3: 1, 60: 1}, 100)
    d2t, t2d = vocab.build(freq, 2)  # 50 and 7 (7 before 90 on the tie)
    assert torch.nonzero(t2d).flatten().tolist() == [7, 50]
    assert vocab.coverage(freq, t2d) == {
        "draft_vocab_size": 2,
        "verifier_vocab_size": 100,
        "distinct_supervised_tokens": 5,
        "padded_with_unseen_ids": 0,
        "supervised_tokens": 21,
        "token_coverage": pytest.approx(14 / 21),
    }
    assert vocab.coverage(np.zeros(100, dtype=np.int64), t2d)["token_coverage"] is None


# Catches: check() no longer comparing len(t2d) with the verifier vocab (only d2t's length).
def test_invariant_check_rejects_a_t2d_of_another_length():
    """A t2d longer than the verifier vocab (trailing False entries: the right count, the same
    marked ids) is still a broken map for vLLM, which indexes it by verifier id."""
    d2t, t2d = vocab.build(freq_of({5: 2, 9: 1}, 20), 4)
    longer = torch.cat([t2d, torch.zeros(1, dtype=torch.bool)])
    with pytest.raises(ValueError, match=r"t2d 21 \(expected 20\)"):
        vocab.check(d2t, longer, 4, 20)
    with pytest.raises(ValueError, match=r"t2d 19 \(expected 20\)"):
        vocab.check(d2t, t2d[:19], 4, 20)


# Catches: build() returning speculators' maps without running check() on them.
def test_build_rejects_a_broken_map_from_speculators(monkeypatch):
    """build validates what speculators' build_vocab_mappings_from_distribution returns, so a
    change in speculators that breaks the invariants fails at the vocab rule, not in vLLM."""
    import speculators.train.vocab_mapping as mapping

    real = mapping.build_vocab_mappings_from_distribution

    def unsorted(*args):
        d2t, t2d = real(*args)
        return d2t.flip(0), t2d  # draft ids no longer map to increasing verifier ids

    monkeypatch.setattr(mapping, "build_vocab_mappings_from_distribution", unsorted)
    with pytest.raises(ValueError, match="increasing, in-range"):
        vocab.build(freq_of({5: 2, 9: 1}, 20), 4)


# Catches: load() no longer checking for missing tensors (the missing-key check dropped, or
# only d2t checked): a map without t2d would load and fail later with a KeyError.
@pytest.mark.parametrize(
    ("tensors", "lacks"), [(("d2t",), "t2d"), (("t2d",), "d2t"), ((), "d2t, t2d")]
)
def test_load_reports_a_vocab_map_lacking_d2t_or_t2d(tmp_path, tensors, lacks):
    """A readable safetensors file without d2t and/or t2d is a UserError naming what it
    lacks and how to fix it."""
    from safetensors.torch import save_file

    d2t, t2d = vocab.build(freq_of({5: 2, 9: 1}, 20), 4)
    present = {"d2t": d2t, "t2d": t2d, "other": torch.zeros(1)}
    path = tmp_path / "v.safetensors"
    save_file({k: v for k, v in present.items() if k in tensors or k == "other"}, str(path))
    with pytest.raises(UserError) as info:
        vocab.load(path)
    assert str(info.value) == (
        f"{path}: vocab map lacks {lacks}; delete it and rerun the vocab rule"
    )
