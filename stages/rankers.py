"""Stage `rankers`: which score picks the right answer among the SFT model's own math answers.

    dvc repro rankers        (dvc.yaml passes the paths: `python -m stages.rankers --help`)

Reads the `common` and `rankers` sections of params.yaml and

    --sft    the SFT model: it answers, and its likelihood is two of the rankers
    --rm     the reward model
    --dpo    the DPO model (its implicit reward, dpo.beta * (log pi_DPO - log pi_SFT), ranks as the
             difference of the two log-probabilities does: beta > 0 changes no order)
    --verifier  the generative verifier (stage verifier: SFT taught to judge its own answers)
    --tiers  word problems by difficulty tier (prepare's tiers/test.jsonl)
    --continuation  held-out passages to continue (prepare's continue/test.jsonl; may be empty)

On the first `rankers.problems` problems of tier `rankers.tier` (the edge by default: SFT right
about half the time, where a ranker can change what it answers), SFT answers greedily and samples
`rankers.samples` answers at `rankers.temperature`; the verifier says which are right. Each ranker
(llm/post/rankers.py: SFT's likelihood, its per-token mean, the reward model, DPO's implicit reward,
agreement with the other samples, the generative verifier's log p(Yes) - log p(No)) is measured two
ways against the exact checker: how often it ranks a right answer above a wrong one to the same
problem, over all such pairs and over the pairs whose wrong answer is SFT's greedy answer (only
those can change greedy accuracy); and best-of-n, the accuracy of its top pick among n = 1..samples
answers, beside pass@n and a random pick, with its paired difference (over the problems) from
greedy decoding and from the likelihood's pick.

With `rankers.continuation_passages`, the same question for the continuation preference, where
the gold judge (llm/sample/gold.py) stands in for the verifier: SFT continues each of that many
held-out passages `rankers.continuation_samples` times, and the reward model is measured as the
judge's stand-in (llm/post/continuation.py `proxy_table`): the share of the judge's comparisons
(gold scores more than pairs.gold_margin's default 0.1 apart) it orders as the judge does, its
Spearman correlation with the judge on single continuations, and best-of-n for n = 1..samples: the
judge's mean score of the continuation the reward model ranks first among n, beside the reward
model's own score of it (the proxy) and the judge's own pick (the ceiling). Best-of-n moves the
policy by at most KL = log n - (n - 1)/n nats per continuation (Stiennon et al. 2020), the x axis
the report draws it on.

Writes metrics/rankers.json (per ranker: pair accuracy and its greedy-wrong slice with 95%
intervals over problems, best-of-n at n = samples and its paired differences; and the counts; `continuation_*` for the
preference), rankers.tsv in the plots directory (best-of-n against n, a column per ranker, pass@n
and random) and rankers_continuation.tsv (n, KL bound, the judge's mean of the reward model's pick,
the reward model's mean of it, the judge's own pick).
"""
from __future__ import annotations

import time
from pathlib import Path

from llm.config import CommonConfig, RankersConfig
from llm.data.batching import derive_seed
from llm.fileio import DataError, atomic_write_text, read_jsonl
from llm.runtime import Runtime, setup_runtime
from llm.stage import stage_main
from llm.train.metrics import write_metrics

STAGE = "rankers"
INPUTS = {"sft": "the SFT model directory", "rm": "the reward model directory", "dpo": "the DPO model directory",
          "verifier": "the generative verifier's model directory (stage verifier)",
          "tiers": "word problems by difficulty tier (JSONL)",
          "continuation": "held-out passages to continue (JSONL, may be empty)"}
GOLD_MARGIN = 0.1   # the judge's comparisons: scores further apart than this (pairs.gold_margin's default)
CONTINUATION_COLUMNS = "n\tkl_bound\tsqrt_kl\trm_pick_gold\trm_pick_rm\tgold_pick_gold"
OUTPUTS = {"metrics": "the metrics JSON", "plots": "the dvc plots directory"}


def run(common: CommonConfig, cfg: RankersConfig, device, *, sft: Path, rm: Path, dpo: Path,
        tiers: Path, metrics: Path, plots: Path, continuation: Path | None = None, verifier: Path | None = None,
        rt: Runtime | None = None) -> dict:
    """Measure, write (rank 0) and return the metrics."""
    from llm.nn.artifacts import load_model_dir
    from llm.post.rankers import RANKERS, draw_candidates, ranker_table, score_all
    from llm.post.verifier import candidate_scores

    t0 = time.perf_counter()
    problems = [p for p in read_jsonl(tiers) if p.get("tier") == cfg.tier][:cfg.problems] \
        if Path(tiers).is_file() and Path(tiers).stat().st_size else []
    if not problems:
        raise DataError(f"{tiers}: no problem of tier {cfg.tier!r}; set prepare.tier_test above 0 and run"
                        f" `dvc repro prepare`, or choose another rankers.tier")
    policy, tok, _ = load_model_dir(sft, device=device, heads=("lm",))
    reward_model, rm_tok, _ = load_model_dir(rm, device=device, heads=("reward",))
    dpo_model, dpo_tok, _ = load_model_dir(dpo, device=device, heads=("lm",))
    checker, checker_tok, _ = load_model_dir(verifier, device=device, heads=("lm",)) if verifier else (None, tok, None)
    for path, other in ((rm, rm_tok), (dpo, dpo_tok), (verifier, checker_tok)):
        if other.sha256() != tok.sha256():
            raise DataError(f"{path} uses another tokenizer than {sft}; the rankers score the same tokens")
    seed = derive_seed(common.seed, STAGE)
    cands = draw_candidates(policy, tok, problems, n=cfg.samples, temperature=cfg.temperature,
                            max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, seed=seed, rt=rt)
    t_draw = time.perf_counter() - t0
    scores, greedy = score_all(cands, tok, sft=policy, rm=reward_model, dpo=dpo_model, batch_size=cfg.batch_size,
                               device=device, rt=rt)
    if checker is not None:
        scores["generative verifier"], greedy["generative verifier"] = candidate_scores(
            checker, tok, cands, batch_size=cfg.batch_size, device=device, rt=rt)
    table = ranker_table(cands, scores, greedy, confidence=cfg.confidence, seed=seed)
    n = cfg.samples
    m = {"tier": cfg.tier, "problems": len(problems), "samples": n, "greedy_accuracy": table["greedy_accuracy"],
         "sampled_accuracy": table["random"][0], "pass_at_n": table["pass_at_n"][-1],
         "greedy_wrong_problems": sum(not c["greedy_right"] for c in cands),
         "rankers": {name.replace(" ", "_").lower(): {k: v for k, v in r.items() if k != "best_of_n"}
                     | {"best_of_n": r["best_of_n"][-1]}
                     for name, r in table["rankers"].items()},
         "draw_time_s": t_draw}
    passages = [p for p in read_jsonl(continuation)][:cfg.continuation_passages] \
        if cfg.continuation_passages and continuation and Path(continuation).is_file() \
        and Path(continuation).stat().st_size else []
    curve = _continuation_ranks(policy, reward_model, tok, passages, cfg, seed, device, rt, m) if passages else None
    m["stage_time_s"] = time.perf_counter() - t0
    if rt is not None and not rt.is_main:
        return m
    # written either way (a DVC output): the header alone where no passage is ranked
    atomic_write_text(Path(plots) / f"{STAGE}_continuation.tsv", curve or CONTINUATION_COLUMNS + "\n")
    names = [r for r in RANKERS if r in table["rankers"]]
    rows = ["\t".join(["n", *(r.replace(" ", "_").lower() for r in names), "pass_at_n", "random"])]
    rows += ["\t".join([str(k + 1), *(f"{table['rankers'][r]['best_of_n'][k]:.6f}" for r in names),
                        f"{table['pass_at_n'][k]:.6f}", f"{table['random'][k]:.6f}"]) for k in range(n)]
    atomic_write_text(Path(plots) / f"{STAGE}.tsv", "\n".join(rows) + "\n")
    write_metrics(metrics, m)
    return m


def _continuation_ranks(policy, rm, tok, passages: list[dict], cfg: RankersConfig, seed: int, device, rt,
                        m: dict) -> str:
    """The reward model as the gold judge's stand-in on SFT's continuations (module docstring): adds
    the `continuation_*` metrics to m and returns the best-of-n table (TSV text)."""
    import math

    from llm.post.continuation import continuation_stats, draw_continuations, gold_of, proxy_table, reward_scores

    cands = draw_continuations(policy, tok, passages, n=cfg.continuation_samples, temperature=cfg.temperature,
                               max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                               seed=derive_seed(seed, "continuation"), rt=rt)
    gold = gold_of(cands)
    proxy = reward_scores(rm, tok, cands, batch_size=cfg.batch_size, device=device, rt=rt)
    table = proxy_table(cands, gold, proxy, margin=GOLD_MARGIN)
    # the reward model's own score of its pick: best-of-n with the proxy as the value
    proxy_pick = proxy_table(cands, proxy, proxy, margin=GOLD_MARGIN)["best_of_n_gold"]
    n = cfg.continuation_samples
    stats = continuation_stats(cands, gold)
    m.update({"continuation_passages": len(passages), "continuation_samples": n,
              "continuation_comparisons": table["comparisons"],
              "continuation_pair_accuracy": table["pair_accuracy"], "continuation_spearman": table["spearman"],
              "continuation_gold_mean": stats["gold_mean"],
              "continuation_best_of_n_gold": table["best_of_n_proxy"][-1],
              "continuation_best_of_n_rm": proxy_pick[-1],
              "continuation_gold_pick": table["best_of_n_gold"][-1]})
    rows = [CONTINUATION_COLUMNS]
    for k in range(n):
        kl = math.log(k + 1) - k / (k + 1)       # the best-of-n bound, nats per continuation
        rows.append(f"{k + 1}\t{kl:.6f}\t{math.sqrt(kl):.6f}\t{table['best_of_n_proxy'][k]:.6f}"
                    f"\t{proxy_pick[k]:.6f}\t{table['best_of_n_gold'][k]:.6f}")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: RankersConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt.device, **{k: getattr(args, k) for k in (*INPUTS, *OUTPUTS)}, rt=rt)
        if not rt.is_main:
            return None
        pct = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731  (None: no right/wrong pair to rank)
        num = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731  (None: every score the same)
        parts = [f"{name} {pct(r['pair_accuracy'])} of pairs ({pct(r['greedy_wrong_accuracy'])} against the greedy"
                 f" answer), best of {m['samples']} {pct(r['best_of_n'])}" for name, r in m["rankers"].items()]
        cont = ""
        if "continuation_spearman" in m:
            cont = (f"; continuations: the reward model orders {pct(m['continuation_pair_accuracy'])} of the judge's"
                    f" comparisons (Spearman {num(m['continuation_spearman'])}), its best of"
                    f" {m['continuation_samples']} scores {m['continuation_best_of_n_gold']:+.3f} by the judge"
                    f" (mean {m['continuation_gold_mean']:+.3f}, the judge's own pick"
                    f" {m['continuation_gold_pick']:+.3f})")
        return (f"{STAGE}: {m['tier']} tier, {m['problems']} problems: greedy {pct(m['greedy_accuracy'])},"
                f" pass@{m['samples']} {pct(m['pass_at_n'])}; " + "; ".join(parts) + cont + f"; wrote {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
