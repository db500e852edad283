"""Stage `samples`: the SFT model's own answers to training prompts, labelled by the verifier (and continuations of passages, by the gold judge).

    dvc repro samples        (dvc.yaml passes the paths: `python -m stages.samples --help`)

Reads the `common` section and the sampling keys of the `pairs` section of params.yaml
(n_prompts, math_fraction, temperatures, samples_per_temperature, max_new_tokens, batch_size,
verify_tasks, tie_epsilon, val_fraction), the SFT model, math questions with their
answers and the SFT conversations (the prompts of non-math sources are the task prompts).

This is the one place where the policy's samples are drawn. The reward model learns from the
comparisons made here (it never labels its own training data), and the `pairs` stage makes
DPO's pairs from the same samples, adding the reward model's labels only where no verifier can
check an answer. The procedure, seeded from (common.seed, "pairs"), is llm/post/pairs.py's: prompts
(each assigned to train or val, `pairs.val_fraction` of them to val), samples at several
temperatures, the verifier's score of each (math and bare calculations by their number,
generated instruction tasks by their reference text with `pairs.verify_tasks`; with
`pairs.continuation_prompts`, that many passages of --continuation are continued too and each
continuation scored by the gold judge, llm/sample/gold.py, whose scores closer than
`pairs.gold_margin` make no comparison), SFT's
log-probability of each answer, and per prompt with a check every comparison its scores make
(each pair of distinct answers whose scores differ by more than `pairs.tie_epsilon`: the
reward model's lessons, and its test as PPO uses it, any two of the policy's answers).
Under torchrun each rank samples a share of the batches and rank 0 writes what one process would.

Writes the samples directory: samples.jsonl (every prompt, its split and its samples with their
verifier score, and SFT's log-probability where it can make a pair), train.jsonl and val.jsonl (the verifier-labelled comparisons,
in the preference-pair format plus provenance and `sft_logp_chosen` / `sft_logp_rejected`, the
mean log-probability per answer token), and metrics/samples.json (how many pairs each source
gave, ties, what SFT's likelihood ranks right on the held-out pairs, the share of held-out
wrong answers whose first wrong step is SFT's own greedy choice (errors the model believes, which
no reward read from it can rank), sample quality per temperature).
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

from llm.config import CommonConfig, PairsConfig
from llm.data.batching import derive_seed
from llm.data.template import render_prompt
from llm.fileio import atomic_dir, write_jsonl
from llm.nn.artifacts import load_model_dir
from llm.post import pairs as lib
from llm.runtime import Runtime, setup_runtime
from llm.stage import stage_main
from llm.train.metrics import write_metrics

STAGE = "samples"
SEED_NAME = "pairs"  # the seed the pairs stage drew its samples with before this stage existed: the same draws
INPUTS = {"sft": "the SFT model directory (writes the answers)", "math": "math questions with answers (JSONL)",
          "sft_data": "SFT conversations (JSONL): the task prompts",
          "continuation": "passages to continue (JSONL, prepare's continue/train.jsonl): the gold judge's prompts"}
OUTPUTS = {"out": "the samples directory", "metrics": "the metrics JSON"}


def run(common: CommonConfig, cfg: PairsConfig, device, *, sft: Path, math: Path, sft_data: Path, out: Path,
        metrics: Path, continuation: Path | None = None, progress: bool = True, rt: Runtime | None = None) -> dict:
    """Sample, label, pair, write (rank 0) and return the metrics."""
    t_start = time.perf_counter()
    main = rt is None or rt.is_main
    seed = derive_seed(common.seed, SEED_NAME)
    policy, tok, sft_meta = load_model_dir(sft, device=device, heads=("lm",))
    policy.eval()
    seq_len = policy.config.seq_len
    prompts = lib.sample_prompts(cfg, seed, math, sft_data, continuation)
    prompt_ids = [render_prompt(p["prompt"], tok) for p in prompts]
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) < seq_len]
    too_long = len(prompts) - len(keep)
    prompts, prompt_ids = [prompts[i] for i in keep], [prompt_ids[i] for i in keep]
    lib.assign_splits(prompts, cfg.val_fraction, seed)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if progress and main else (lambda m: None)
    if main:
        print(f"{STAGE}: {len(prompts)} prompts ({sum(p['kind'] == 'math' for p in prompts)} math),"
              f" {len(cfg.temperatures)} temperatures x {cfg.samples_per_temperature} samples; {policy.summary()}"
              + (f"; {rt.world_size} processes" if rt is not None and rt.distributed else ""), flush=True)

    t0 = time.perf_counter()
    samples, gen_tokens = lib.sample_responses(policy, tok, prompt_ids, cfg, seed, device, say, rt=rt)
    t_gen = time.perf_counter() - t0
    for p, smp in zip(prompts, samples):
        for x in smp:
            x["verifier"] = lib.verify(x["text"], p)
            x["score"] = x["verifier"]
    # SFT's likelihood of the answers that can make a pair (their scores differ, or no verifier
    # scores them and the reward model will): a prompt whose answers all score the same is a tie
    pairable = [i for i, smp in enumerate(samples)
                if prompts[i]["check"] is None or len({x["verifier"] for x in smp}) > 1]
    lib.add_likelihoods([samples[i] for i in pairable], [prompt_ids[i] for i in pairable], policy, tok,
                        batch_size=cfg.batch_size, device=device, rt=rt)

    checked = [i for i, p in enumerate(prompts) if p["check"] is not None]
    pairs = lib.comparisons([prompts[i] for i in checked], [samples[i] for i in checked], cfg.tie_epsilon,
                            cfg.gold_margin)
    paired = {r["prompt_id"] for r in pairs}
    ties = len(checked) - len(paired)
    split_of = {p["id"]: p["split"] for p in prompts}
    train = [r for r in pairs if split_of[r["prompt_id"]] == "train"]
    val = [r for r in pairs if split_of[r["prompt_id"]] == "val"]
    for split, recs in (("train", train), ("val", val)):
        for j, rec in enumerate(recs):
            rec["id"] = f"samples-{split}-{j}"
    if main and (not train or not val):  # a weak model, or no verifier for these prompts
        print(f"{STAGE}: warning: {len(train)} train / {len(val)} val comparisons: the reward model will learn from"
              f" the generated pairs alone (raise pairs.n_prompts, add temperatures or samples)", flush=True)

    # the held-out errors SFT itself would make: no reward read from SFT can rank those pairs
    ids_of = {p["id"]: ids for p, ids in zip(prompts, prompt_ids)}
    believed = lib.errors_sft_would_make(policy, tok, val, ids_of) if main else {}
    m = {"prompts": len(prompts), "prompts_too_long": too_long,
         "prompts_checked": len(checked), "prompts_unchecked": len(prompts) - len(checked),
         "prompt_sources": dict(sorted(Counter(p["kind"] for p in prompts).items())),
         "responses": sum(len(s) for s in samples),
         "pairs": len(pairs), "train_pairs": len(train), "val_pairs": len(val), "prompts_paired": len(paired),
         "ties_dropped": ties,
         "pairs_by_kind": dict(sorted(Counter(r["kind"] for r in pairs).items())),
         # the baseline a reward model must beat on the same held-out pairs: the SFT model's own
         # mean log-probability per answer token, higher for the chosen answer
         "sft_likelihood_accuracy": lib.mean(r["sft_logp_chosen"] > r["sft_logp_rejected"] for r in val),
         "heldout_errors_sft_would_make": believed.get("share"),
         "heldout_pairs_with_wrong_step": believed.get("with_wrong_step"),
         "by_temperature": lib.quality_by_temperature(prompts, samples, cfg.temperatures),
         "generated_tokens": gen_tokens, "generate_time_s": t_gen,
         "generate_tokens_per_s": gen_tokens / t_gen if t_gen else None,
         "stage_time_s": time.perf_counter() - t_start,
         "inputs": {"sft": sft_meta.get("fingerprint", "")}}
    if not main:
        return m
    with atomic_dir(out) as tmp:
        write_jsonl(tmp / "samples.jsonl", [{**p, "samples": s} for p, s in zip(prompts, samples)])
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "val.jsonl", val)
    write_metrics(metrics, m)
    return m


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: PairsConfig, rt: Runtime) -> str | None:
        if not cfg.temperatures or any(t <= 0 for t in cfg.temperatures):
            raise ValueError(f"pairs.temperatures: expected a non-empty list of temperatures > 0,"
                             f" got {cfg.temperatures}")
        m = run(common, cfg, rt.device, **{k: getattr(args, k) for k in (*INPUTS, *OUTPUTS)},
                progress=not args.no_progress, rt=rt)
        if not rt.is_main:
            return None
        acc = m["sft_likelihood_accuracy"]
        ranks = f"SFT's likelihood ranks {acc:.1%} of the held-out pairs right; " if acc is not None else ""
        return (f"{STAGE}: {m['responses']} answers to {m['prompts']} prompts; {m['pairs']} verifier-labelled pairs"
                f" ({m['train_pairs']} train / {m['val_pairs']} val), {m['ties_dropped']} prompts tied; {ranks}"
                f"wrote {args.out}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, setup=setup_runtime,
                      section="pairs", torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
