"""Stage `verifier`: the SFT model taught to judge its own math answers, a ranker for stage rankers.

    dvc repro verifier        (dvc.yaml passes the paths: `python -m stages.verifier --help`)

Reads the `common` section, the `sft` section (the loop's settings: batch, grad_accum, schedule
shape, clipping, checkpoints) and the `verifier_*` keys of the `rankers` section, and

    --sft       the SFT model, where training starts
    --samples   the samples stage's samples.jsonl: SFT's answers to training problems, several per
                problem, which the exact checker labels right or wrong
    --sft-data  the cleaned conversations SFT trained on (train.jsonl)
    --math-val  held-out math problems: does the verifier still answer them as SFT did?

After each sampled answer the conversation goes on: the user asks "Is the answer right?" and the
assistant says "Yes" or "No", as the checker said (llm/post/verifier.py); only that reply is
trained on. From each problem as many right answers as wrong ones make the verdicts (so only the
answer tells them apart, never the problem); SFT's own conversations, `rankers.verifier_sft_share`
of what the run reads, all different (as many as that takes), keep the SFT loss in the mix (the
model must still write the answers it judges); the verdicts are repeated to fill the rest.
`rankers.verifier_steps` optimizer steps at `rankers.verifier_lr`, warmup and the cosine's floor
scaled from SFT's.

Where no sampled problem has both a right and a wrong answer (a model that solves none, as the
smoke profile's), there is nothing to learn: the stage says so and writes SFT's weights untaught.

`rankers.verifier_val_fraction` of the sampled problems are held out whole. On their answers the
stage measures the verifier's score (log p(Yes) - log p(No)) against SFT's likelihood, the ranker
it has to beat: for both, the AUC of right answers over wrong ones (any two answers) and the pair
accuracy (a right and a wrong answer to the same problem: what best-of-n needs), and the share of
verdicts the verifier gets right (score above 0 means "Yes"). It also checks SFT's exact match on
the first `sft.eval_math_problems` held-out problems against the verifier's own greedy answers.

Writes the verifier model directory, its metrics, the curves (verifier{.tsv,_val.tsv,.png}) and the
run directory (checkpoints).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from llm.config import CommonConfig, RankersConfig, SFTConfig, fingerprint, load_sections
from llm.data.batching import conversation_batches, derive_seed, fixed_conversation_batches
from llm.data.template import render_all, render_prompt
from llm.fileio import atomic_write_text, read_jsonl, sha256_file, sha256_tree
from llm.runtime import Runtime, full_model_state, setup_runtime
from llm.stage import stage_main, training_outputs
from llm.train.finish import finish_stage, run_plots
from llm.train.trainer import lm_loss, supervised_lm_loss, train

STAGE = "verifier"
INPUTS = {"sft": "the SFT model directory (where training starts)",
          "samples": "the samples stage's samples.jsonl (SFT's answers to training problems)",
          "sft_data": "cleaned conversations (train.jsonl), SFT's own training data",
          "math_val": "held-out math problems (JSONL): the verifier's own answers, against SFT's"}
OUTPUTS = training_outputs("the verifier model directory")


def loop_config(sft: SFTConfig, cfg: RankersConfig) -> SFTConfig:
    """SFT's loop with the verifier's steps and rate: warmup and the cosine floor scaled as SFT's,
    evaluations and checkpoints at most every run's length, no replay, no averaging."""
    steps = cfg.verifier_steps
    return replace(sft, max_steps=steps, lr=cfg.verifier_lr, min_lr=cfg.verifier_lr * sft.min_lr / sft.lr,
                   warmup_steps=min(steps, max(1, round(steps * sft.warmup_steps / sft.max_steps))),
                   eval_every=min(sft.eval_every, steps), checkpoint_every=min(sft.checkpoint_every, steps),
                   replay_fraction=0.0, average_last=1, min_source_examples=0)


def run(common: CommonConfig, sft_cfg: SFTConfig, cfg: RankersConfig, rt: Runtime, *, sft: Path, samples: Path,
        sft_data: Path, math_val: Path, run_dir: Path, model: Path, metrics: Path, plots: Path,
        progress: bool = True) -> dict | None:
    import random

    from llm.nn.artifacts import load_model_dir
    from llm.nn.model import GPT
    from llm.post.verifier import render_verification, verdict_ids, verification_examples

    gpt, tok, sft_meta = load_model_dir(sft, device="cpu", heads=("lm",))
    verdict_ids(tok)  # the two replies must differ in their first token
    seq_len = gpt.config.seq_len
    loop = loop_config(sft_cfg, cfg)
    seed = derive_seed(common.seed, STAGE)
    train_v, val_v = verification_examples(read_jsonl(samples), seed=seed, val_fraction=cfg.verifier_val_fraction)
    verdicts = [x for x in (render_verification(e["messages"], tok, seq_len + 1) for e in train_v) if x is not None]
    inputs = {"sft": sft_meta.get("fingerprint", ""), "samples": sha256_file(samples),
              "sft_data": sha256_tree(sft_data)}
    if not verdicts:
        # a model that gets no sampled problem right (the smoke profile's) leaves nothing to contrast
        print(f"{STAGE}: WARNING: {samples}: no math problem has both a right and a wrong answer (the samples stage"
              f" labels SFT's answers to pairs.n_prompts x pairs.math_fraction problems), so there is no verdict"
              f" to learn: the model written is SFT's, untaught, and the rankers read its untaught answer to"
              f" the question. Raise pairs.n_prompts or pairs.math_fraction, or train SFT longer.", flush=True)
        if not rt.is_main:
            return None
        _no_curves(Path(run_dir) / "plots", "no verdict to learn: no sampled problem has a right and a wrong answer")
        return finish_stage(STAGE, run_dir=run_dir, model=model, weights=gpt, tokenizer=tok,
                            meta={"stage": STAGE, "fingerprint": "", "inputs": inputs, "parent": str(sft), "steps": 0},
                            plots=plots, metrics=metrics, numbers={"steps": 0, "verdicts_trained": 0,
                                                                   "heldout_verdicts": len(val_v), "train_time_s": 0.0})
    # SFT's conversations beside them, verifier_sft_share of what the run reads: as many different
    # ones as that takes (a few hundred read ten times over cost one seed 6 points of math), the
    # verdicts repeated to fill the rest
    sft_recs = list(read_jsonl(Path(sft_data) / "train.jsonl"))
    share = cfg.verifier_sft_share
    reads = loop.max_steps * loop.batch_size * loop.grad_accum
    n_sft = min(len(sft_recs), round(reads * share))
    pick = random.Random(derive_seed(seed, "sft")).sample(range(len(sft_recs)), n_sft)
    own, _ = render_all([sft_recs[i]["messages"] for i in pick], tok, seq_len + 1)
    repeats = max(1, round(len(own) * (1 - share) / (share * len(verdicts)))) if share else 1
    val_ex = [x for x in (render_verification(e["messages"], tok, seq_len + 1) for e in val_v) if x is not None]
    # what the run computes: the loop (steps and rate in it), the keys that shape its data and the mix
    fp = fingerprint(common, loop, inputs | {"sft_share": share, "val_fraction": cfg.verifier_val_fraction,
                                             "mix": [len(verdicts), repeats, len(own)]})
    batches = conversation_batches(verdicts * repeats + own, pad_id=tok.pad_id, batch_size=loop.batch_size,
                                   bucket_width=loop.bucket_width, seed=seed, rank=rt.rank, world_size=rt.world_size)
    val_batches = fixed_conversation_batches(val_ex, pad_id=tok.pad_id, batch_size=loop.batch_size,
                                             n_batches=min(loop.eval_batches, max(1, len(val_ex) // loop.batch_size)),
                                             seed=derive_seed(seed, "val")) if val_ex else None
    if rt.is_main:
        right = sum(e["right"] for e in train_v)
        print(f"{STAGE}: {len(verdicts)} verdicts to learn ({right} right answers, {len(train_v) - right} wrong),"
              f" each {repeats} times, beside {len(own)} of SFT's conversations; {len(val_v)} held-out verdicts;"
              f" {gpt.summary()}", flush=True)
    loss_fn = lm_loss if loop.compile else supervised_lm_loss
    result = train(gpt, loop, rt, stage=STAGE, seed=seed, batches=batches, loss_fn=loss_fn, val_batches=val_batches,
                   run_dir=run_dir, fingerprint=fp, plots=run_plots(STAGE, run_dir), progress=progress)
    state = full_model_state(gpt, rt)
    if not rt.is_main:
        return None
    out_model = GPT(gpt.config, seed=0)
    out_model.load_state_dict(state)
    out_model.eval()
    m = dict(result.metrics)
    out = {"train_loss": m["train_loss"], "val_loss": m.get("val_loss"), "steps": m["steps"],
           "verdicts_trained": len(verdicts), "verdict_repeats": repeats, "sft_conversations": len(own),
           "heldout_verdicts": len(val_v),
           "heldout_right": sum(e["right"] for e in val_v), "tokens_seen": m["tokens_seen"],
           "train_time_s": m["train_time_s"], "num_threads": m["num_threads"]}
    sft_model, _, _ = load_model_dir(sft, device=rt.device, heads=("lm",))
    out.update(heldout_verdicts_measured(out_model.to(rt.device), sft_model, tok, val_v, rt))
    if sft_cfg.eval_math_problems:
        out.update(answers_kept(out_model, sft_model, tok, math_val, sft_cfg))
    return finish_stage(STAGE, run_dir=run_dir, model=model, weights=out_model.cpu(), tokenizer=tok,
                        meta={"stage": STAGE, "fingerprint": fp, "inputs": inputs, "parent": str(sft),
                              "steps": result.step}, plots=plots, metrics=metrics, numbers=out)


def _no_curves(where: Path, why: str) -> None:
    """The curves of a run that did not train (DVC outputs all the same): headers, and a picture saying why."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where.mkdir(parents=True, exist_ok=True)
    atomic_write_text(where / f"{STAGE}.tsv", "step\tloss\n")
    atomic_write_text(where / f"{STAGE}_val.tsv", "step\tval_loss\n")
    fig = plt.figure(figsize=(7, 2))
    fig.text(0.5, 0.5, f"{STAGE}: {why}", ha="center", va="center")
    fig.savefig(where / f"{STAGE}.png")
    plt.close(fig)


def heldout_verdicts_measured(verifier, sft_model, tok, val: list[dict], rt: Runtime) -> dict:
    """On the held-out answers, for the verifier's score and for SFT's likelihood: the AUC of right
    over wrong answers (llm/eval/paired.py `separation`) and the pair accuracy within a problem;
    the verifier's verdict accuracy."""
    import numpy as np

    from llm.eval.paired import separation
    from llm.post.pairs import add_likelihoods
    from llm.post.verifier import pair_accuracy, verifier_scores

    if not val:
        return {}

    def auc(scores: list[float]) -> float | None:
        sep = separation(scores, right, n_boot=1, rng=np.random.default_rng(0))
        return sep["auc"] if sep else None

    # a conversation is [prompt..., the answer, the question, the verdict]
    prompts = [render_prompt(e["messages"][:-3], tok) for e in val]
    answers = [e["messages"][-3]["content"] for e in val]
    right = [e["right"] for e in val]
    scores = verifier_scores(verifier, tok, prompts, answers, batch_size=64, device=rt.device)
    rows = [[{"text": a}] for a in answers]
    add_likelihoods(rows, prompts, sft_model, tok, batch_size=64, device=rt.device)
    logp = [r[0]["logp"] for r in rows]
    problem = [e["id"].rsplit("/", 1)[0] for e in val]
    (pair, n_pairs), (pair_logp, _) = pair_accuracy(problem, scores, right), pair_accuracy(problem, logp, right)
    return {"heldout_auc": auc(scores), "heldout_likelihood_auc": auc(logp),
            "heldout_pair_accuracy": pair, "heldout_likelihood_pair_accuracy": pair_logp, "heldout_pairs": n_pairs,
            "heldout_verdict_accuracy": sum((s > 0) == r for s, r in zip(scores, right)) / len(val)}


def answers_kept(verifier, sft_model, tok, math_val: Path, sft_cfg: SFTConfig) -> dict:
    """Greedy exact match of the verifier and of SFT on the first sft.eval_math_problems held-out problems."""
    from llm.eval.evaluate import math_eval

    problems = list(read_jsonl(math_val))[: sft_cfg.eval_math_problems]
    kw = dict(max_new_tokens=sft_cfg.max_new_tokens, batch_size=64)
    mine, sft = math_eval(verifier, tok, problems, **kw), math_eval(sft_model, tok, problems, **kw)
    return {"math_exact_match": mine["math_exact_match"], "sft_math_exact_match": sft["math_exact_match"],
            "math_problems": len(problems)}


def main(argv: list[str] | None = None) -> int:
    def work(args, common: CommonConfig, cfg: RankersConfig, rt: Runtime) -> str | None:
        sft_cfg = load_sections(["sft"], args.params)["sft"]
        m = run(common, sft_cfg, cfg, rt, **{k: getattr(args, k) for k in (*INPUTS, *OUTPUTS)},
                progress=not args.no_progress)
        if m is None:  # ranks > 0
            return None
        pct = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1%}"  # noqa: E731
        return (f"{STAGE}: held-out answers: AUC {pct(m.get('heldout_auc'))} (SFT's likelihood"
                f" {pct(m.get('heldout_likelihood_auc'))}), pairs of one problem ordered right"
                f" {pct(m.get('heldout_pair_accuracy'))} (the likelihood {pct(m.get('heldout_likelihood_pair_accuracy'))}),"
                f" verdicts right {pct(m.get('heldout_verdict_accuracy'))};"
                f" math exact match {pct(m.get('math_exact_match'))} (SFT {pct(m.get('sft_math_exact_match'))});"
                f" wrote {args.model}/ and {args.metrics}")

    return stage_main(STAGE, __doc__, argv, inputs=INPUTS, outputs=OUTPUTS, work=work, section="rankers",
                      setup=setup_runtime, torchrun=True)


if __name__ == "__main__":
    raise SystemExit(main())
