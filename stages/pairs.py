"""Stage `pairs`: DPO's preference pairs, made from the SFT model's samples (the `samples` stage).

    dvc repro pairs        (dvc.yaml passes the paths: `python -m stages.pairs --help`)

Reads the `common` and `pairs` sections of params.yaml, the samples directory (every prompt, its
train/val split and SFT's answers with the verifier's scores), the reward model and the SFT
model (for the reward model's tokenizer check). Prompts with a check keep the verifier's pairs
exactly as the samples stage chose them; the reward model scores the answers to prompts without
one (a user's own SFT data) and those prompts are paired by its scores: the only labels it
gives, on data it never trained on. Adversarial format-broken pairs (`pairs.adversarial_fraction`
of the output) come from math prompts with a right answer, tied prompts first. Each pair keeps
its prompt's split, so DPO's held-out pairs are the reward model's held-out prompts.
The procedure is llm/post/pairs.py's.

Writes the pairs directory ({train,val}.jsonl: records {"id", "prompt", "chosen",
"rejected", "kind", "source", "scorer", "reward_chosen", "reward_rejected", "preference_score",
"adversarial", "rm_chosen", "rm_rejected", "sft_logp_chosen", "sft_logp_rejected",
"temperature_chosen", "temperature_rejected", "prompt_id"}: the prefs format plus provenance),
metrics/pairs.json (score distribution, ties dropped, adversarial count, source counts, mean
rewards, how often the reward model ranks held-out verifier pairs the verifier's way, timing)
and pairs.tsv in the plots directory (a histogram of preference_score).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

from llm.config import CommonConfig, PairsConfig
from llm.data.batching import derive_seed
from llm.data.preference import encode_response
from llm.data.template import render_prompt
from llm.fileio import DataError, atomic_dir, atomic_write_text, read_jsonl, sha256_tree, write_jsonl
from llm.nn.artifacts import load_model_dir
from llm.nn.reward_model import score_sequences
from llm.post import pairs as lib
from llm.runtime import Runtime, setup_runtime
from llm.stage import stage_main
from llm.train.metrics import write_metrics

STAGE = "pairs"
INPUTS = {"samples": "the samples directory (samples.jsonl)", "rm": "the reward model directory"}
OUTPUTS = {"out": "the pairs directory", "metrics": "the metrics JSON", "plots": "the dvc plots directory"}


def run(common: CommonConfig, cfg: PairsConfig, device, *, samples: Path, rm: Path, out: Path, metrics: Path,
        plots: Path, rt: Runtime | None = None) -> dict:
    """Make, write (rank 0) and return the pairs' metrics. rt: a distributed Runtime shares the
    reward model's scoring out over its ranks; the files are those of one process."""
    t_start = time.perf_counter()
    main = rt is None or rt.is_main
    seed = derive_seed(common.seed, STAGE)
    reward_model, tok, rm_meta = load_model_dir(rm, device=device, heads=("reward",))
    reward_model.eval()
    seq_len = reward_model.config.seq_len
    records = list(read_jsonl(Path(samples) / "samples.jsonl"))
    if not records:
        raise DataError(f"{samples}/samples.jsonl: no prompts; re-run `dvc repro samples`")
    prompts = [{k: v for k, v in r.items() if k != "samples"} for r in records]
    answers = [r["samples"] for r in records]
    prompt_ids = [render_prompt(p["prompt"], tok) for p in prompts]

    def rm_score(seqs: list[list[int]]) -> list[float]:
        return score_sequences(reward_model, seqs, pad_id=tok.pad_id, batch_size=cfg.batch_size,
                               device=device, rt=rt).tolist()

    # the reward model decides only where the verifier cannot: it scores every answer to the
    # prompts without a check, and the two answers of each verifier pair (its agreement with the
    # verifier on the held-out prompts is the on-policy check in the metrics)
    t0 = time.perf_counter()
    unchecked = [(i, k) for i in range(len(prompts)) if prompts[i]["check"] is None for k in range(len(answers[i]))]
    seqs = [encode_response(prompt_ids[i], answers[i][k]["text"], tok)[-seq_len:] for i, k in unchecked]
    for (i, k), r in zip(unchecked, rm_score(seqs) if seqs else []):
        answers[i][k]["rm"] = r
    for smp in answers:
        for x in smp:
            x["score"] = x.get("rm") if x["verifier"] is None else x["verifier"]
    pairs, ties, tied_prompts = lib.choose_pairs(prompts, answers, cfg.tie_epsilon, cfg.tie_break, cfg.gold_margin)
    todo = [r for r in pairs if r["rm_chosen"] is None]
    index = {p["id"]: ids for p, ids in zip(prompts, prompt_ids)}
    seqs = [encode_response(index[r["prompt_id"]], r[side], tok)[-seq_len:] for r in todo for side in ("chosen", "rejected")]
    scores = rm_score(seqs) if seqs else []
    for n, r in enumerate(todo):
        r["rm_chosen"], r["rm_rejected"] = scores[2 * n], scores[2 * n + 1]
    t_score = time.perf_counter() - t0
    wanted = lib.adversarial_wanted(cfg.adversarial_fraction, len(pairs), len(prompts))
    adversarial = lib.adversarial_pairs(prompts, prompt_ids, answers, wanted=wanted, tied_prompts=tied_prompts,
                                        rng=random.Random(derive_seed(seed, "adversarial")), rm_score=rm_score,
                                        tok=tok, seq_len=seq_len)
    pairs += adversarial
    split_of = {p["id"]: p["split"] for p in prompts}
    train = [r for r in pairs if split_of[r["prompt_id"]] == "train"]
    val = [r for r in pairs if split_of[r["prompt_id"]] == "val"]
    if not train or (cfg.val_fraction > 0 and not val):
        lib.too_few_pairs(len(pairs), STAGE, cfg.verify_tasks)
    for split, recs in (("train", train), ("val", val)):
        for j, rec in enumerate(recs):
            rec["id"] = f"pairs-{split}-{j}"

    m = {**lib.summarize(prompts, answers, pairs, adversarial, ties, cfg.temperatures),
         "train_pairs": len(train), "val_pairs": len(val), "adversarial_wanted": wanted, "score_time_s": t_score,
         "stage_time_s": time.perf_counter() - t_start,
         "inputs": {"samples": sha256_tree(samples), "reward": rm_meta.get("fingerprint", "")}}
    if not main:
        return m
    with atomic_dir(out) as tmp:
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "val.jsonl", val)
    atomic_write_text(plots / f"{STAGE}.tsv", lib.histogram(pairs))
    write_metrics(metrics, m)
    return m


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: PairsConfig, rt: Runtime) -> str | None:
        m = run(common, cfg, rt.device, **{k: getattr(args, k) for k in (*INPUTS, *OUTPUTS)}, rt=rt)
        if not rt.is_main:
            return None
        ps = m["preference_score"]
        return (f"{STAGE}: {m['pairs']} pairs ({m['train_pairs']} train / {m['val_pairs']} val, {m['adversarial']}"
                f" adversarial), {m['ties_dropped']} ties dropped; preference_score mean {ps['mean']:.3f}"
                f" [p05 {ps['p05']:.3f}, p95 {ps['p95']:.3f}]; wrote {args.out}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
