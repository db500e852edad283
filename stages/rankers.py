"""Stage `rankers`: which score picks the right answer among the SFT model's own math answers.

    dvc repro rankers        (dvc.yaml passes the paths: `python -m stages.rankers --help`)

Reads the `common` and `rankers` sections of params.yaml and

    --sft    the SFT model: it answers, and its likelihood is two of the rankers
    --rm     the reward model
    --dpo    the DPO model (its implicit reward, dpo.beta * (log pi_DPO - log pi_SFT), ranks as the
             difference of the two log-probabilities does: beta > 0 changes no order)
    --tiers  word problems by difficulty tier (prepare's tiers/test.jsonl)

On the first `rankers.problems` problems of tier `rankers.tier` (the edge by default: SFT right
about half the time, where a ranker can change what it answers), SFT answers greedily and samples
`rankers.samples` answers at `rankers.temperature`; the verifier says which are right. Each ranker
(llm/post/rankers.py: SFT's likelihood, its per-token mean, the reward model, DPO's implicit reward,
agreement with the other samples) is measured two ways against the verifier: how often it ranks a
right answer above a wrong one to the same problem, over all such pairs and over the pairs whose
wrong answer is SFT's greedy answer (only those can change greedy accuracy); and best-of-n, the
accuracy of its top pick among n = 1..samples answers, beside pass@n and a random pick.

Writes metrics/rankers.json (per ranker: pair accuracy and its greedy-wrong slice with 95%
intervals over problems, best-of-n at n = samples; and the counts) and rankers.tsv in the plots
directory (best-of-n against n, a column per ranker, pass@n and random).
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
          "tiers": "word problems by difficulty tier (JSONL)"}
OUTPUTS = {"metrics": "the metrics JSON", "plots": "the dvc plots directory"}


def run(common: CommonConfig, cfg: RankersConfig, device, *, sft: Path, rm: Path, dpo: Path,
        tiers: Path, metrics: Path, plots: Path, rt: Runtime | None = None) -> dict:
    """Measure, write (rank 0) and return the metrics."""
    from llm.nn.artifacts import load_model_dir
    from llm.post.rankers import RANKERS, draw_candidates, ranker_table, score_all

    t0 = time.perf_counter()
    problems = [p for p in read_jsonl(tiers) if p.get("tier") == cfg.tier][:cfg.problems] \
        if Path(tiers).is_file() and Path(tiers).stat().st_size else []
    if not problems:
        raise DataError(f"{tiers}: no problem of tier {cfg.tier!r}; set prepare.tier_test above 0 and run"
                        f" `dvc repro prepare`, or choose another rankers.tier")
    policy, tok, _ = load_model_dir(sft, device=device, heads=("lm",))
    reward_model, rm_tok, _ = load_model_dir(rm, device=device, heads=("reward",))
    dpo_model, dpo_tok, _ = load_model_dir(dpo, device=device, heads=("lm",))
    for path, other in ((rm, rm_tok), (dpo, dpo_tok)):
        if other.sha256() != tok.sha256():
            raise DataError(f"{path} uses another tokenizer than {sft}; the rankers score the same tokens")
    seed = derive_seed(common.seed, STAGE)
    cands = draw_candidates(policy, tok, problems, n=cfg.samples, temperature=cfg.temperature,
                            max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, seed=seed, rt=rt)
    t_draw = time.perf_counter() - t0
    scores, greedy = score_all(cands, tok, sft=policy, rm=reward_model, dpo=dpo_model, batch_size=cfg.batch_size,
                               device=device, rt=rt)
    table = ranker_table(cands, scores, greedy, confidence=cfg.confidence, seed=seed)
    n = cfg.samples
    m = {"tier": cfg.tier, "problems": len(problems), "samples": n, "greedy_accuracy": table["greedy_accuracy"],
         "sampled_accuracy": table["random"][0], "pass_at_n": table["pass_at_n"][-1],
         "greedy_wrong_problems": sum(not c["greedy_right"] for c in cands),
         "rankers": {name.replace(" ", "_").lower(): {k: v for k, v in r.items() if k != "best_of_n"}
                     | {"best_of_n": r["best_of_n"][-1]}
                     for name, r in table["rankers"].items()},
         "draw_time_s": t_draw, "stage_time_s": time.perf_counter() - t0}
    if rt is not None and not rt.is_main:
        return m
    names = [r for r in RANKERS if r in table["rankers"]]
    rows = ["\t".join(["n", *(r.replace(" ", "_").lower() for r in names), "pass_at_n", "random"])]
    rows += ["\t".join([str(k + 1), *(f"{table['rankers'][r]['best_of_n'][k]:.6f}" for r in names),
                        f"{table['pass_at_n'][k]:.6f}", f"{table['random'][k]:.6f}"]) for k in range(n)]
    atomic_write_text(Path(plots) / f"{STAGE}.tsv", "\n".join(rows) + "\n")
    write_metrics(metrics, m)
    return m


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: RankersConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt.device, **{k: getattr(args, k) for k in (*INPUTS, *OUTPUTS)}, rt=rt)
        if not rt.is_main:
            return None
        pct = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731  (None: no right/wrong pair to rank)
        parts = [f"{name} {pct(r['pair_accuracy'])} of pairs ({pct(r['greedy_wrong_accuracy'])} against the greedy"
                 f" answer), best of {m['samples']} {pct(r['best_of_n'])}" for name, r in m["rankers"].items()]
        return (f"{STAGE}: {m['tier']} tier, {m['problems']} problems: greedy {pct(m['greedy_accuracy'])},"
                f" pass@{m['samples']} {pct(m['pass_at_n'])}; " + "; ".join(parts) + f"; wrote {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
