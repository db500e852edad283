"""Tests for llm/data/tokenizer.py: round trips, hand-worked merges, the
tie-break, specials, save/load, the HF `tokenizers` export (as a reference client)."""
from __future__ import annotations

import hashlib
import json
import random
import unicodedata

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm.config import ConfigError, TokenizerConfig, load_sections
from llm.data.generators import math_problem
import llm.data.tokenizer as tokenizer_module
from llm.data.tokenizer import (CONTROL_TOKENS, LINE_HEAD_BYTES, MAX_FILE_BYTES, MAX_VOCAB, MAX_VOCAB_BYTES,
                                SPLIT_PATTERN, Tokenizer, _bpe, _bpe_heap, _pre_split_windows, has_han, is_clean_token,
                                text_windows)

PAT = regex.compile(SPLIT_PATTERN)
HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ENGLISH = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die—to sleep,
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to: 'tis a consummation
Devoutly to be wish'd. I'll say we're done, they've gone. 12 + 7 = 19
"""


def _corpus() -> list[str]:
    rng = random.Random(0)
    zh = [math_problem(rng, rng.randint(1, 3), "zh").question for _ in range(150)]
    en = [math_problem(rng, rng.randint(1, 3), "en").question for _ in range(150)]
    return [ENGLISH] * 20 + zh + en + ["我爱北京天安门。"] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(_corpus(), 700, max_pairs=100_000, min_frequency=2, required_tokens=["####"])


# Text strategies: arbitrary Unicode, plus explicit pools so that emoji, CJK, control
# characters and combining marks show up in most examples, not by luck.
POOLS = ["🙂👍🏽👨‍👩‍👧🇨🇳", "中文字符苹果多少北京天安门", "\x00\x01\x07\t\n\r\x0b\x0c\x1b\x7f\x85\u2028",
         "e\u0301a\u0308\u0915\u093f\u0e01\u0e34", "The quick, brown fox's 42 jumps!", " \n\n\t  ", "<|end|><|user|>"]
pieces = st.one_of(st.text(), *[st.text(alphabet=p, min_size=1, max_size=12) for p in POOLS])
mixed_text = st.lists(pieces, max_size=8).map("".join)


# -- round trips -----------------------------------------------------------------

@HYP
@given(mixed_text)
def test_decode_encode_roundtrip(tok, s):
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode(tok.encode(s, allowed_special="all")) == s


def test_roundtrip_examples(tok):
    for s in ["", " ", "\n", "a", "héllo wörld", "👨‍👩‍👧 family", "小明有14个苹果。", "e\u0301", "\x00\x7f",
              "  leading and trailing  ", "tab\tand\r\nCRLF", "#### 57", "x" * 5000, "苹" * 400]:
        assert tok.decode(tok.encode(s)) == s


# -- training ------------------------------------------------------------------------

def test_hand_worked_merges():
    # "aaabdaaabac" is one pre-split chunk (letters). Pairs: aa x4, ab x2, others x1.
    #   1. (a, a) -> 256 "aa":   aa a b d aa a b a c
    #   2. now (256, a) and (a, b) both occur twice; tie-break: smallest first id -> (a, b) = 257 "ab"
    #   3. aa ab d aa ab a c: (256, 257) occurs twice -> 258 "aaab"; then every pair is single.
    tok = Tokenizer.train(["aaabdaaabac"], 256 + 3 + len(CONTROL_TOKENS), min_frequency=2)
    assert tok.merges == [(97, 97), (97, 98), (256, 257)]
    assert [tok.token_bytes(i) for i in (256, 257, 258)] == [b"aa", b"ab", b"aaab"]
    assert tok.encode("aaabdaaabac") == [258, 100, 258, 97, 99]
    assert tok.train_stats["early_stop"] is False


def test_tie_break_is_smallest_pair_regardless_of_order():
    # Every pair occurs once: (a,b)=(97,98) < (x,y)=(120,121) < (space,x)... in id order.
    expected = [(97, 98), (120, 121)]
    for texts in (["ab", "xy"], ["xy", "ab"]):
        t = Tokenizer.train(texts, 256 + 2 + len(CONTROL_TOKENS), min_frequency=1)
        assert t.merges == expected


def test_training_is_deterministic():
    corpus = _corpus()
    a = Tokenizer.train(corpus, 600)
    b = Tokenizer.train(list(reversed(corpus)), 600)  # order of texts must not matter either
    assert a.merges == b.merges and a.sha256() == b.sha256()


def _merges_sha(tok: Tokenizer) -> str:
    return hashlib.sha256(repr(tok.merges).encode()).hexdigest()


def test_trained_merges_are_unchanged():
    # sha256 of the merge lists the trainer gave before its counting pass went parallel: a speed
    # change must not change what is learned (with pruning, inexact, and with a required token)
    assert _merges_sha(Tokenizer.train(_corpus(), 700, required_tokens=["####"])) == \
        "77cf839d6f19162c23d2059a98ee59c65e3c8dcba31822eba0604b70229ae5a6"
    pruned = Tokenizer.train(_corpus() * 3, 900, max_pairs=300)
    assert pruned.train_stats["pairs_pruned"] > 0 and not pruned.train_stats["exact"]
    assert _merges_sha(pruned) == "b8966c2cd8a9a82015fb8e40ff2c87f7ae5414a175e3876282d42ef22c860f1c"


@pytest.mark.slow
def test_counting_in_processes_learns_the_same_merges(monkeypatch):
    corpus = _corpus() * 4
    one = Tokenizer.train(corpus, 700, workers=1)
    monkeypatch.setattr(tokenizer_module, "_BATCH_CHARS", 2000)  # many batches from a small corpus
    monkeypatch.setattr(tokenizer_module, "PARALLEL_MIN_HAN", 0)
    monkeypatch.setattr(tokenizer_module, "_processes_pay", lambda *a: True)  # jieba in processes too,
    monkeypatch.setattr(tokenizer_module, "PROBE_SECONDS", 0.0)               # all but its first chunk
    started = []
    pool = tokenizer_module._Workers.pool
    monkeypatch.setattr(tokenizer_module._Workers, "pool", lambda self: started.append(1) or pool(self))
    two = Tokenizer.train(corpus, 700, workers=2)
    assert started
    assert two.train_stats["corpus_sha256"] == one.train_stats["corpus_sha256"]
    assert two.merges == one.merges
    assert two.train_stats["unique_words"] == one.train_stats["unique_words"]


def test_the_counting_pass_starts_processes_only_for_a_big_corpus(monkeypatch):
    started = []
    monkeypatch.setattr(tokenizer_module._Workers, "pool", lambda self: started.append(1) or 1 / 0)
    Tokenizer.train(_corpus(), 400, workers=2)  # far below PARALLEL_MIN_BATCHES batches and PARALLEL_MIN_HAN
    assert not started
    monkeypatch.setattr(tokenizer_module, "_BATCH_CHARS", 100)
    with pytest.raises(ZeroDivisionError):
        Tokenizer.train(_corpus(), 400, workers=2)
    assert started


def test_jieba_starts_processes_only_when_the_measured_work_pays_for_them(monkeypatch):
    import llm.threads
    monkeypatch.setattr(llm.threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(llm.threads, "busy_cpus", lambda *a: 0.0)
    monkeypatch.setattr(tokenizer_module, "PARALLEL_MIN_HAN", 0)  # past the size threshold
    monkeypatch.setattr(tokenizer_module._Workers, "pool", lambda self: 1 / 0)
    one = Tokenizer.train(_corpus(), 400, workers=1)
    two = Tokenizer.train(_corpus(), 400, workers=2)  # a fraction of a second of jieba: no processes
    assert two.merges == one.merges
    monkeypatch.setattr(tokenizer_module, "PROBE_SECONDS", 0.0)
    monkeypatch.setattr(tokenizer_module, "_processes_pay", lambda *a: True)
    with pytest.raises(ZeroDivisionError):
        Tokenizer.train(_corpus(), 400, workers=2)


@pytest.mark.parametrize("left,n,start,want", [
    (3.0, 2, 0.5, True),    # two processes save 1.5 s, above 2 x 0.5 s of start
    (1.5, 2, 0.5, False),   # save 0.75 s: not worth 1 s
    (1.5, 4, 0.5, True),    # four save 1.125 s
    (100.0, 1, 0.5, False),
])
def test_processes_pay_when_they_save_twice_their_start(left, n, start, want):
    assert tokenizer_module._processes_pay(left, n, start) is want


def test_automatic_workers_follow_the_thread_rule_and_look_at_the_load_only_when_it_matters(monkeypatch):
    import llm.threads
    looks = []
    monkeypatch.setattr(llm.threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(llm.threads, "busy_cpus", lambda *a: looks.append(1) or 1.0)  # one CPU taken
    monkeypatch.setattr(tokenizer_module._Workers, "pool", lambda self: 1 / 0)
    Tokenizer.train(_corpus(), 400)  # small: no look at the load at all
    assert not looks
    monkeypatch.setattr(tokenizer_module, "_BATCH_CHARS", 100)
    monkeypatch.setattr(tokenizer_module, "PARALLEL_MIN_HAN", 0)
    Tokenizer.train(_corpus(), 400)  # big enough, but 2 CPUs - 1 busy = 1 process: no pool
    assert looks == [1]


HAN_TEXT = st.text(alphabet="的一是不了人我在有他这中大来上个国到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可"
                          "苹果多少北京天安门小明有个元角分钟米千克龘齉亍丌兀㐀㐁豈更車ａｂ，。！？ 3.5%abc-#&_\n\t",
                 max_size=40)


@HYP
@given(HAN_TEXT)
def test_the_jieba_cut_reproduces_jieba(s):
    import jieba
    assert tokenizer_module._jieba_cut(s) == jieba.lcut(s, HMM=True)


def test_the_jieba_cut_reproduces_jieba_on_the_chinese_of_the_corpus():
    import jieba
    chunks = {c for t in _corpus() for c in PAT.findall(t) if has_han(c)}
    chunks |= {"".join(PAT.findall(t)) for t in _corpus() if has_han(t)}  # long runs: the HMM and the graph
    assert len(chunks) > 100
    for c in chunks:
        assert tokenizer_module._jieba_cut(c) == jieba.lcut(c, HMM=True), c


ASCII_TEXT = st.one_of(st.text(alphabet=st.characters(max_codepoint=127)),
                      st.text(alphabet="ab Z'sdmtlvre LLVE09\t\n\r\x0b\x0c\x1c\x1f!?.,-_  ", max_size=60))


@HYP
@given(ASCII_TEXT)
def test_the_ascii_twin_of_the_pattern_splits_ascii_text_the_same(s):
    twin = tokenizer_module._ASCII_TWINS[SPLIT_PATTERN]
    assert twin.findall(s) == PAT.findall(s)


def test_the_jieba_cut_breaks_ties_like_jieba(monkeypatch):
    # total 4: "甲乙" as one word scores log(1) - log(4), as two words 2 (log(2) - log(4)): the
    # same float. jieba keeps the longer word.
    import jieba
    jieba.dt.check_initialized()
    monkeypatch.setattr(jieba.dt, "FREQ", {"甲": 2, "乙": 2, "甲乙": 1})
    monkeypatch.setattr(jieba.dt, "total", 4)
    assert jieba.lcut("甲乙", HMM=True) == ["甲乙"] == tokenizer_module._jieba_cut("甲乙")


def _train_reference(texts: list[str], n_merges: int, min_frequency: int) -> list[tuple[int, int]]:
    """Reference trainer: recount every pair after every merge (no incremental updates),
    same rules: highest count, then smallest pair; skip duplicate or part-character tokens."""
    from collections import Counter
    words = Counter(c for t in texts for c in PAT.findall(t))
    seqs = {w: list(w.encode("utf-8")) for w in words}
    vocab = [bytes([i]) for i in range(256)]
    merges, banned = [], set()
    while len(merges) < n_merges:
        counts = Counter()
        for w, f in words.items():
            for p in zip(seqs[w], seqs[w][1:]):
                counts[p] += f
        cands = [(c, p) for p, c in counts.items() if p not in banned and c >= min_frequency]
        if not cands:
            break
        c, (a, b) = min(cands, key=lambda cp: (-cp[0], cp[1]))
        tok = vocab[a] + vocab[b]
        if tok in vocab or not is_clean_token(tok):
            banned.add((a, b))
            continue
        new = len(vocab)
        vocab.append(tok)
        merges.append((a, b))
        for w in seqs:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def test_incremental_training_equals_full_recount():
    corpus = [ENGLISH] * 3 + _corpus()[-60:]  # English, Chinese (jieba off here) and digits
    n = 160
    ours = Tokenizer.train(corpus, 256 + n + len(CONTROL_TOKENS), min_frequency=2, jieba=False)
    assert ours.merges == _train_reference(corpus, n, 2)
    assert ours.train_stats["skipped_partial_char_merges"] > 0  # the rule was exercised


def test_merges_are_distinct_clean_tokens(tok):
    toks = [tok.token_bytes(i) for i in range(tok.n_base)]
    assert len(set(toks)) == len(toks)
    assert all(is_clean_token(t) for t in toks[256:])  # learned tokens: whole chars or one char's piece
    assert tok.train_stats["exact"] and not tok.train_stats["early_stop"]


def test_clean_token_rule():
    zh = "中".encode("utf-8")  # e4 b8 ad
    assert all(is_clean_token(b) for b in (b"ab", zh, zh[:2], zh[1:], "中文".encode("utf-8")))
    assert not any(is_clean_token(b) for b in (zh + b"\xe6", zh[2:] + zh, zh + b"\x80", b"a\x80", b"\x80" * 4))


def test_jieba_shapes_chinese_merges():
    # jieba: 我 / 爱 / 北京 / 天安门. With jieba no token crosses those words; without it,
    # BPE happily makes the whole sentence one token.
    corpus = ["我爱北京天安门"] * 50
    n = 256 + len(CONTROL_TOKENS) + 40
    with_jieba = Tokenizer.train(corpus, n, min_frequency=2)
    without = Tokenizer.train(corpus, n, min_frequency=2, jieba=False)
    assert [with_jieba.decode([i]) for i in with_jieba.encode("我爱北京天安门")] == ["我", "爱", "北京", "天安门"]
    assert without.encode("我爱北京天安门") == [without.encode("我爱北京天安门")[0]]


def test_required_tokens_are_single_ids(tok):
    (hid,) = tok.encode("####")
    assert hid in tok.encode("answer\n#### 57") and tok.train_stats["forced_merges"] == 2
    with pytest.raises(ValueError, match="cannot be a single BPE token"):
        Tokenizer.train(["hello"], 300, required_tokens=["<think>"])
    with pytest.raises(ValueError, match="cannot be a single BPE token"):
        Tokenizer.train(["hello"], 300, required_tokens=["42"])  # digits are always split


def test_digits_are_single_tokens(tok):
    for d in "0123456789":
        assert len(tok.encode(d)) == 1
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    learned = [tok.token_bytes(i) for i in range(256, tok.n_base)]
    assert not any(regex.search(rb"[0-9]", t) for t in learned)


def test_max_pairs_caps_the_pair_table():
    corpus = _corpus()
    full = Tokenizer.train(corpus, 600)  # tracks at most ~480 pairs on this corpus
    capped = Tokenizer.train(corpus, 600, max_pairs=460)
    st_ = capped.train_stats
    assert st_["pairs_pruned"] > 0 and st_["vocab_size"] == 600
    assert st_["exact"] and capped.merges == full.merges  # only pairs that never won were dropped
    tiny = Tokenizer.train(corpus, 600, max_pairs=300)
    assert not tiny.train_stats["exact"]  # here a dropped pair could have won: said so
    assert tiny.vocab_size == 600 and tiny.decode(tiny.encode(ENGLISH)) == ENGLISH


# -- bad input -------------------------------------------------------------------------

def test_empty_corpus_is_an_error():
    for texts in ([], [""], ["", ""]):
        with pytest.raises(ValueError, match="empty corpus"):
            Tokenizer.train(texts, 300)


def test_too_small_corpus_stops_early_with_warning():
    t = Tokenizer.train(["abab cdcd"], 4096, min_frequency=2)
    st_ = t.train_stats
    assert st_["early_stop"] and "corpus too small" in st_["warning"] and "4096" in st_["warning"]
    assert t.vocab_size == 256 + len(t.merges) + len(CONTROL_TOKENS) < 4096
    assert t.special["<|end|>"] == t.vocab_size - 1  # specials still take the last ids


def test_vocab_size_below_bytes_plus_specials():
    with pytest.raises(ValueError, match="below 256"):
        Tokenizer.train(["hello"], 256 + len(CONTROL_TOKENS) - 1)
    cfg = TokenizerConfig(vocab_size=261, max_pairs=10, min_frequency=2, required_tokens=["####"], max_train_chars=0)
    assert cfg.check("tokenizer") and "tokenizer.vocab_size" in cfg.check("tokenizer")[0]


def test_vocab_size_config_error_from_params(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("common: {seed: 1, device: cpu, dtype: fp32, nproc: 1, num_threads: 0, cpu_kernels: true, nnodes: 1,"
                 " rdzv_endpoint: '', rdzv_id: llm, rdzv_timeout: 300}\n"
                 "tokenizer: {vocab_size: 262, max_pairs: 1000, min_frequency: 2,"
                 " required_tokens: ['####'], max_train_chars: 0}\n")
    with pytest.raises(ConfigError, match=r"tokenizer\.vocab_size.*263.*got 262"):
        load_sections(["common", "tokenizer"], p)


def test_lone_surrogate_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("ok \ud800 no")
    with pytest.raises(ValueError, match="text 1 is not valid Unicode"):
        Tokenizer.train(["fine", "bad \udfff"], 300)


# -- special tokens -------------------------------------------------------------------

def test_specials_take_the_last_ids(tok):
    assert list(tok.special) == CONTROL_TOKENS
    assert [tok.special[s] for s in CONTROL_TOKENS] == list(range(tok.vocab_size - 6, tok.vocab_size))
    assert (tok.eot_id, tok.pad_id, tok.end_id) == (tok.vocab_size - 6, tok.vocab_size - 5, tok.vocab_size - 1)


def test_specials_only_when_allowed(tok):
    s = "hi <|user|>x<|end|> <|endoftext|>"
    specials = set(tok.special.values())
    plain = tok.encode(s)
    assert not specials & set(plain) and tok.decode(plain) == s
    assert tok.encode(s, allowed_special="all").count(tok.end_id) == 1
    only_end = tok.encode(s, allowed_special={"<|end|>"})
    assert specials & set(only_end) == {tok.end_id}
    assert tok.encode("<|end|>", allowed_special="all") == [tok.end_id]
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode(s, allowed_special={"<|bogus|>"})
    with pytest.raises(ValueError, match="wrap one token in a set"):
        tok.encode(s, allowed_special="<|end|>")


def test_unknown_id_decodes_to_replacement(tok):
    assert tok.decode([tok.vocab_size, -1, 10**9]) == "\ufffd" * 3
    assert tok.decode(tok.encode("ok") + [tok.vocab_size + 5]) == "ok\ufffd"
    assert tok.decode([0xE4]) == "\ufffd"  # a lone lead byte is not valid UTF-8 either
    assert tok.decode([]) == ""


def test_encode_batch_and_cache_eviction(tok, monkeypatch):
    texts = [ENGLISH, "小明有14个苹果。", "", "<|end|>"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    par = Tokenizer.loads(tok.dumps())
    par.parallel_min_chars = 0  # normally only batches >= 1M characters start processes
    parallel = tokenizer_module._parallel_encode
    monkeypatch.setattr(tokenizer_module, "_parallel_encode", lambda *a: 1 / 0)
    # microseconds of work measured: processes would not pay for their start, none is started
    assert par.encode_batch(texts * 3, "all", workers=2) == [tok.encode(t, "all") for t in texts * 3]
    monkeypatch.setattr(tokenizer_module, "_parallel_encode", parallel)
    monkeypatch.setattr(tokenizer_module, "PROBE_SECONDS", 0.0)
    monkeypatch.setattr(tokenizer_module, "_processes_pay", lambda *a: True)
    assert par.encode_batch(texts * 3, "all", workers=2) == [tok.encode(t, "all") for t in texts * 3]
    small = Tokenizer.loads(tok.dumps())
    small.cache_size = 3  # forces the chunk and char caches to be cleared mid-text
    assert small.encode(ENGLISH + "小明有14个苹果。") == tok.encode(ENGLISH + "小明有14个苹果。")


# -- internals that must agree ---------------------------------------------------------

def _bpe_minbpe(ranks, ids):
    """Reference: minbpe's loop (merge every occurrence of the earliest merge)."""
    while len(ids) >= 2:
        pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, float("inf")))
        if pair not in ranks:
            break
        new, out, i = ranks[pair], [], 0
        while i < len(ids):
            if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
                out.append(new)
                i += 2
            else:
                out.append(ids[i])
                i += 1
        ids = out
    return ids


@HYP
@given(mixed_text)
def test_merge_loops_agree(tok, s):
    for chunk in PAT.findall(s * 3):
        b = list(chunk.encode("utf-8"))
        ref = _bpe_minbpe(tok._ranks, list(b))
        assert _bpe(tok._ranks, list(b)) == ref
        assert _bpe_heap(tok._ranks, list(b)) == ref
        assert tok._encode_chunk(chunk) == ref  # per-character start (non-ASCII)


@HYP
@given(st.lists(st.sampled_from(["a", "b", " ", "\n", "'", "s", "ll", "7", "!", ".\n", "\r\n", "\t", "中"]),
                max_size=80).map("".join), st.integers(1, 12))
def test_windowed_pre_split_equals_findall(s, window):
    assert [c for part in _pre_split_windows(PAT, s, window) for c in part] == PAT.findall(s)


@HYP
@given(st.lists(st.sampled_from(["a", "b", " ", "\n", "s", "7", "!", "中", "<|end|>", "<|endoftext|>"]),
                max_size=80).map("".join), st.integers(1, 12))
def test_text_windows_encode_to_the_whole_texts_ids(tok, s, window):
    pieces = list(text_windows(s, window))
    assert "".join(pieces) == s
    for special in ("none", "all"):
        assert [i for p in pieces for i in tok.encode(p, special)] == tok.encode(s, special)


# -- save / load -----------------------------------------------------------------------

def test_save_load_roundtrip(tok, tmp_path):
    tok.save(tmp_path / "t")
    back = Tokenizer.load(tmp_path / "t")
    assert back.merges == tok.merges and back.special == tok.special and back.pattern == tok.pattern
    assert back.sha256() == tok.sha256()
    s = ENGLISH + "小明有14个苹果。<|end|>"
    assert back.encode(s, "all") == tok.encode(s, "all")
    meta = json.loads((tmp_path / "t/tokenizer_meta.json").read_text())
    assert meta["vocab_size"] == tok.vocab_size and meta["format_version"] == 1
    assert meta["corpus_sha256"] == tok.train_stats["corpus_sha256"] and meta["compression"] > 1
    text = (tmp_path / "t/tokenizer.txt").read_text()
    assert text.startswith("llm-bpe v1\n") and '# 256 = "##"' in text  # human-readable merges


def test_wrong_version_header_names_the_file(tok, tmp_path):
    d = tmp_path / "t"
    tok.save(d)
    p = d / "tokenizer.txt"
    p.write_text(p.read_text().replace("llm-bpe v1", "llm-bpe v2", 1))
    with pytest.raises(ValueError, match=rf"{regex.escape(str(p))}:1: .*expected the header 'llm-bpe v1'"):
        Tokenizer.load(d)


def test_corrupt_merge_line_names_file_and_line(tok, tmp_path):
    d = tmp_path / "t"
    tok.save(d)
    p = d / "tokenizer.txt"
    lines = p.read_text().split("\n")
    lines[12] = "banana"
    p.write_text("\n".join(lines))
    (d / "tokenizer_meta.json").unlink()
    with pytest.raises(ValueError, match=rf"{regex.escape(str(p))}:13: expected a merge"):
        Tokenizer.load(d)


def test_meta_that_disagrees_is_an_error(tok, tmp_path):
    d = tmp_path / "t"
    tok.save(d)
    other = Tokenizer.train(["something else entirely"] * 3, 270)
    (d / "tokenizer_meta.json").write_text(json.dumps({"sha256": other.sha256(), "vocab_size": other.vocab_size}))
    with pytest.raises(ValueError, match="describes a different tokenizer"):
        Tokenizer.load(d)


def _edit_line(d, lineno: int, text: str) -> None:
    p = d / "tokenizer.txt"
    lines = p.read_text().split("\n")
    lines[lineno - 1] = text
    p.write_text("\n".join(lines))
    (d / "tokenizer_meta.json").unlink()  # what a careless edit leaves: only the file itself is checked


@pytest.mark.parametrize("pattern", [r"(a|aa)+$|\s+|.", r"(unclosed", SPLIT_PATTERN.replace(r"\p{N}", r"\p{N}{1,3}")])
def test_a_pattern_this_project_does_not_write_is_refused_before_it_is_compiled(tok, tmp_path, pattern):
    """`(a|aa)+$` takes exponential time (17 s for 36 a's); an invalid pattern was a `regex` traceback."""
    import time
    d = tmp_path / "t"
    tok.save(d)
    _edit_line(d, 2, "pattern\t" + json.dumps(pattern))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"tokenizer.txt:2: pre-split pattern .* is not one this project writes"):
        Tokenizer.load(d)
    assert time.perf_counter() - t0 < 2
    with pytest.raises(ValueError, match="is not one this project writes"):
        Tokenizer(tok.merges, pattern=pattern)


@pytest.mark.parametrize("value", ["[1, 2]", '{"a": 1}', "null", "7", "[" * 100_000 + "]" * 100_000])
def test_a_pattern_line_that_is_not_a_json_string_is_refused_with_the_line(tok, tmp_path, value):
    d = tmp_path / "t"
    tok.save(d)
    _edit_line(d, 2, "pattern\t" + value)
    with pytest.raises(ValueError, match=r"tokenizer.txt:2: pre-split pattern \(a JSON \w+\) is not one") as e:
        Tokenizer.load(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("line,text,fragment", [
    (3, "specials\t1000000000000", "tokenizer.txt:3: expected 'specials<TAB><count>' with a count in [0, 6]"),
    (4, "256\t<|bos|>", "tokenizer.txt:3: special tokens ['<|bos|>', "),
    (10, "merges\t99999999999999", "tokenizer.txt:10: expected 'merges<TAB><count>' with a count in [0, "),
    (11, "1" * 5000 + " 2", "tokenizer.txt:11: expected a merge"),
])
def test_absurd_counts_and_foreign_specials_are_refused_with_the_line(tok, tmp_path, line, text, fragment):
    d = tmp_path / "t"
    tok.save(d)
    _edit_line(d, line, text)
    with pytest.raises(ValueError, match=regex.escape(fragment)):
        Tokenizer.load(d)


def test_a_huge_or_unreadable_meta_is_a_clear_error(tok, tmp_path):
    d = tmp_path / "t"
    tok.save(d)
    (d / "tokenizer_meta.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="tokenizer_meta.json: not valid JSON"):
        Tokenizer.load(d)


def test_a_tokenizer_file_over_its_bound_is_refused_before_it_is_read(tok, tmp_path):
    import time
    d = tmp_path / "t"
    tok.save(d)
    with open(d / "tokenizer.txt", "r+b") as f:  # sparse: no disk or time spent on the bytes
        f.truncate(MAX_FILE_BYTES + 1)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"{regex.escape(str(d / 'tokenizer.txt'))}: {MAX_FILE_BYTES + 1} bytes,"
                                         rf" more than a tokenizer file of at most {MAX_VOCAB} ids holds"):
        Tokenizer.load(d)
    assert time.perf_counter() - t0 < 1


def _header(n_merges: int) -> bytes:
    return Tokenizer([]).dumps().replace("merges\t0", f"merges\t{n_merges}").encode()


def _sparse_tail(path, head: bytes) -> None:
    with open(path, "wb") as f:  # `head`, then zero bytes up to the size bound: one line of ~223 MB
        f.write(head)
        f.truncate(MAX_FILE_BYTES)


@pytest.mark.parametrize("write, error", [
    (lambda p: _sparse_tail(p, _header(0)), "tokenizer.txt:11: unexpected content after 0 merges"),
    (lambda p: p.write_bytes(_header(0) + b"\n" * (20 << 20)), "tokenizer.txt:11: unexpected content after 0 merges"),
    (lambda p: p.write_bytes(_header(3) + b"104 105\t# " + b"x" * (20 << 20) + b"\n" + b"\n" * (20 << 20)),
     "tokenizer.txt:12: expected a merge '<id> <id>', got ''"),
    # each merge joins the last token with itself: 40 lines would ask for 2**41 bytes
    (lambda p: p.write_bytes(_header(40) + b"0 0\n" + b"".join(b"%d %d\n" % (i, i) for i in range(256, 295))),
     f"merge 23: (278, 278) makes a token of 16777216 bytes, and the tokens so far hold more than {MAX_VOCAB_BYTES}"),
])
def test_a_hostile_tokenizer_file_is_refused_in_bounded_time_and_memory(tmp_path, write, error):
    """A file under MAX_FILE_BYTES costs a pass over its bytes, never memory in proportion to them:
    a long line is read past, and a file's lines are read only as far as its header says."""
    import time
    import tracemalloc
    (tmp_path / "t").mkdir()
    write(tmp_path / "t" / "tokenizer.txt")
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=regex.escape(error)):
            Tokenizer.load(tmp_path / "t")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_VOCAB_BYTES + (16 << 20) and time.perf_counter() - t0 < 10


def test_a_merge_comment_longer_than_a_line_head_is_read_past(tok, tmp_path):
    d = tmp_path / "t"
    tok.save(d)
    p = d / "tokenizer.txt"
    lines = p.read_text().split("\n")
    lines[10] += "x" * (5 * LINE_HEAD_BYTES) + "中"  # the comment is for a reader; the parser ignores it
    p.write_text("\n".join(lines))
    assert Tokenizer.load(d).merges == tok.merges


# -- Hugging Face export, with `tokenizers` as the reference client -----------------------

@pytest.fixture(scope="module")
def hf(tok):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_str(json.dumps(tok.to_hf_json()))


def test_hf_export_encodes_identically(tok, hf, tmp_path):
    s = ("In 2024, 小明有14个苹果，吃了3个。How many are left?\n#### 11\n"
         "She said: 'I'll pay $1,234.56' — naïve café 🙂 x² ½ ３４\t\r\n  end")
    assert hf.encode(s).ids == tok.encode(s)
    assert hf.decode(hf.encode(s).ids) == s
    # specials: HF matches added tokens by default (= "all"); encode_special_tokens = "none"
    chat = "<|user|>What is 2+3?<|end|><|assistant|>2 + 3 = 5\n#### 5<|end|>"
    assert hf.encode(chat).ids == tok.encode(chat, allowed_special="all")
    hf.encode_special_tokens = True
    try:
        assert hf.encode(chat).ids == tok.encode(chat)
    finally:
        hf.encode_special_tokens = False
    tok.save_hf(tmp_path / "tokenizer.json")
    import tokenizers
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(s).ids == tok.encode(s)


def _assigned(s: str) -> bool:
    # HF's Oniguruma and the `regex` module ship different Unicode versions: characters
    # assigned only in the newest versions may pre-split differently (documented in
    # Tokenizer.to_hf_json). Python's own tables (unicodedata) are the older of the two.
    return all(unicodedata.category(c) != "Cn" for c in s)


@HYP
@given(mixed_text.filter(_assigned))
def test_hf_export_property(tok, hf, s):
    assert hf.encode(s).ids == tok.encode(s, allowed_special="all")
