"""Byte-level BPE tokenizer for English and Chinese.

Text -> UTF-8 bytes -> token ids. Ids 0..255 are the raw bytes, so every string is
encodable and nothing is ever "unknown". Ids 256.. are merges, learned in order: merge
k joins two existing tokens into id 256 + k. The special tokens (CONTROL_TOKENS) take
the last ids of the vocabulary, so `vocab_size = 256 + len(merges) + len(specials)`.

    tok = Tokenizer.train(texts, vocab_size=4096, max_pairs=100_000, min_frequency=2)
    ids = tok.encode("Hello 世界 12", allowed_special="none")
    assert tok.decode(ids) == "Hello 世界 12"
    tok.save("models/tokenizer")          # tokenizer.txt + tokenizer_meta.json
    tok.save_hf("models/tokenizer/tokenizer.json")   # loads in HF `tokenizers`

How text is cut before BPE ("pre-split"): the GPT-4 regex (contractions, words with
one leading space or punctuation mark, punctuation runs, whitespace runs), except that
digits are split one by one (`\\p{N}` instead of `\\p{N}{1,3}`), so "1234" is always
four tokens and arithmetic stays learnable. Merges never cross a pre-split boundary.

Chinese: at *training* time every pre-split chunk that holds Han characters is further
segmented with jieba, so merges are learned inside jieba words and frequent words
("苹果", "多少") become tokens instead of arbitrary character pairs across word
boundaries. At *encode* time only the regex pre-split is used. This is deliberate:
  - the exported `tokenizer.json` then encodes exactly like `encode` on all text,
    Chinese included (Hugging Face `tokenizers` has no jieba step), and
  - encoding does not pay for jieba (~1 MB/s) on every call.
The price: inside a long run of Han characters, BPE may apply a learned merge across a
jieba word boundary (only merges that were learned inside some jieba word exist, so this
is rare). tests/test_tokenizer.py and bench/tokenizer.py measure the effect.

Training (`Tokenizer.train`) is the classic incremental algorithm (as in HF tokenizers):
  1. count the unique pre-split chunks once (a dict chunk -> frequency); each unique
     chunk becomes a "word": a list of token ids with a frequency;
  2. count every adjacent pair over the words, weighted by frequency, and index which
     words contain each pair (pair -> set of word indices);
  3. repeatedly take the most frequent pair from a max-heap, merge it inside only the
     words that contain it, and apply the pair-count changes of those words.
The heap uses lazy deletion: pair counts only ever go *down* after a pair is created
(a merge removes occurrences of old pairs and creates pairs with the new token only),
so a heap entry is an upper bound; a popped entry whose count is stale is pushed back
with its current count.

Speed, without changing a single merge (tests pin the merges by hash): step 1 runs in worker
processes once the corpus is big enough, CPUs are free and, for jieba, the work measured on its
first chunks pays for starting them (counts added in text order); jieba's
segmentation, where Chinese training spends most of its time, is reproduced word for word in
one pass (`_jieba_cut`, half of jieba.lcut's time); text that is all ASCII is pre-split by
Python's `re` with an ASCII twin of the pattern (2-3x faster than `regex`, same chunks), in
training and in encode. bench/README.md has the figures against HF tokenizers, rustbpe and
tiktoken.

Tie-break (deterministic, independent of corpus order and hash seeds): the highest
count wins; among equal counts, the pair (a, b) with the smallest a, then smallest b.
Two kinds of merges are skipped (counted in train_stats): one whose bytes already
exist as a token (e.g. (" th", "e") after (" t", "he")), so every token has distinct
bytes, which keeps the HF export exact and means merge k always creates id 256 + k;
and one that would join a piece of a UTF-8 character to its neighbour (only possible
in non-ASCII text), so every token is whole characters or a piece of one character,
which lets encode start from whole characters (3x faster on Chinese, same result).

`max_pairs` caps the pair table: when more pairs are tracked, the lowest-count ones
are dropped (they would be merged last, if ever). Training stays exact unless a later
chosen merge has a count <= the largest dropped count; `train_stats["exact"]` says
which. `min_frequency`: pairs seen fewer times are never merged; if the corpus runs out
of such pairs first, training stops early with a warning in `train_stats["warning"]`
and the vocabulary is smaller than asked (the specials still take the last ids).
`required_tokens` (e.g. "####") are added as the first merges, built character by
character, so each encodes to a single id; a required token that the pre-split cuts in
pieces (e.g. "<think>" or "42") cannot be one BPE token and is rejected.

Special tokens: `encode(text)` never produces a special id unless asked:
allowed_special="none" (default) encodes "<|end|>" in user text as ordinary bytes;
"all" or a set of names matches those strings first. The exported tokenizer.json
matches special tokens by default, like allowed_special="all"; an HF tokenizer with
`encode_special_tokens = True` behaves like "none" (both tested).

Files: `tokenizer.txt` (version header, pattern, specials, one merge per line with the
merged token shown in a comment) and `tokenizer_meta.json` (sizes, corpus hash,
compression, training statistics). `llm/` never imports `tokenizers`; only tests and
bench/ use it, as a reference client. Loading trusts nothing in them: the pattern must be
one of KNOWN_PATTERNS (a regular expression from a file could take exponential time on
every text), the special tokens must be CONTROL_TOKENS, counts and ids are bounded
(MAX_VOCAB) and so are the file sizes, and each problem names the file and line.
"""
from __future__ import annotations

import functools
import hashlib
import heapq
import json
import math
import os
import re
import time
from collections import ChainMap, Counter, defaultdict, deque
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import regex

CONTROL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# GPT-4's pattern (tiktoken cl100k_base) with \p{N}{1,3} -> \p{N}: one digit per chunk.
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}"""
                 r"""| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")

# The pre-split patterns this project writes, by name. A loaded tokenizer.txt must hold one of
# them: the pattern is compiled and run over every text, and an arbitrary regular expression
# can take exponential time (`(a|aa)+$` on 36 a's: 17 s), while these are linear (every
# alternative is a plain class run with possessive or no backtracking). _pre_split_windows
# also relies on SPLIT_PATTERN's structure.
KNOWN_PATTERNS = {SPLIT_PATTERN: "GPT-4's split, one digit per chunk"}
MAX_VOCAB = 1 << 20  # ids a tokenizer file may define (llm.config.MAX_VOCAB: the params bound)
# All tokens' bytes together: 32 a token at MAX_VOCAB, where BPE tokens are a few bytes each. It
# bounds what a loaded file costs: 40 merge lines, each joining the last token with itself,
# would otherwise ask for 2**41 bytes.
MAX_VOCAB_BYTES = 32 << 20
# Loading reads each line's first LINE_HEAD_BYTES, enough for every field (the pattern's JSON, a
# special token, a merge's two ids); only a merge's comment, the merged token shown for a reader
# (ignored by the parser), is longer, and its rest is read past, never held.
LINE_HEAD_BYTES = 4096
# The largest tokenizer.txt dumps() writes within those bounds: the lines before the merges, then
# a merge line per id ("a b\t# id = " and the token shown: at most 6 characters a byte, as \u0001)
MAX_FILE_BYTES = 16 * LINE_HEAD_BYTES + MAX_VOCAB * len('1048575 1048575\t# 1048575 = ""\n') + 6 * MAX_VOCAB_BYTES
MAX_META_BYTES = 1 << 20  # tokenizer_meta.json: sizes and training statistics, a few KB

# The same pattern for text that is all ASCII, for Python's `re` (2-3x faster than `regex` here):
# in ASCII, \p{L} is [A-Za-z], \p{N} is [0-9], and \s is [ \t\n\v\f\r] in both engines (re.ASCII;
# \x1c-\x1f are not White_Space). tests/test_tokenizer.py checks findall agrees on any ASCII text.
_ASCII_TWINS = {SPLIT_PATTERN: re.compile(r"""'(?i:[sdmt]|ll|ve|re)|[^\r\nA-Za-z0-9]?+[A-Za-z]+|[0-9]"""
                                          r"""| ?[^\sA-Za-z0-9]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""", re.ASCII)}

FORMAT_HEADER = "llm-bpe v1"
FORMAT_VERSION = 1
REPLACEMENT = "\ufffd".encode("utf-8")  # what decode emits for an unknown id
_HAN = regex.compile(r"\p{Han}")
# Safe places to cut a huge text before pre-splitting (see _pre_split_windows).
_CUT = regex.compile(r"(?<=\n)(?=\p{L})|(?<=\S)(?= \p{L})")
_LONG_CHUNK = 256  # chunks longer than this (in bytes) use the O(n log n) merge loop
_NO_MERGE = 1 << 62  # rank of a pair that is not a merge


# ---------------------------------------------------------------------------
# BPE on one chunk. `ranks` maps a pair of ids to the id it merges into; since merge k
# creates id 256 + k, a smaller new id is an earlier (higher-priority) merge.

def _bpe(ranks: dict[tuple[int, int], int], ids: list[int]) -> list[int]:
    """Apply merges to one chunk: repeatedly merge the adjacent pair that was learned
    first (leftmost if it occurs twice) until no adjacent pair is a merge.

    `rk[i]` is the rank of the pair (ids[i], ids[i+1]); each step finds the minimum with
    C-speed min()/index() and re-ranks only the two pairs next to the merge (the same
    loop as tiktoken's byte_pair_merge). Merging all occurrences of the best pair at
    once (minbpe) gives the same result, because a merge only creates pairs with
    later ranks; tests check both against each other and against HF."""
    n = len(ids)
    if n > _LONG_CHUNK:
        return _bpe_heap(ranks, ids)
    get = ranks.get
    rk = [get(p, _NO_MERGE) for p in zip(ids, ids[1:])]
    while n > 1:
        r = min(rk)
        if r == _NO_MERGE:
            break
        i = rk.index(r)
        ids[i] = r
        del ids[i + 1], rk[i]
        n -= 1
        if i > 0:
            rk[i - 1] = get((ids[i - 1], r), _NO_MERGE)
        if i < n - 1:
            rk[i] = get((r, ids[i + 1]), _NO_MERGE)
    return ids


def _bpe_heap(ranks: dict[tuple[int, int], int], ids: list[int]) -> list[int]:
    """Same result as _bpe, in O(n log n) for long chunks (a long run of Chinese or
    of one symbol would make _bpe's min() over all pairs quadratic). A linked list over
    positions and a heap of (rank, position): the same order as "earliest merge first,
    leftmost first" because a merge only ever creates pairs with *later* ranks."""
    n = len(ids)
    ids = list(ids)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    heap = [(r, i) for i, p in enumerate(zip(ids, ids[1:])) if (r := ranks.get(p)) is not None]
    heapq.heapify(heap)
    while heap:
        r, i = heapq.heappop(heap)
        j = nxt[i]
        if ids[i] is None or j >= n or ranks.get((ids[i], ids[j])) != r:
            continue  # stale: this position was merged away or its pair changed
        ids[i], ids[j] = r, None
        k = nxt[i] = nxt[j]
        if k < n:
            prv[k] = i
        p = prv[i]
        if p >= 0 and (q := ranks.get((ids[p], r))) is not None:
            heapq.heappush(heap, (q, p))
        if k < n and (q := ranks.get((r, ids[k]))) is not None:
            heapq.heappush(heap, (q, i))
    return [t for t in ids if t is not None]


# ---------------------------------------------------------------------------
# Pre-split helpers used by training.

def _pre_split_windows(pat: regex.Pattern, text: str, window: int = 1 << 20) -> Iterator[list[str]]:
    """pat.findall(text) in pieces of about `window` characters, so a 100 MB document
    never materialises all its chunks at once. Cuts only where findall(text) has a
    chunk boundary that nothing before it can see past: before a letter that follows a
    newline, or before " letter" that follows a non-space. (Every alternative of the
    pattern stops at a newline or a space, and its only lookahead, "not followed by a
    non-space", comes after whitespace. Tests check windows == findall.)"""
    twin = _ASCII_TWINS.get(pat.pattern)
    for start, end in _window_spans(text, window):
        yield _findall(pat, twin, text, start, end)


def _window_spans(text: str, window: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the pieces of _pre_split_windows."""
    start, n = 0, len(text)
    while n - start > window:
        m = _CUT.search(text, start + window)
        if m is None:
            break
        yield start, m.start()
        start = m.start()
    yield start, n


def text_windows(text: str, window: int) -> Iterator[str]:
    """`text` in pieces of about `window` characters, cut where the pre-split has a chunk
    boundary (see _pre_split_windows): encoding the pieces one by one gives encode(text), special
    tokens allowed or not, as long as no special token's text holds a letter after a newline or a
    space (the <|...|> names here hold none). For counting a long text in short steps."""
    for start, end in _window_spans(text, window):
        yield text[start:end]


def _findall(pat: regex.Pattern, twin: re.Pattern | None, text: str, start: int = 0,
             end: int | None = None) -> list[str]:
    """pat.findall(text[start:end]), by pat's ASCII twin (see _ASCII_TWINS) when that part is ASCII."""
    end = len(text) if end is None else end
    if twin is not None and (text.isascii() if start == 0 and end == len(text) else text[start:end].isascii()):
        return twin.findall(text, start, end)
    return pat.findall(text, start, end)


def _jieba_words(chunk: str) -> list[str]:
    """Segment a chunk holding Han characters with jieba. A leading space or punctuation
    mark stays attached to the first word, as the regex attaches it to a word."""
    import jieba  # lazy: ~1 s to load its dictionary, and only Chinese text needs it
    if jieba.dt.initialized is False:
        import logging
        jieba.setLogLevel(logging.WARNING)  # silence "Building prefix dict ..."
    head = ""
    if not chunk[0].isalpha():  # the optional [^\r\n\p{L}\p{N}] prefix of the regex
        head, chunk = chunk[0], chunk[1:]
    words = _jieba_cut(chunk) if jieba.__version__ == JIEBA_VERSION else jieba.lcut(chunk, HMM=True)
    if "".join(words) != chunk:  # jieba keeps every character; if not, don't trust it
        words = [chunk]
    if head:
        words[0] = head + words[0]
    return words


JIEBA_VERSION = "0.42.1"  # the jieba whose jieba.lcut(text, HMM=True) _jieba_cut reproduces


def _jieba_cut(text: str) -> list[str]:
    """jieba.lcut(text, HMM=True) of jieba 0.42.1, word for word, in half its time.

    jieba cuts each run of Han/ASCII-word characters by the most probable path through the
    words of its dictionary (get_DAG, then calc from the right), and hands runs of single
    characters that are not a word to its HMM (finalseg.cut). It builds the word graph in one
    pass and scores it in a second, slicing and looking up every candidate twice, in a
    generator per position; here one right-to-left pass does both with the same arithmetic in
    the same order (so the same floats, the same ties: the longer word wins), and the HMM
    results are cached. Training spends most of its time on Chinese here. Only used with that
    jieba version; tests compare it with jieba.lcut on the Chinese of the test corpus and on
    random text."""
    import jieba

    dt = jieba.dt
    dt.check_initialized()
    han, skip = jieba.re_han_default, jieba.re_skip_default
    out: list[str] = []
    for block in han.split(text):
        if not block:
            continue
        if han.match(block):
            out += _jieba_cut_block(block, dt.FREQ, math.log(dt.total))
        else:  # not Han or ASCII letters/digits: whitespace runs whole, every other character alone
            for piece in skip.split(block):
                if skip.match(piece):
                    out.append(piece)
                else:
                    out.extend(piece)
    return out


def _jieba_cut_block(s: str, freq: dict[str, int], logtotal: float) -> list[str]:
    """jieba's Tokenizer.__cut_DAG(s) (get_DAG + calc + the HMM on unknown runs), see _jieba_cut."""
    n, get, log = len(s), freq.get, math.log
    score, end = [0.0] * (n + 1), [0] * (n + 1)  # best path from each position: log-prob, last index of its word
    for k in range(n - 1, -1, -1):
        best = None
        i, f = k, get(s[k])
        while f is not None:  # s[k:i+1] is a dictionary word (f > 0) or a prefix of one (f == 0)
            if f:
                sc = log(f) - logtotal + score[i + 1]
                if best is None or sc >= best:  # jieba's max over (score, i): a tie goes to the longer word
                    best, end[k] = sc, i
            i += 1
            if i >= n:
                break
            f = get(s[k:i + 1])
        if best is None:  # no word starts here: the character alone
            best, end[k] = log(get(s[k]) or 1) - logtotal + score[k + 1], k
        score[k] = best
    out: list[str] = []
    buf = ""  # a run of single characters: whole if it is a word, else cut by the HMM

    def flush() -> None:
        if len(buf) == 1:
            out.append(buf)
        elif buf:
            out.extend(buf if get(buf) else _jieba_hmm(buf))

    x = 0
    while x < n:
        y = end[x] + 1
        if y - x == 1:
            buf += s[x]
        else:
            flush()
            buf = ""
            out.append(s[x:y])
        x = y
    flush()
    return out


@functools.lru_cache(maxsize=1 << 16)
def _jieba_hmm(run: str) -> tuple[str, ...]:
    """jieba's HMM cut of a run of characters that are not dictionary words."""
    from jieba import finalseg
    return tuple(finalseg.cut(run))


def has_han(text: str) -> bool:
    """Whether `text` holds a Han (Chinese) character: what triggers jieba in training."""
    return _HAN.search(text) is not None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, used by HF's ByteLevel pre-tokenizer:
    printable bytes map to themselves, the rest to U+0100 onwards (space -> 'Ġ')."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def is_clean_token(b: bytes) -> bool:
    """Whole UTF-8 characters, or a piece of a single character. Training only creates
    such tokens (a merge that would join part of a character to its neighbour is
    skipped), which is what lets encode start from whole characters (see _encode_chunk)."""
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        pass
    leads = [i for i, x in enumerate(b) if x & 0xC0 != 0x80]
    if not leads:
        return len(b) <= 3  # continuation bytes only: the tail of one character
    if leads != [0]:
        return False
    need = 2 if b[0] >> 5 == 0b110 else 3 if b[0] >> 4 == 0b1110 else 4 if b[0] >> 3 == 0b11110 else 1
    return len(b) < need  # the head of one character


def _show(b: bytes) -> str:
    """A token's bytes for humans: JSON string, invalid UTF-8 bytes as \\xNN."""
    return json.dumps(b.decode("utf-8", errors="backslashreplace"), ensure_ascii=False)


def _file_lines(f, path: Path) -> Iterator[str]:
    """The lines of an open tokenizer.txt without their endings, each cut at LINE_HEAD_BYTES:
    the rest of a longer line (a merge's comment) is read past in blocks and never held."""
    lineno = 0
    while raw := f.readline(LINE_HEAD_BYTES):
        lineno += 1
        cut = not raw.endswith(b"\n")
        if cut:
            while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                pass
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if not (cut and e.start >= len(raw) - 3):  # not just a character cut in two at LINE_HEAD_BYTES
                raise ValueError(f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line; the file was"
                                 f" edited or corrupted, re-train with `python -m stages.tokenizer`") from None
            text = raw[:e.start].decode("utf-8")
        yield text.rstrip("\r\n")


# ---------------------------------------------------------------------------

class Tokenizer:
    """A trained byte-level BPE: merges + special tokens + the pre-split pattern."""

    cache_size = 1 << 18  # chunk -> ids cache entries before the cache is cleared
    # Longer chunks are encoded but not kept, so the cache's bytes are bounded as well as its
    # entries: a run of a million spaces is one chunk, and a server that cached what clients
    # send would grow by each one. Ordinary words and numbers are far shorter than this.
    cache_max_chars = 64
    parallel_min_chars = 1 << 20  # encode_batch(workers > 1) only spawns processes above this

    def __init__(self, merges: Sequence[tuple[int, int]], specials: Sequence[str] = CONTROL_TOKENS,
                 pattern: str = SPLIT_PATTERN):
        if pattern not in KNOWN_PATTERNS:
            raise ValueError(f"pre-split pattern {pattern[:80]!r}{'...' if len(pattern) > 80 else ''} is not one this"
                             f" project writes (llm.data.tokenizer.KNOWN_PATTERNS); an arbitrary pattern can take"
                             f" exponential time on every text, so it is not compiled")
        self.pattern = pattern
        self._pat = regex.compile(pattern)
        self._ascii_twin = _ASCII_TWINS.get(pattern)
        self.merges: list[tuple[int, int]] = [(int(a), int(b)) for a, b in merges]
        vocab = [bytes([i]) for i in range(256)]
        seen = set(vocab)
        self._ranks: dict[tuple[int, int], int] = {}
        total = 256
        for k, (a, b) in enumerate(self.merges):
            new = 256 + k
            if not (0 <= a < new and 0 <= b < new):
                raise ValueError(f"merge {k}: ({a}, {b}) refers to an id that does not exist yet (< {new})")
            if (a, b) in self._ranks:
                raise ValueError(f"merge {k}: ({a}, {b}) is listed twice")
            total += len(vocab[a]) + len(vocab[b])
            if total > MAX_VOCAB_BYTES:
                raise ValueError(f"merge {k}: ({a}, {b}) makes a token of {len(vocab[a]) + len(vocab[b])} bytes, and"
                                 f" the tokens so far hold more than {MAX_VOCAB_BYTES} bytes together"
                                 f" (MAX_VOCAB_BYTES); a trained tokenizer's tokens are a few bytes each")
            tok = vocab[a] + vocab[b]
            if tok in seen:
                raise ValueError(f"merge {k}: ({a}, {b}) makes {_show(tok)}, which is already a token")
            seen.add(tok)
            vocab.append(tok)
            self._ranks[(a, b)] = new
        if len(set(specials)) != len(specials):
            raise ValueError(f"special tokens must be distinct, got {list(specials)}")
        self.n_base = len(vocab)  # bytes + merges; specials follow
        self.special: dict[str, int] = {s: self.n_base + i for i, s in enumerate(specials)}
        self.vocab_size = self.n_base + len(specials)
        self._id_bytes: list[bytes] = vocab + [s.encode("utf-8") for s in specials]
        self._cache: dict[str, list[int]] = {}
        self._char_cache: dict[str, list[int]] = {}
        # True for every tokenizer we train; a hand-made merge list may break the rule.
        self._by_char = all(is_clean_token(t) for t in vocab[256:])
        self._special_pats: dict[frozenset[str], regex.Pattern] = {}
        self.train_stats: dict = {}
        self.meta: dict = {}

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, specials={len(self.special)})"

    @property
    def eot_id(self) -> int:
        return self.special["<|endoftext|>"]

    @property
    def pad_id(self) -> int:
        return self.special["<|pad|>"]

    @property
    def end_id(self) -> int:
        return self.special["<|end|>"]

    def token_bytes(self, i: int) -> bytes:
        return self._id_bytes[i]

    # -- encode / decode ----------------------------------------------------

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode ignoring special tokens entirely (their text becomes ordinary bytes)."""
        chunks = _findall(self._pat, self._ascii_twin, text)
        cache = self._cache
        new = set(chunks).difference(cache)
        long = {c: self._encode_new(c) for c in new if len(c) > self.cache_max_chars}
        new.difference_update(long)
        if new:
            if len(cache) + len(new) > self.cache_size:  # full: start over (this text's chunks all go in)
                cache.clear()
                new = set(chunks).difference(long)
            for chunk in new:
                cache[chunk] = self._encode_new(chunk)
        lookup = ChainMap(long, cache) if long else cache
        return list(chain.from_iterable(map(lookup.__getitem__, chunks)))  # no Python-level loop per chunk

    def _encode_new(self, chunk: str) -> list[int]:
        try:
            return self._encode_chunk(chunk)
        except UnicodeEncodeError:
            raise ValueError(f"text is not valid Unicode: {chunk!r} holds a lone surrogate"
                             f" (U+D800..U+DFFF); decode your input with errors='strict'") from None

    def _encode_chunk(self, chunk: str) -> list[int]:
        """BPE of one pre-split chunk. Non-ASCII text starts from each character's own
        encoding (cached) instead of raw bytes: ~3x fewer merge steps for Chinese. This
        is exact when every token is whole characters or a piece of one character
        (is_clean_token): a piece never merges with a neighbour, and a merge of whole
        characters always ranks after the merges that completed those characters."""
        if chunk.isascii() or not self._by_char:
            return _bpe(self._ranks, list(chunk.encode("utf-8")))
        cc, ids = self._char_cache, []
        for ch in chunk:
            t = cc.get(ch)
            if t is None:
                if len(cc) >= self.cache_size:
                    cc.clear()
                t = cc[ch] = _bpe(self._ranks, list(ch.encode("utf-8")))
            ids += t
        return _bpe(self._ranks, ids)

    def _allowed(self, allowed_special: str | Iterable[str]) -> frozenset[str]:
        if allowed_special == "none":
            return frozenset()
        if allowed_special == "all":
            return frozenset(self.special)
        if isinstance(allowed_special, str):
            raise ValueError(f"allowed_special must be 'none', 'all' or a set of special tokens,"
                             f" got the string {allowed_special!r} (wrap one token in a set: {{{allowed_special!r}}})")
        allowed = frozenset(allowed_special)
        unknown = allowed - self.special.keys()
        if unknown:
            raise ValueError(f"allowed_special: {sorted(unknown)} are not special tokens; known: {list(self.special)}")
        return allowed

    def encode(self, text: str, allowed_special: str | Iterable[str] = "none") -> list[int]:
        """Text -> ids. Special-token strings become special ids only if allowed
        ("none" | "all" | a set of names); otherwise they are encoded as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        allowed = self._allowed(allowed_special)
        if not allowed:
            return self.encode_ordinary(text)
        pat = self._special_pats.get(allowed)
        if pat is None:  # longest first, so one special that prefixes another still works
            alts = "|".join(regex.escape(s) for s in sorted(allowed, key=lambda s: (-len(s), s)))
            pat = self._special_pats[allowed] = regex.compile(f"({alts})")
        out: list[int] = []
        for i, part in enumerate(pat.split(text)):
            if i % 2:  # split() with one group alternates text, special, text, ...
                out.append(self.special[part])
            elif part:
                out.extend(self.encode_ordinary(part))
        return out

    def encode_batch(self, texts: list[str], allowed_special: str | Iterable[str] = "none",
                     workers: int = 1) -> list[list[int]]:
        """encode() over a list. workers > 1 may encode in that many (spawned) processes: when
        the batch holds >= parallel_min_chars characters, the first texts are encoded here for
        PROBE_SECONDS, and the rest goes to processes only if, at the speed just measured, they
        would finish it sooner than this process (`_processes_pay`). The ids are the same."""
        total = sum(len(t) for t in texts)
        if workers < 2 or total < self.parallel_min_chars:
            return [self.encode(t, allowed_special) for t in texts]
        out, done, t0 = [], 0, time.perf_counter()
        while len(out) < len(texts) and time.perf_counter() - t0 < PROBE_SECONDS:
            out.append(self.encode(texts[len(out)], allowed_special))
            done += len(texts[len(out) - 1])
        rest = texts[len(out):]
        left = (time.perf_counter() - t0) / max(done, 1) * (total - done)  # seconds, at this process's speed
        if rest and _processes_pay(left, workers, PROCESS_START_SECONDS):
            return out + _parallel_encode(self, rest, allowed_special, workers)
        return out + [self.encode(t, allowed_special) for t in rest]

    def decode(self, ids: Sequence[int]) -> str:
        """ids -> text. Ids outside the vocabulary decode to U+FFFD; byte sequences that
        are not valid UTF-8 (a token cut mid-character) also become U+FFFD."""
        vocab, n = self._id_bytes, len(self._id_bytes)
        return b"".join([vocab[i] if 0 <= i < n else REPLACEMENT for i in ids]).decode("utf-8", errors="replace")

    # -- training -------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, max_pairs: int = 100_000, min_frequency: int = 2,
              required_tokens: Sequence[str] = (), progress: bool = False, jieba: bool = True,
              specials: Sequence[str] = CONTROL_TOKENS, pattern: str = SPLIT_PATTERN,
              workers: int = 0) -> "Tokenizer":
        """Learn merges from `texts` until the vocabulary (bytes + merges + specials) has
        `vocab_size` ids. See the module docstring for the algorithm and its guarantees.
        workers: processes for the counting pass on a big corpus (0 = the usable CPUs that other
        processes leave free, see llm/threads.py; 1 = this process only); the merges do not
        depend on it.
        The result carries `train_stats` (corpus hash and size, timing, early stop, ...)."""
        t_start = time.perf_counter()
        pat = regex.compile(pattern)
        required = list(dict.fromkeys(required_tokens))
        for r in required:
            pieces = pat.findall(r)
            if not r or r in specials or pieces != [r]:
                raise ValueError(f"required token {r!r} cannot be a single BPE token: the pre-split cuts it"
                                 f" into {pieces}; only text that stays one chunk (e.g. '####', 'Hamlet') can be")
        n_merges = vocab_size - 256 - len(specials)
        if n_merges < 0:
            raise ValueError(f"vocab_size={vocab_size} is below 256 byte tokens + {len(specials)} specials")

        # 1. Count unique chunks (one pass, streaming); Han chunks -> jieba words. Both parts run
        # in `workers` processes once the corpus is big enough to pay for starting them.
        if progress:
            from tqdm import tqdm
            texts = tqdm(texts, desc="pre-split", unit="text", mininterval=1.0)
        h = hashlib.sha256()
        sizes = [0, 0, 0]  # texts, characters, bytes
        with _Workers(workers) as procs:
            chunk_counts = _count_chunks(_text_batches(texts, h, sizes), pattern, procs)
            if not chunk_counts:
                raise ValueError(f"empty corpus: {sizes[0]} texts, 0 characters; nothing to train on")
            n_chunks = len(chunk_counts)
            han = [c for c in chunk_counts if has_han(c)] if jieba else []
            for chunk, words in zip(han, _segment(han, procs)):  # in place: a second table would double peak memory
                f = chunk_counts.pop(chunk)
                for w in words:
                    chunk_counts[w] += f
        n_texts, n_chars, n_bytes = sizes
        n_words, n_jieba = len(chunk_counts), len(han)
        t_count = time.perf_counter() - t_start

        # 2./3. Merge. From here on only token-id lists are kept, not the strings.
        words = [list(w.encode("utf-8")) for w in chunk_counts]
        freqs = list(chunk_counts.values())
        del chunk_counts, han
        learner = _MergeLearner(words, freqs, max_pairs)
        for r in required:
            learner.force(r.encode("utf-8"))
        if len(learner.merges) > n_merges:
            raise ValueError(f"vocab_size={vocab_size} leaves {n_merges} merges, but the required tokens"
                             f" {required} need {len(learner.merges)}")
        forced = len(learner.merges)
        warning = learner.learn(n_merges, min_frequency, progress)

        tok = cls(learner.merges, specials, pattern)
        for r in required:  # internal invariant, guaranteed by construction
            assert len(tok.encode(r)) == 1, f"required token {r!r} did not become one id"
        n_tokens = sum(f * len(w) for w, f in zip(learner.words, freqs))
        if warning:
            warning += f"; vocab_size is {tok.vocab_size} instead of {vocab_size}"
        tok.train_stats = {
            "corpus_sha256": h.hexdigest(), "corpus_texts": n_texts, "corpus_chars": n_chars,
            "corpus_bytes": n_bytes, "unique_chunks": n_chunks, "jieba_chunks": n_jieba,
            "unique_words": n_words, "requested_vocab_size": vocab_size, "vocab_size": tok.vocab_size,
            "n_merges": len(tok.merges), "forced_merges": forced, "required_tokens": required,
            "min_frequency": min_frequency, "max_pairs": max_pairs,
            "last_merge_count": learner.last_count, "skipped_duplicate_merges": learner.skipped,
            "skipped_partial_char_merges": learner.skipped_partial,
            "pairs_pruned": learner.pruned, "max_tracked_pairs": learner.max_tracked, "exact": learner.exact,
            "early_stop": warning is not None, "warning": warning, "jieba": jieba,
            # bytes per token over the training corpus as the trainer segmented it
            "compression": round(n_bytes / max(n_tokens, 1), 4),
            "count_seconds": round(t_count, 3), "seconds": round(time.perf_counter() - t_start, 3),
        }
        return tok

    # -- save / load ------------------------------------------------------------

    def dumps(self) -> str:
        """The tokenizer.txt content: everything encode/decode depend on, in text."""
        lines = [FORMAT_HEADER, f"pattern\t{json.dumps(self.pattern, ensure_ascii=False)}",
                 f"specials\t{len(self.special)}"]
        lines += [f"{i}\t{s}" for s, i in self.special.items()]
        lines.append(f"merges\t{len(self.merges)}")
        vocab = self._id_bytes
        lines += [f"{a} {b}\t# {256 + k} = {_show(vocab[256 + k])}" for k, (a, b) in enumerate(self.merges)]
        return "\n".join(lines) + "\n"

    def sha256(self) -> str:
        """Hash of the saved content (pattern + specials + merges): identifies the tokenizer."""
        return hashlib.sha256(self.dumps().encode("utf-8")).hexdigest()

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.txt and tokenizer_meta.json into `directory` (created if needed).
        Each file is written atomically; a stage wraps the directory in fileio.atomic_dir."""
        from llm.fileio import atomic_write_json, atomic_write_text
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "tokenizer.txt", self.dumps())
        stats = {k: v for k, v in self.train_stats.items() if not k.endswith("seconds")}  # deterministic file
        atomic_write_json(d / "tokenizer_meta.json", {
            "format": "llm-bpe", "format_version": FORMAT_VERSION, "sha256": self.sha256(),
            "vocab_size": self.vocab_size, "n_merges": len(self.merges), "special_tokens": self.special,
            "corpus_sha256": stats.get("corpus_sha256"), "compression": stats.get("compression"),
            "train": stats,
        })

    @classmethod
    def loads(cls, text: str, where: str = "<string>") -> "Tokenizer":
        """Parse tokenizer.txt content; errors name `where` and the line."""
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return cls._parse(iter(lines), where)

    @classmethod
    def _parse(cls, lines: Iterator[str], where: str) -> "Tokenizer":
        """The tokenizer the lines describe. Lines are taken one at a time, and no more than the
        header says there are (MAX_VOCAB merges at most) before an error or the end."""
        first = next(lines, None)
        if first != FORMAT_HEADER:
            got = first[:60] if first is not None else "an empty file"
            raise ValueError(f"{where}:1: not a tokenizer file of this version: expected the header"
                             f" {FORMAT_HEADER!r}, got {got!r}; re-train with `python -m stages.tokenizer`"
                             f" or use the code version that wrote it")

        def field(lineno: int, name: str) -> str:
            line = next(lines, None)
            if line is None or not line.startswith(name + "\t"):
                raise ValueError(f"{where}:{lineno + 1}: expected '{name}<TAB>...'")
            return line.split("\t", 1)[1]

        def count(lineno: int, name: str, most: int) -> int:
            text = field(lineno, name)
            if not text.isascii() or not text.isdigit() or int(text) > most:
                raise ValueError(f"{where}:{lineno + 1}: expected '{name}<TAB><count>' with a count in"
                                 f" [0, {most}], got {text[:40]!r}")
            return int(text)

        try:
            try:
                pattern = json.loads(field(1, "pattern"))
            except RecursionError:  # e.g. [[[[...]]]] 100,000 deep: json recurses per level
                pattern = []
            if not isinstance(pattern, str) or pattern not in KNOWN_PATTERNS:  # a list or dict is unhashable
                kind = {list: "array", dict: "object", type(None): "null", bool: "boolean"}.get(type(pattern), "number")
                shown = repr(pattern)[:80] if isinstance(pattern, str) else f"(a JSON {kind})"
                raise ValueError(f"{where}:2: pre-split pattern {shown} is not one this project writes"
                                 f" (llm.data.tokenizer.KNOWN_PATTERNS): an arbitrary regular expression can take"
                                 f" exponential time on every text. Re-train with `python -m stages.tokenizer`")
            n_special = count(2, "specials", len(CONTROL_TOKENS))
            listed = []  # (id as written, token)
            for k in range(n_special):
                line = next(lines, None)
                if line is None or "\t" not in line:
                    raise ValueError(f"{where}:{4 + k}: expected '<id><TAB><special token>'")
                listed.append(tuple(line.split("\t", 1)))
            specials = [s for _, s in listed]
            if specials != CONTROL_TOKENS:
                raise ValueError(f"{where}:3: special tokens {specials[:8]} are not this project's {CONTROL_TOKENS}"
                                 f" (chat formatting and generation depend on them); re-train the tokenizer")
            at = 3 + n_special
            n_merges = count(at, "merges", MAX_VOCAB - 256 - n_special)
            merges = []
            for k in range(n_merges):
                ln = at + 1 + k
                line = next(lines, None)
                parts = line.split("\t", 1)[0].split() if line is not None else []
                if len(parts) != 2 or not all(x.isascii() and x.isdigit() and len(x) <= 8 for x in parts):
                    raise ValueError(f"{where}:{ln + 1}: expected a merge '<id> <id>', got"
                                     f" {line[:60] if line is not None else 'end of file'!r}")
                merges.append((int(parts[0]), int(parts[1])))
            if next(lines, None) is not None:
                raise ValueError(f"{where}:{at + 2 + n_merges}: unexpected content after {n_merges} merges")
            tok = cls(merges, specials, pattern)
        except (ValueError, json.JSONDecodeError) as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        for i, s in listed:  # the listed ids are informative; they must agree
            if i != str(tok.special[s]):
                raise ValueError(f"{where}: special token {s!r} is listed with id {i}, but with"
                                 f" {len(merges)} merges it must be {tok.special[s]} (specials take the last ids)")
        return tok

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        """Read `directory`/tokenizer.txt (and tokenizer_meta.json when present, checked).

        Bounded whatever the files hold: a tokenizer.txt over MAX_FILE_BYTES is refused before it
        is read, and one under it costs at most MAX_VOCAB parsed lines, MAX_VOCAB_BYTES of tokens
        and one pass over its bytes (_file_lines)."""
        from llm.fileio import DataError, open_regular, read_text
        d = Path(directory)
        path = d / "tokenizer.txt"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no tokenizer here; run `python -m stages.tokenizer` first")
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise DataError(f"{path}: {size} bytes, more than a tokenizer file of at most {MAX_VOCAB} ids"
                                f" holds ({MAX_FILE_BYTES}); wrong file? Re-train with `python -m stages.tokenizer`")
            tok = cls._parse(_file_lines(f, path), str(path))
        meta_path = d / "tokenizer_meta.json"
        if meta_path.exists():
            try:
                meta = json.loads(read_text(meta_path, max_bytes=MAX_META_BYTES))
            except (ValueError, RecursionError) as e:  # JSONDecodeError, DataError, ints too long to convert
                msg = str(e) if str(e).startswith(str(meta_path)) else f"{meta_path}: not valid JSON ({e})"
                raise ValueError(msg) from None
            if not isinstance(meta, dict) or meta.get("sha256") != tok.sha256() \
                    or meta.get("vocab_size") != tok.vocab_size:
                raise ValueError(f"{meta_path}: describes a different tokenizer (sha256/vocab_size do not match"
                                 f" {path}); the directory is inconsistent, re-run the tokenizer stage")
            tok.meta = meta
            train = meta.get("train", {})
            tok.train_stats = dict(train) if isinstance(train, dict) else {}
        return tok

    # -- Hugging Face export ------------------------------------------------------

    def to_hf_json(self) -> dict:
        """This tokenizer as a Hugging Face `tokenizers` tokenizer.json (a dict).

        Split(our regex, isolated) + ByteLevel(use_regex=False) reproduce our pre-split
        on the byte-to-unicode alphabet; the BPE model gets our merges in rank order.
        HF matches added (special) tokens by default, i.e. allowed_special="all";
        setting `encode_special_tokens = True` on the loaded HF tokenizer gives "none".
        Exact for every character whose Unicode category both regex engines agree on:
        HF's Oniguruma has older Unicode tables than the `regex` module, so characters
        assigned in the newest Unicode versions may pre-split differently."""
        b2u = bytes_to_unicode()

        def s(b: bytes) -> str:
            return "".join(b2u[x] for x in b)

        vocab = {s(self._id_bytes[i]): i for i in range(self.n_base)}
        merges = [f"{s(self._id_bytes[a])} {s(self._id_bytes[b])}" for a, b in self.merges]
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for t, i in self.special.items()]
        return {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": self.pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": merges},
        }

    def save_hf(self, path: str | Path) -> None:
        from llm.fileio import atomic_write_text
        atomic_write_text(path, json.dumps(self.to_hf_json(), ensure_ascii=False, indent=1) + "\n")


# ---------------------------------------------------------------------------
# The merge learner: words, pair counts, pair -> words index, lazy max-heap.

class _MergeLearner:
    def __init__(self, words: list[list[int]], freqs: list[int], max_pairs: int):
        self.words, self.freqs, self.max_pairs = words, freqs, max_pairs
        self.merges: list[tuple[int, int]] = []
        self.vocab = [bytes([i]) for i in range(256)]
        self.seen = set(self.vocab)
        self.counts: dict[tuple[int, int], int] = {}
        self.where: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
        counts, where = self.counts, self.where
        for i, (w, f) in enumerate(zip(words, freqs)):
            for p in zip(w, w[1:]):
                counts[p] = counts.get(p, 0) + f
                where[p].add(i)
        # (-count, pair): the smallest entry is the highest count, then the smallest pair.
        self.heap = [(-c, p) for p, c in counts.items()]
        heapq.heapify(self.heap)
        self.skipped = self.skipped_partial = self.pruned = 0
        self.pruned_max = 0  # largest count among dropped pairs
        self.exact = True
        self.last_count = None
        self.max_tracked = len(counts)
        if len(counts) > max_pairs:
            self._prune()

    def _merge(self, pair: tuple[int, int]) -> None:
        """Record merge `pair` -> new id and rewrite the words that contain it."""
        a, b = pair
        new = len(self.vocab)
        self.vocab.append(self.vocab[a] + self.vocab[b])
        self.seen.add(self.vocab[-1])
        self.merges.append(pair)
        words, freqs, where = self.words, self.freqs, self.where
        delta: dict[tuple[int, int], int] = {}
        get = delta.get
        for i in where.pop(pair, ()):
            w = words[i]
            last = len(w) - 1  # a pair starts before the last token
            j = 0
            while j < last:  # in place, left to right; the left neighbour may be a `new` just made
                try:
                    j = w.index(a, j, last)
                except ValueError:
                    break
                if w[j + 1] == b:
                    f = freqs[i]
                    if j:
                        left = w[j - 1]
                        p = left, a
                        delta[p] = get(p, 0) - f
                        p = left, new
                        delta[p] = get(p, 0) + f
                        where[p].add(i)
                    if j + 1 < last:
                        right = w[j + 2]
                        p = b, right
                        delta[p] = get(p, 0) - f
                        p = new, right
                        delta[p] = get(p, 0) + f
                        where[p].add(i)
                    w[j:j + 2] = (new,)
                    last -= 1
                j += 1
        counts, heap = self.counts, self.heap
        counts.pop(pair, None)
        for p, d in delta.items():
            if p == pair:
                continue
            c = counts.get(p)
            if c is None:  # a new pair (with `new`), or an old one that was pruned
                if d > 0:
                    counts[p] = d
                    heapq.heappush(heap, (-d, p))
                else:
                    where.pop(p, None)
            elif c + d > 0:
                counts[p] = c + d  # old pairs only go down: their heap entry stays an upper bound
            else:
                del counts[p]
                where.pop(p, None)
        if len(counts) > self.max_tracked:
            self.max_tracked = len(counts)
        if len(counts) > self.max_pairs:
            self._prune()

    def _prune(self) -> None:
        """Drop the lowest-count pairs down to 3/4 of max_pairs; rebuild the heap."""
        keep = self.max_pairs * 3 // 4
        ranked = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        for p, c in ranked[keep:]:
            del self.counts[p]
            self.where.pop(p, None)
            self.pruned_max = max(self.pruned_max, c)
        self.pruned += len(ranked) - keep
        self.heap = [(-c, p) for p, c in ranked[:keep]]
        heapq.heapify(self.heap)

    def force(self, token: bytes) -> None:
        """Add merges so that `token` encodes to one id: first complete each UTF-8
        character left to right, then join the most frequent adjacent pair (leftmost on
        ties), re-encoding with the merges so far after each step."""
        while True:
            ranks = {p: 256 + k for k, p in enumerate(self.merges)}
            ids = _bpe(ranks, list(token))
            if len(ids) == 1:
                return
            spans, pos = [], 0
            for t in ids:
                spans.append((pos, pos + len(self.vocab[t])))
                pos += len(self.vocab[t])
            starts = {i for i in range(len(token)) if token[i] & 0xC0 != 0x80}  # char starts
            inside = [k for k in range(len(ids) - 1) if spans[k + 1][0] not in starts]
            if inside:
                k = inside[0]
            else:
                pairs = Counter(zip(ids, ids[1:]))
                k = max(range(len(ids) - 1), key=lambda k: (pairs[ids[k], ids[k + 1]], -k))
            pair = (ids[k], ids[k + 1])
            if self.vocab[pair[0]] + self.vocab[pair[1]] in self.seen:
                raise ValueError(f"required token {_show(token)}: cannot build it from the other"
                                 f" required tokens' merges without a duplicate token; drop one of them")
            self._merge(pair)

    def learn(self, n_merges: int, min_frequency: int, progress: bool) -> str | None:
        """Merge the best pair until there are n_merges merges. Returns a warning if the
        corpus ran out of pairs with count >= min_frequency first, else None."""
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=n_merges, initial=len(self.merges), desc="bpe merges", unit="merge")
        counts, heap, vocab, seen = self.counts, self.heap, self.vocab, self.seen
        warning = None
        while len(self.merges) < n_merges:
            heap = self.heap  # _prune may have replaced it
            if not heap:
                warning = (f"corpus too small: no pairs left after {len(self.merges)} of {n_merges} merges")
                break
            neg, pair = heapq.heappop(heap)
            c = counts.get(pair)
            if c is None:
                continue  # merged, pruned or skipped
            if c != -neg:
                heapq.heappush(heap, (-c, pair))  # stale upper bound: re-queue with the true count
                continue
            if c < min_frequency:
                warning = (f"corpus too small: stopped after {len(self.merges)} of {n_merges} merges, the most"
                           f" frequent remaining pair occurs {c} < min_frequency={min_frequency} times")
                break
            merged = vocab[pair[0]] + vocab[pair[1]]
            if merged in seen or not is_clean_token(merged):
                del counts[pair]  # a duplicate token, or part of a character + its neighbour
                self.where.pop(pair, None)
                if merged in seen:
                    self.skipped += 1
                else:
                    self.skipped_partial += 1
                continue
            if self.pruned and c <= self.pruned_max and self.pruned_max >= min_frequency:
                self.exact = False  # a dropped pair might have had a count this high
            self.last_count = c
            self._merge(pair)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return warning


# ---------------------------------------------------------------------------
# The counting pass of training: texts -> {chunk: count}, then Han chunks -> jieba words; in
# worker processes once there is enough text to pay for starting them (PROCESS_START_SECONDS
# each, and jieba loads its dictionary in each: as long as the segmentation of a 2 MB Chinese
# corpus, so jieba's work is measured before processes are started). Counts are added up in
# text order, so the table and the merges are the same with any number of workers (tests check
# this).

_BATCH_CHARS = 1 << 20  # texts go to the counting pass in batches of about this many characters
PARALLEL_MIN_BATCHES = 4  # the counting pass starts processes at the 4th batch (~4M characters)
PARALLEL_MIN_HAN = 1 << 17  # jieba runs in processes when the Han chunks hold this many characters
PROBE_SECONDS = 0.2  # work done here first to measure its speed, before deciding on processes
# a spawned worker's start (Python, then llm.data.tokenizer and its imports), measured in bench/README.md;
# a jieba worker also loads the dictionary, timed in this process instead
PROCESS_START_SECONDS = 0.5


class _Workers:
    """`n` spawned processes, started on first use, if ever. n = 0: as many as llm/threads.py's
    load rule gives (choose_num_threads: the usable CPUs that other processes leave free),
    decided when first asked: on a machine that is already full, more processes only add
    start-up and a second copy of jieba's dictionary to load."""

    def __init__(self, n: int):
        self._n, self._pool = n, None

    @property
    def n(self) -> int:
        if self._n == 0:
            from llm.threads import busy_cpus, choose_num_threads, usable_cpus
            self._n = choose_num_threads(usable_cpus(), busy_cpus())
        return self._n

    @property
    def started(self) -> bool:
        return self._pool is not None

    def pool(self):
        if self._pool is None:
            import multiprocessing as mp
            self._pool = mp.get_context("spawn").Pool(self.n)
        return self._pool

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._pool is not None:
            if exc_type is None:
                self._pool.close()
            else:
                self._pool.terminate()
            self._pool.join()


def _text_batches(texts: Iterable[str], h, sizes: list[int]) -> Iterator[list[str]]:
    """Check and hash each text (sha256 `h`), count them into `sizes` = [texts, characters,
    bytes], and yield them in lists of about _BATCH_CHARS characters."""
    batch, n = [], 0
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"train: text {i} is {type(text).__name__}, expected str")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"train: text {i} is not valid Unicode: lone surrogate"
                             f" {text[e.start]!r} at character {e.start}") from None
        h.update(len(data).to_bytes(8, "little") + data)
        sizes[0], sizes[1], sizes[2] = sizes[0] + 1, sizes[1] + len(text), sizes[2] + len(data)
        batch.append(text)
        n += len(text)
        if n >= _BATCH_CHARS:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def _count_batch(pattern: str, texts: list[str], counts: Counter[str] | None = None) -> Counter[str]:
    """{pre-split chunk: count} over `texts`, added to `counts` if given (in a worker or here)."""
    pat, counts = regex.compile(pattern), Counter() if counts is None else counts
    for text in texts:
        for chunks in _pre_split_windows(pat, text):
            counts.update(chunks)
    return counts


def _count_chunks(batches: Iterator[list[str]], pattern: str, workers: _Workers) -> Counter[str]:
    """Sum _count_batch over the batches, in order. The first batches are held back until there
    are PARALLEL_MIN_BATCHES of them: a smaller corpus is counted here, without processes."""
    counts: Counter[str] = Counter()
    held: list[list[str]] = []
    ahead: deque = deque()  # batches sent to the workers, oldest first; at most 2 per worker
    for batch in batches:
        held.append(batch)
        if (not workers.started and len(held) < PARALLEL_MIN_BATCHES) or workers.n < 2:
            continue
        for b in held:
            ahead.append(workers.pool().apply_async(_count_batch, (pattern, b)))
            while len(ahead) > 2 * workers.n:
                counts.update(ahead.popleft().get())
        held = []
    while ahead:
        counts.update(ahead.popleft().get())
    for b in held:
        _count_batch(pattern, b, counts)
    return counts


def _jieba_batch(chunks: list[str]) -> list[list[str]]:
    return [_jieba_words(c) for c in chunks]


def _segment(han: list[str], workers: _Workers) -> Iterator[list[str]]:
    """The jieba words of each chunk in `han`, in order. On a big enough list, this process first
    loads jieba's dictionary and segments chunks for PROBE_SECONDS, timing both: each worker
    would load the dictionary again, so processes take the rest only if, at the speed just
    measured, they would finish it sooner than this process (`_processes_pay`)."""
    if sum(map(len, han)) < PARALLEL_MIN_HAN or workers.n < 2:
        yield from map(_jieba_words, han)
        return
    t0 = time.perf_counter()
    _jieba_words("中文")  # loads the dictionary
    t1 = time.perf_counter()
    i = done = 0
    while i < len(han) and time.perf_counter() - t1 < PROBE_SECONDS:
        yield _jieba_words(han[i])
        done += len(han[i])
        i += 1
    rest = han[i:]
    left = (time.perf_counter() - t1) / max(done, 1) * sum(map(len, rest))  # seconds, at this process's speed
    if not rest or not _processes_pay(left, workers.n, PROCESS_START_SECONDS + (t1 - t0)):
        yield from map(_jieba_words, rest)
        return
    step = max(1, len(rest) // (8 * workers.n))
    for words in workers.pool().imap(_jieba_batch, [rest[i:i + step] for i in range(0, len(rest), step)]):
        yield from words


def _processes_pay(seconds_left: float, n: int, start_seconds: float) -> bool:
    """Whether `n` processes, each first spending `start_seconds` to start, finish work that takes
    this process `seconds_left` sooner than this process alone, by a margin of 2x the start: the
    work's speed is measured on its first part only, and other processes may hold the CPUs."""
    return n >= 2 and seconds_left * (1 - 1 / n) > 2 * start_seconds


# ---------------------------------------------------------------------------
# Parallel encode: each worker rebuilds the tokenizer from its text form (tokenizer.txt).

_WORKER_TOK: Tokenizer | None = None


def _worker_init(dump: str) -> None:
    global _WORKER_TOK
    _WORKER_TOK = Tokenizer.loads(dump, "<worker>")


def _worker_encode(args: tuple[list[str], object]) -> list[list[int]]:
    texts, allowed = args
    assert _WORKER_TOK is not None
    return [_WORKER_TOK.encode(t, allowed) for t in texts]


def _parallel_encode(tok: Tokenizer, texts: list[str], allowed_special, workers: int) -> list[list[int]]:
    import multiprocessing as mp
    step = max(1, len(texts) // (workers * 8))
    parts = [(texts[i:i + step], allowed_special if isinstance(allowed_special, str) else sorted(allowed_special))
             for i in range(0, len(texts), step)]
    with mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(tok.dumps(),)) as pool:
        return [ids for part in pool.map(_worker_encode, parts) for ids in part]
