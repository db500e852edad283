"""Benchmark: our BPE (llm/data/tokenizer.py) against HF `tokenizers`, rustbpe and tiktoken, same run.

    python bench/tokenizer.py [--sizes 2] [--langs en zh] [--rounds 3] [--engines ours hf rustbpe tiktoken]
    python bench/tokenizer.py --sizes 64 --rounds 1          # the large corpora (minutes per round)
    python bench/tokenizer.py --big [--big-mb 100]            # peak memory of our training, ~100 MB

Corpora: text this repository never trains on, read from the machine, cut into documents the
way a user would feed them, the first --sizes MB of UTF-8 bytes of:
  en  English: the files under /usr/share/doc (changelogs, copyright notices, READMEs; gzip
      files decompressed; only files that are valid UTF-8), in path order, one file = one
      document.
  zh  Chinese: the translated messages (msgstr) of the zh_CN, then zh_TW, message catalogs
      under /usr/share/locale (program messages of apt, coreutils, git, glib, ...: real
      human-translated Chinese, simplified then traditional, with format strings and names
      in ASCII), one message = one document; about 3.1 MB of them on the reference machine.
      Sizes beyond what the catalogs hold are *synthetic*: sentences of words drawn from
      jieba's bundled dictionary in proportion to their frequency (a unigram model, not
      prose; it flatters jieba's segmentation, which our training runs and HF's does not).
The JSON records which source each corpus came from and how many documents it has.

Training (vocab 4096, min_frequency 2, our pre-split regex), each engine as its users run it,
documents in, with 1 thread and with every usable CPU:
  ours      Tokenizer.train(docs, 4096, workers=N) as stages/tokenizer.py runs it: the
            counting pass (pre-split + jieba on Chinese) in N processes where the corpus is big
            enough and the work measured on its first part pays for their start (start-up
            included); `ours_1` is one process
  hf        tokenizers' BpeTrainer, train_from_iterator(docs); RAYON_NUM_THREADS = 1 or N
  rustbpe   rustbpe.Tokenizer().train_from_iterator(docs, 4090, pattern=ours) (4096 minus our 6
            special tokens); RAYON_NUM_THREADS = 1 or N
Encoding, with OUR trained merges in every engine (the ids are checked equal to ours, document by
document), caches cold, the documents as one batch:
  ours      encode_batch(docs) in one process; `ours_N`: encode_batch(docs, workers=N) (spawned
            processes where the work measured on the first documents pays for their start;
            start-up included)
  hf        our exported tokenizer.json, encode_batch(docs); RAYON_NUM_THREADS = 1 or N
  tiktoken  tiktoken.Encoding(our pattern, our merges as ranks).encode_ordinary_batch(docs,
            num_threads=1 or N)
After the encoders, the pre-split alone (our regex pass over the documents, no merges, no
look-ups) is timed in our one-thread worker: how much of our encoding time no change to the BPE
code could remove.
Each engine and thread count runs in its own process (rayon fixes its thread count when a
process starts), which loads the corpus once and then times one call per request; the parent
asks them in rotated order each round (A B C, B C A, ...), one at a time. Reported per engine:
seconds (train) or MB/s (encode) min/median/max; and per reference, our speed relative to it
per round (its time / our time; > 1 = ours faster), min/median/max. `--clock cpu` times each
worker's CPU seconds instead of wall seconds and runs the one-thread workers only: on a busy
machine it leaves out the time a worker waited for a CPU.

With --big: time and peak resident memory of our training in one process on the first --big-mb
MB of the English corpus above, streamed file by file, in a child process (VmHWM), against the
same imports alone.

The last line is JSON with every figure and the machine's load (bench/common.py).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import itertools
import json
import os
import random
import re
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import loadavg, machine, rotations, show, summary  # noqa: E402
from llm.data.tokenizer import CONTROL_TOKENS, SPLIT_PATTERN, Tokenizer, _findall, has_han  # noqa: E402
from llm.threads import usable_cpus  # noqa: E402

VOCAB = 4096
DOC_ROOT = Path("/usr/share/doc")
LOCALE_ROOT = Path("/usr/share/locale")
_HAN_MSG = re.compile("[\u4e00-\u9fff]")


# ---------------------------------------------------------------------------
# Corpora

def iter_english(n_bytes: int):
    """Yield (document, its size in bytes) from /usr/share/doc until n_bytes (module docstring)."""
    size = 0
    for root, dirs, files in os.walk(DOC_ROOT):
        dirs.sort()
        for name in sorted(files):
            p = Path(root) / name
            if p.is_symlink() or not p.is_file():
                continue
            try:
                raw = gzip.open(p).read() if name.endswith(".gz") else p.read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError, EOFError):
                continue
            if "\x00" in text:
                continue
            yield text, len(raw)
            size += len(raw)
            if size >= n_bytes:
                return
    raise SystemExit(f"bench: {DOC_ROOT} holds only {size / 1e6:.1f} MB of UTF-8 text, {n_bytes / 1e6:.0f} MB"
                     f" asked; use a smaller --sizes")


def english_docs(n_bytes: int) -> tuple[list[str], str]:
    """The first n_bytes of /usr/share/doc, one file per document."""
    docs = [text for text, _ in iter_english(n_bytes)]
    return docs, f"{DOC_ROOT}: {len(docs)} files"


def catalog_messages(path: Path) -> list[str]:
    """The translations (msgstr) in a GNU .mo message catalog."""
    data = path.read_bytes()
    order = "<" if struct.unpack("<I", data[:4])[0] == 0x950412DE else ">"
    _, n, _, trans_at = struct.unpack(order + "4I", data[4:20])
    out = []
    for i in range(n):
        length, offset = struct.unpack(order + "2I", data[trans_at + 8 * i: trans_at + 8 * i + 8])
        try:
            out.extend(data[offset: offset + length].decode("utf-8").split("\x00"))  # plural forms
        except UnicodeDecodeError:
            continue
    return out


def synthetic_chinese(n_bytes: int, seed: int = 0) -> list[str]:
    """Paragraphs of sentences of jieba dictionary words drawn by frequency (not prose)."""
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
        size += len(p.encode("utf-8"))
    return paras


def chinese_docs(n_bytes: int, skip_bytes: int = 0) -> tuple[list[str], str]:
    """n_bytes of translated messages holding Han characters (after skipping skip_bytes of
    them); synthetic text where the catalogs run out (see the module docstring)."""
    docs, size, seen = [], 0, 0
    for lang in ("zh_CN", "zh_TW"):
        for path in sorted(glob.glob(str(LOCALE_ROOT / lang / "LC_MESSAGES" / "*.mo"))):
            for msg in catalog_messages(Path(path)):
                if not _HAN_MSG.search(msg):
                    continue
                b = len(msg.encode("utf-8"))
                seen += b
                if seen <= skip_bytes:
                    continue
                docs.append(msg)
                size += b
                if size >= n_bytes:
                    return docs, f"{LOCALE_ROOT} zh_CN + zh_TW message catalogs: {len(docs)} messages"
    real = len(docs)
    docs += synthetic_chinese(n_bytes - size)
    return docs, (f"{LOCALE_ROOT} zh_CN + zh_TW message catalogs: {real} messages ({size / 1e6:.2f} MB),"
                  f" then {len(docs) - real} synthetic paragraphs (jieba dictionary words by frequency)")


def corpus(lang: str, mb: float) -> tuple[list[str], str]:
    n = int(mb * 1e6)
    return english_docs(n) if lang == "en" else chinese_docs(n)


# ---------------------------------------------------------------------------
# Engines. Each runs in its own process (`--_child`), one call per request from the parent.

def hf_train(docs: list[str]):
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, show_progress=False,
                                  special_tokens=CONTROL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


def rustbpe_train(docs: list[str]):
    import rustbpe
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(docs, VOCAB - len(CONTROL_TOKENS), pattern=SPLIT_PATTERN)
    return tok


def ids_digest(batch: list[list[int]]) -> str:
    h = hashlib.sha256()
    for ids in batch:
        h.update(len(ids).to_bytes(4, "little") + b"".join(i.to_bytes(4, "little") for i in ids))
    return h.hexdigest()


def child(engine: str, threads: int, lang: str, mb: float, tok_dir: str) -> None:
    """Serve timing requests on stdin ("train" / "encode"), one JSON line per answer."""
    docs, _ = corpus(lang, mb)
    ours = Tokenizer.load(tok_dir) if tok_dir else None
    enc = None
    if engine == "hf" and ours is not None:
        from tokenizers import Tokenizer as HFTokenizer
        enc = HFTokenizer.from_str(json.dumps(ours.to_hf_json()))
    elif engine == "tiktoken" and ours is not None:
        import tiktoken
        enc = tiktoken.Encoding("ours", pat_str=ours.pattern, special_tokens=ours.special,
                                mergeable_ranks={ours.token_bytes(i): i for i in range(ours.n_base)})
    print("ready", flush=True)
    for line in sys.stdin:
        what = line.strip()
        if what == "quit":
            return
        out: dict = {}
        t0, c0 = time.perf_counter(), time.process_time()
        if what == "train":
            if engine == "ours":
                t = Tokenizer.train(docs, VOCAB, workers=threads)
                out["vocab"] = t.vocab_size
            elif engine == "hf":
                out["vocab"] = hf_train(docs).get_vocab_size()
            else:
                out["vocab"] = rustbpe_train(docs).vocab_size
        elif what == "presplit":  # ours only: the regex pass of encode, without the merges and look-ups
            for d in docs:
                _findall(ours._pat, ours._ascii_twin, d)
        else:
            if engine == "ours":
                ours._cache.clear()
                ours._char_cache.clear()
                ids = ours.encode_batch(docs, workers=threads)
            elif engine == "hf":
                enc.model._clear_cache()
                ids = [e.ids for e in enc.encode_batch(docs, add_special_tokens=False)]
            else:
                ids = enc.encode_ordinary_batch(docs, num_threads=threads)
        out["s"], out["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        if what == "encode":
            out["ids"] = ids_digest(ids)
            out["tokens"] = sum(map(len, ids))
        print(json.dumps(out), flush=True)


class Worker:
    """A child process for one (engine, threads); `ask("train")` returns its answer."""

    def __init__(self, engine: str, threads: int, lang: str, mb: float, tok_dir: str = ""):
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
        self.p = subprocess.Popen([sys.executable, __file__, "--_child", engine, str(threads), lang, str(mb),
                                   tok_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.p.stdout.readline().strip() != "ready":
            raise SystemExit(f"bench: the {engine} worker did not start")

    def ask(self, what: str) -> dict:
        self.p.stdin.write(what + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        self.p.wait()


def compare(kind: str, workers: dict[str, Worker], rounds: int, mb: float, label: str, clock: str = "wall") -> dict:
    """Ask every worker `kind` once per round, rotated; summaries and our relative speed, timed
    by `clock`: wall seconds, or the worker's CPU seconds (one-thread workers only)."""
    names = list(workers)
    key = "s" if clock == "wall" else "cpu_s"
    got: dict[str, list[dict]] = {n: [] for n in names}
    for r, order in enumerate(rotations(names, rounds)):
        for n in order:
            got[n].append(workers[n].ask(kind))
        print(f"[{label}] {kind} round {r + 1}: " + ", ".join(f"{n} {got[n][-1][key]:.2f} s" for n in names), flush=True)
    t = {n: [a[key] for a in got[n]] for n in names}
    out: dict = {}
    if kind == "train":
        out["s"] = {n: summary(v, 3) for n, v in t.items()}
        out["vocab"] = {n: got[n][0]["vocab"] for n in names}
    else:
        out["mb_per_s"] = {n: summary([mb / x for x in v], 3) for n, v in t.items()}
        ref = got["ours_1"][0]["ids"]
        out["ids_equal_ours"] = {n: got[n][0]["ids"] == ref for n in names}
        out["tokens"] = got["ours_1"][0]["tokens"]
    ours = [n for n in names if n.startswith("ours")]
    out["ours_speed_vs"] = {f"{o}_vs_{n}": summary([b / a for a, b in zip(t[o], t[n])], 3)
                            for o in ours for n in names if not n.startswith("ours")}
    # every usable CPU against one: a time ratio, > 1 = more threads were slower (target <= 1)
    out["ours_time_over_ours_1"] = {o: summary([a / b for a, b in zip(t[o], t["ours_1"])], 3)
                                    for o in ours if o != "ours_1"}
    return out


def bench_corpus(lang: str, mb: float, rounds: int, n: int, clock: str = "wall",
                 engines: tuple[str, ...] = ("ours", "hf", "rustbpe", "tiktoken")) -> dict:
    docs, source = corpus(lang, mb)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    res: dict = {"source": source, "docs": len(docs), "mb": round(nbytes / 1e6, 3)}
    label = f"{lang} {mb:g} MB"
    print(f"[{label}] {source}; {len(docs)} documents, {nbytes / 1e6:.2f} MB", flush=True)
    with tempfile.TemporaryDirectory() as d:
        Tokenizer.train(docs, VOCAB).save(d)  # the merges every encoder uses
        del docs
        counts = [1] if clock == "cpu" else [1, n]  # CPU time compares one-thread runs only
        workers = {f"{e}_{t}": Worker(e, t, lang, mb, d) for e in ("ours", "hf", "rustbpe") if e in engines
                   for t in counts}
        try:
            res["train"] = compare("train", workers, rounds, res["mb"], label, clock)
            for k in [k for k in workers if k.startswith("rustbpe")]:
                workers.pop(k).close()
            for t in counts if "tiktoken" in engines else ():
                workers[f"tiktoken_{t}"] = Worker("tiktoken", t, lang, mb, d)
            res["encode"] = compare("encode", workers, rounds, res["mb"], label, clock)
            key = "s" if clock == "wall" else "cpu_s"
            pre = [workers["ours_1"].ask("presplit")[key] for _ in range(rounds)]
            res["encode"]["ours_1_presplit_mb_per_s"] = summary([res["mb"] / x for x in pre], 3)
        finally:
            for w in workers.values():
                w.close()
    res["bytes_per_token"] = round(res["mb"] * 1e6 / res["encode"]["tokens"], 3)
    print(f"[{label}] our pre-split alone (1 thread): {show(res['encode']['ours_1_presplit_mb_per_s'], ' MB/s')}")
    for kind in ("train", "encode"):
        for k, s in res[kind]["ours_speed_vs"].items():
            print(f"[{label}] {kind}: {k}: {show(s, 'x')}")
        for k, s in res[kind]["ours_time_over_ours_1"].items():
            print(f"[{label}] {kind}: time {k} / ours_1: {show(s, 'x')}")
    return res


# ---------------------------------------------------------------------------
# Peak memory on a large corpus, measured in a child process.

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


def big_child(target_mb: int) -> None:
    t0 = time.perf_counter()
    tok = Tokenizer.train((text for text, _ in iter_english(target_mb * 1_000_000)), VOCAB, workers=1)
    st = tok.train_stats
    print(json.dumps({"big_source": f"{DOC_ROOT}: {st['corpus_texts']} files, streamed",
                      "big_mb": round(st["corpus_bytes"] / 1e6, 1), "big_vocab": tok.vocab_size,
                      "big_train_s": round(time.perf_counter() - t0, 1), "big_peak_rss_mb": round(peak_rss_mb(), 1),
                      "big_unique_chunks": st["unique_chunks"], "big_max_tracked_pairs": st["max_tracked_pairs"],
                      "big_pairs_pruned": st["pairs_pruned"], "big_exact": st["exact"]}))


def big_run(target_mb: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--_big-child", str(target_mb)], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    res = json.loads(out)
    base = subprocess.run([sys.executable, __file__, "--_baseline"], check=True, capture_output=True, text=True)
    res["big_baseline_rss_mb"] = round(float(base.stdout.strip()), 1)
    print(f"[big] {res['big_mb']} MB ({res['big_source']}) -> vocab {res['big_vocab']} in {res['big_train_s']} s"
          f" (1 process, reading included), peak RSS {res['big_peak_rss_mb']} MB (the same imports alone:"
          f" {res['big_baseline_rss_mb']} MB)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[2.0], help="corpus sizes in MB")
    ap.add_argument("--langs", nargs="+", default=["en", "zh"], choices=["en", "zh"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: each worker's CPU seconds, one-thread runs only (steadier on a busy machine)")
    ap.add_argument("--engines", nargs="+", default=["ours", "hf", "rustbpe", "tiktoken"],
                    choices=["ours", "hf", "rustbpe", "tiktoken"], help="which to run (ours always runs)")
    ap.add_argument("--big", action="store_true", help="also measure peak memory on a ~100 MB corpus (minutes)")
    ap.add_argument("--big-mb", type=int, default=100)
    ap.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--_big-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_baseline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        engine, threads, lang, mb, tok_dir = args._child
        child(engine, int(threads), lang, float(mb), tok_dir)
        return
    if args._baseline:  # the same imports as the child, no work
        print(peak_rss_mb())
        return
    if args._big_child:
        big_child(args._big_child)
        return
    import rustbpe  # noqa: F401  (fail early when a reference is missing)
    import tiktoken
    import tokenizers
    load0 = loadavg()
    n = usable_cpus()
    results: dict = {"bench": "tokenizer", "vocab_size": VOCAB, "rounds": args.rounds, "clock": args.clock,
                     "threads_all": n,
                     "versions": {"tokenizers": tokenizers.__version__, "tiktoken": tiktoken.__version__,
                                  "rustbpe": _version("rustbpe")}, "corpora": {}}
    print(f"bench: {args.rounds} rounds; 1 and {n} threads; load {load0}", flush=True)
    for mb in args.sizes:
        for lang in args.langs:
            results["corpora"][f"{lang}_{mb:g}mb"] = bench_corpus(lang, mb, args.rounds, n, args.clock,
                                                                  tuple({"ours", *args.engines}))
    if args.big:
        results.update(big_run(args.big_mb))
    results["machine"] = machine(load0)
    print(json.dumps(results))


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    main()
