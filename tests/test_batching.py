"""Batch sources: token windows, validation windows, length buckets, padding collate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llm.data.batching import (IGNORE_INDEX, BucketBatchSampler, ExampleBatches, ReplayBatches, WindowSampler,
                               derive_seed, fixed_conversation_batches, fixed_windows, open_tokens, pad_collate,
                               replay_rows, upsample_sources)

TOKENS = (np.arange(10_000) % 997).astype(np.uint16)  # token at i is i % 997: windows are checkable


def _starts(batch):
    return sorted(batch["idx"][:, 0].tolist())


def test_windows_are_contiguous_and_targets_are_shifted():
    s = WindowSampler(TOKENS, seq_len=16, batch_size=4, seed=1)
    b = s.next_batch()
    assert b["idx"].shape == b["targets"].shape == (4, 16) and b["idx"].dtype == torch.long
    for row, tgt in zip(b["idx"], b["targets"]):
        assert torch.equal(tgt[:-1], row[1:])
        assert all((int(y) - int(x)) % 997 == 1 for x, y in zip(row, tgt))


def test_same_seed_same_batches_other_seed_other_batches():
    a = [WindowSampler(TOKENS, seq_len=8, batch_size=4, seed=1).next_batch()["idx"] for _ in range(2)]
    assert torch.equal(a[0], a[1])
    c = WindowSampler(TOKENS, seq_len=8, batch_size=4, seed=2).next_batch()["idx"]
    assert not torch.equal(a[0], c)


def test_resume_from_state_dict_gives_the_same_next_batches():
    s = WindowSampler(TOKENS, seq_len=8, batch_size=3, grad_accum=2, seed=5)
    for _ in range(5):
        s.next_batch()
    state = s.state_dict()
    expect = [s.next_batch()["idx"] for _ in range(4)]
    t = WindowSampler(TOKENS, seq_len=8, batch_size=3, grad_accum=2, seed=5)
    t.load_state_dict(state)
    assert all(torch.equal(e, t.next_batch()["idx"]) for e in expect)


def test_state_from_other_settings_is_refused():
    s = WindowSampler(TOKENS, seq_len=8, batch_size=3, seed=5)
    t = WindowSampler(TOKENS, seq_len=8, batch_size=4, seed=5)
    with pytest.raises(ValueError, match="batch_size"):
        t.load_state_dict(s.state_dict())


def test_ranks_and_accumulation_see_the_same_global_batch():
    # one process, batch 8  ==  one process, 2 x 4 accumulated  ==  two ranks, one of the 2 x 4 each
    one = WindowSampler(TOKENS, seq_len=8, batch_size=8, seed=3)
    accum = WindowSampler(TOKENS, seq_len=8, batch_size=4, grad_accum=2, seed=3)
    ranks = [WindowSampler(TOKENS, seq_len=8, batch_size=4, grad_accum=2, seed=3, rank=r, world_size=2)
             for r in (0, 1)]
    for _ in range(3):  # three optimizer steps
        big = _starts(one.next_batch())
        a, b = accum.next_batch(), accum.next_batch()
        assert sorted(_starts(a) + _starts(b)) == big
        assert _starts(ranks[0].next_batch()) == _starts(a) and _starts(ranks[1].next_batch()) == _starts(b)


def test_window_cursor_is_global_and_resumes_on_another_number_of_processes():
    """A state taken after 3 steps on 2 ranks resumes in 1 process (and back) at the same window."""
    kw = dict(seq_len=8, batch_size=3, grad_accum=4, seed=9)
    ref = WindowSampler(TOKENS, **kw)
    seq = [_starts(ref.next_batch()) for _ in range(6 * 4)]  # 6 steps, one process
    two = [WindowSampler(TOKENS, **kw, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(3 * 2):
        for s in two:
            s.next_batch()
    one = WindowSampler(TOKENS, **kw)
    one.load_state_dict(two[0].state_dict())
    assert [_starts(one.next_batch()) for _ in range(4)] == seq[12:16]  # step 4, one process
    back = [WindowSampler(TOKENS, **kw, rank=r, world_size=2) for r in (0, 1)]
    for s in back:
        s.load_state_dict(one.state_dict())
    got = [_starts(back[r].next_batch()) for _ in range(2) for r in (0, 1)]  # step 5, two ranks
    assert sorted(got) == sorted(seq[16:20])
    with pytest.raises(ValueError, match="grad_accum"):
        WindowSampler(TOKENS, seq_len=8, batch_size=3, grad_accum=3, seed=9, rank=0, world_size=2)


def test_fixed_windows_are_fixed_and_span_the_array():
    a = fixed_windows(TOKENS, seq_len=16, batch_size=4, n_batches=3)
    b = fixed_windows(TOKENS, seq_len=16, batch_size=4, n_batches=3)
    assert len(a) == 3 and all(torch.equal(x["idx"], y["idx"]) for x, y in zip(a, b))
    assert a[0]["idx"][0, 0] == 0  # starts at the beginning
    assert a[-1]["targets"][-1, -1] == TOKENS[-1]  # ends at the last token


def test_open_tokens_uint32_and_errors(tmp_path):
    p = tmp_path / "t.bin"
    np.arange(100, dtype=np.uint32).tofile(p)
    m = open_tokens(p, "uint32")
    assert len(m) == 100 and int(m[99]) == 99
    with pytest.raises(ValueError, match="uint16 or uint32"):
        open_tokens(p, "int64")
    (tmp_path / "odd.bin").write_bytes(b"\0\0\0")
    with pytest.raises(ValueError, match="odd.bin.*truncated"):
        open_tokens(tmp_path / "odd.bin", "uint16")
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        open_tokens(tmp_path / "missing.bin", "uint16")


LENGTHS = [3, 5, 7, 12, 14, 18, 25, 27, 29, 31, 33, 35, 44, 49, 51, 60, 61, 62, 63, 95]


def test_buckets_group_lengths_and_cover_each_example_once_per_epoch():
    s = BucketBatchSampler(LENGTHS, batch_size=3, bucket_width=10, seed=0)
    n = len(s)
    batches = [s.next_indices() for _ in range(n)]
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    for b in batches:
        assert len({LENGTHS[i] // 10 for i in b}) == 1, b
    assert s.next_indices() in s.epoch_batches(1)  # endless: the next epoch starts


def test_buckets_resume_mid_epoch_and_across_epochs():
    s = BucketBatchSampler(LENGTHS, batch_size=4, bucket_width=20, seed=7)
    for _ in range(len(s) - 1):
        s.next_indices()
    state = s.state_dict()
    expect = [s.next_indices() for _ in range(5)]  # crosses into epoch 1
    t = BucketBatchSampler(LENGTHS, batch_size=4, bucket_width=20, seed=7)
    t.load_state_dict(state)
    assert [t.next_indices() for _ in range(5)] == expect


def test_bucket_epochs_are_shuffled_by_seed():
    a = BucketBatchSampler(LENGTHS, batch_size=2, bucket_width=10, seed=1)
    b = BucketBatchSampler(LENGTHS, batch_size=2, bucket_width=10, seed=2)
    ea, eb = a.epoch_batches(0), b.epoch_batches(0)
    assert ea != eb and ea == a.epoch_batches(0) and ea != a.epoch_batches(1)


def test_bucket_ranks_take_whole_batches_in_turn_and_resume_on_another_number_of_processes():
    one = BucketBatchSampler(LENGTHS, batch_size=2, bucket_width=10, seed=3)
    seq = [one.next_indices() for _ in range(3 * len(one))]  # three epochs, one process
    kw = dict(batch_size=2, bucket_width=10, seed=3, world_size=2)
    r0, r1 = BucketBatchSampler(LENGTHS, rank=0, **kw), BucketBatchSampler(LENGTHS, rank=1, **kw)
    got = []
    for _ in range(len(one)):  # two epochs on two ranks
        got += [r0.next_indices(), r1.next_indices()]
    assert got == seq[:2 * len(one)]
    back = BucketBatchSampler(LENGTHS, batch_size=2, bucket_width=10, seed=3)
    back.load_state_dict(r0.state_dict())  # global position 2 * len(one): resumes in one process
    assert [back.next_indices() for _ in range(5)] == seq[2 * len(one):2 * len(one) + 5]


def test_pad_collate_hand_built():
    seqs = [[10, 11, 12, 13], [20, 21]]
    masks = [[False, False, True, True], [False, True]]
    out = pad_collate(seqs, pad_id=0, loss_masks=masks)
    assert out["idx"].tolist() == [[10, 11, 12], [20, 0, 0]]
    assert out["targets"].tolist() == [[IGNORE_INDEX, 12, 13], [21, IGNORE_INDEX, IGNORE_INDEX]]
    assert out["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    whole = pad_collate(seqs, pad_id=0, shift=False)
    assert whole["idx"].tolist() == [[10, 11, 12, 13], [20, 21, 0, 0]] and "targets" not in whole
    assert whole["attention_mask"].sum().item() == 6
    with pytest.raises(ValueError, match="loss mask"):
        pad_collate(seqs, pad_id=0, loss_masks=[[True], [True, True]])


def test_example_batches_is_a_resumable_source():
    data = [list(range(n)) for n in LENGTHS]
    make = lambda ix: pad_collate([data[i] for i in ix], pad_id=0)  # noqa: E731
    src = ExampleBatches(BucketBatchSampler(LENGTHS, batch_size=3, bucket_width=10, seed=0), make)
    src.next_batch()
    state = src.state_dict()
    a = src.next_batch()
    src2 = ExampleBatches(BucketBatchSampler(LENGTHS, batch_size=3, bucket_width=10, seed=0), make)
    src2.load_state_dict(state)
    b = src2.next_batch()
    assert torch.equal(a["idx"], b["idx"]) and torch.equal(a["targets"], b["targets"])


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(1, "pretrain", 3) == derive_seed(1, "pretrain", 3)
    assert derive_seed(1, "pretrain", 3) != derive_seed(1, "sft", 3)
    assert 0 <= derive_seed("x") < 2**63


def test_upsample_sources_repeats_only_the_small_sources_whole():
    sources = ["big"] * 6 + ["small"] * 2 + ["big"] + ["tiny"]
    indices, factors = upsample_sources(sources, minimum=5)
    assert factors == {"small": 3, "tiny": 5}
    assert indices[:len(sources)] == list(range(len(sources)))       # every example once, in order
    counts = {i: indices.count(i) for i in range(len(sources))}
    assert [counts[i] for i in range(len(sources))] == [1] * 6 + [3, 3] + [1] + [5]
    assert upsample_sources(sources, minimum=0) == (list(range(len(sources))), {})
    assert upsample_sources(sources, minimum=2) == (list(range(len(sources))) + [9], {"tiny": 2})
    with pytest.raises(ValueError, match="minimum"):
        upsample_sources(sources, minimum=-1)


def _examples(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(4, 30, (1,), generator=g))
        ids = torch.randint(1000, 2000, (L,), generator=g).tolist()
        out.append((ids, [j >= L // 2 for j in range(L)]))
    return out


def _example_batches(examples, batch_size=8, seed=3):
    sampler = BucketBatchSampler([len(x) for x, _ in examples], batch_size=batch_size, bucket_width=5, seed=seed)
    return ExampleBatches(sampler, lambda ix: pad_collate([examples[i][0] for i in ix], pad_id=0,
                                                          loss_masks=[examples[i][1] for i in ix]))


@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_replay_appends_its_share_of_text_rows_and_keeps_the_examples(fraction):
    """Each batch keeps the example batch unchanged in its first rows and adds text windows as
    long as it, `fraction` of all rows (up to rounding), scored on every token."""
    examples = _examples()
    plain, mixed = _example_batches(examples), ReplayBatches(_example_batches(examples), TOKENS, fraction=fraction,
                                                             seed=5)
    rows = texts = 0
    for _ in range(20):
        a, b = plain.next_batch(), mixed.next_batch()
        B, T = a["idx"].shape
        assert b["idx"].shape[1] == T and b["idx"].shape[0] == B + replay_rows(B, fraction)
        for k in a:
            assert torch.equal(b[k][:B], a[k]), k
        text = b["idx"][B:]
        assert torch.equal((text[:, 1:] - text[:, :-1]) % 997, torch.ones_like(text[:, 1:]))  # contiguous windows
        assert torch.equal(b["targets"][B:], (text + 1) % 997) and bool(b["attention_mask"][B:].all())
        rows, texts = rows + b["idx"].shape[0], texts + len(text)
    assert texts / rows == pytest.approx(fraction, abs=0.05)
    assert replay_rows(16, 0.2) == 4 and replay_rows(16, 0.5) == 16 and replay_rows(16, 0.0) == 0


def test_replay_resumes_from_the_inner_cursor():
    examples = _examples()
    a = ReplayBatches(_example_batches(examples), TOKENS, fraction=0.3, seed=5)
    for _ in range(3):
        a.next_batch()
    b = ReplayBatches(_example_batches(examples), TOKENS, fraction=0.3, seed=5)
    b.load_state_dict(a.state_dict())
    x, y = a.next_batch(), b.next_batch()
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_fixed_conversation_batches_are_a_seeded_sample_sorted_by_length():
    g = torch.Generator().manual_seed(1)
    examples = [(list(range(n)), [True] * n) for n in torch.randint(2, 30, (40,), generator=g).tolist()]
    batches = fixed_conversation_batches(examples, pad_id=0, batch_size=4, n_batches=3, seed=7)
    assert len(batches) == 3 and all(b["idx"].shape[0] == 4 for b in batches)
    lengths = [int(n) for b in batches for n in b["attention_mask"].sum(1)]
    assert lengths == sorted(lengths)                          # sorted within the sample: less padding
    assert [b["idx"].tolist() for b in batches] == [
        b["idx"].tolist() for b in fixed_conversation_batches(examples, pad_id=0, batch_size=4, n_batches=3, seed=7)]
    other = fixed_conversation_batches(examples, pad_id=0, batch_size=4, n_batches=3, seed=8)
    assert lengths != [int(n) for b in other for n in b["attention_mask"].sum(1)]  # a sample, not the shortest
    everything = fixed_conversation_batches(examples, pad_id=0, batch_size=4, n_batches=100, seed=7)
    assert sum(b["idx"].shape[0] for b in everything) == len(examples)            # at most every example once
