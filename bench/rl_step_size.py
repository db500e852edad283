"""How far one policy-gradient step can go before it hurts (the numbers behind the README's RL notes).

    python bench/rl_step_size.py [--model models/sft] [--prompts 24] [--group 8] [--samples 24]
                                 [--levels 3 4] [--lengths 0.01 0.03 0.1] [--signs 3e-5 1e-4 3e-4] [--random 1e-4]

Takes --prompts math problems at --levels from data/prepared/rl/train.jsonl, samples a GRPO
group of --group answers for each from the model, and computes the GRPO policy gradient of that
batch (group-normalised advantages of the verifier reward, per-sequence token mean). Then, from
the same starting weights each time, it moves the weights

  - along the gradient by a parameter-space length L (--lengths): w - L * g / |g|;
  - by an Adam-like first step of size s per weight (--signs): w - s * sign(g);
  - by a random sign step of size --random (the control: no signal at all);

and measures sampled accuracy (temperature 1) on the same prompts with --samples answers each,
drawn with the same random numbers for every variant. It also prints the correlation between each
answer's change in log-probability and its advantage (above 0: the step moves the right way).

A step that raises accuracy at a small length and lowers it at a slightly larger one is the sign
of a sharp minimum: RL then needs learning rates so small that the weights barely move.
The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.nn.artifacts import load_model_dir  # noqa: E402
from llm.nn.losses import aggregate, group_advantages  # noqa: E402
from llm.sample.prompts import MathPrompts, read_problems  # noqa: E402
from llm.sample.rewards import verifier_reward  # noqa: E402
from llm.sample.rollout import response_forward, rollout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/sft")
    ap.add_argument("--data", default="data/prepared/rl/train.jsonl")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--group", type=int, default=8, help="answers per prompt for the gradient")
    ap.add_argument("--samples", type=int, default=24, help="answers per prompt for measuring accuracy")
    ap.add_argument("--levels", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--lengths", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    ap.add_argument("--signs", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4])
    ap.add_argument("--random", type=float, default=1e-4, help="size of the random sign step")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for p in (Path(args.model), Path(args.data)):
        if not p.exists():
            raise SystemExit(f"{p}: not found; run `dvc repro sft` first (this measures a trained SFT model)")

    policy, tok, _ = load_model_dir(args.model, device="cpu", heads=("lm",))
    pool = MathPrompts(read_problems(args.data), tok, seq_len=policy.config.seq_len,
                       max_new_tokens=args.max_new_tokens, where=args.data)
    prompts, problems = pool.sample(args.prompts, args.levels, torch.Generator().manual_seed(args.seed))
    reward = verifier_reward(tok, correct_reward=1.0, format_reward=0.2)
    stop = (tok.end_id, tok.eot_id)

    def sample(k: int, seed: int):
        ro = rollout(policy, [p for p in prompts for _ in range(k)], max_new_tokens=args.max_new_tokens,
                     temperature=1.0, stop_ids=stop, pad_id=tok.pad_id, generator=torch.Generator().manual_seed(seed))
        return ro, reward(ro, [p for p in problems for _ in range(k)])

    def accuracy() -> float:
        return sample(args.samples, args.seed + 2)[1][1]["accuracy"]

    # the GRPO gradient of one group batch
    ro, (r, stats) = sample(args.group, args.seed + 1)
    adv, zero = group_advantages(r.view(-1, args.group))
    adv = adv.reshape(-1)                                                  # (B,)
    policy.train()
    lp = response_forward(policy, ro, 1.0).logprobs                        # (B, N)
    aggregate(-adv[:, None] * lp, ro.response_mask, "grpo").backward()
    params = list(policy.parameters())
    grads = [p.grad.detach().clone() for p in params]
    gnorm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
    if gnorm == 0.0:
        raise SystemExit(f"no policy gradient: all {len(zero)} groups had equal rewards (batch accuracy"
                         f" {stats['accuracy']:.3f}); use a trained model, other --levels, or more --prompts / --group")
    start = [p.detach().clone() for p in params]
    lp0 = lp.detach()
    base = accuracy()
    print(f"{args.prompts} prompts at levels {args.levels}: gradient batch accuracy {stats['accuracy']:.3f},"
          f" {int(zero.sum())}/{len(zero)} groups without signal, |g| = {gnorm:.4f}; sampled accuracy before: {base:.3f}")

    def moved(update) -> tuple[float, float]:
        with torch.no_grad():
            for p, w0, g in zip(params, start, grads):
                p.copy_(w0 + update(w0, g))
            d = ((response_forward(policy, ro, 1.0).logprobs - lp0) * ro.response_mask).sum(1)   # (B,)
            corr = float(torch.corrcoef(torch.stack([d, adv]))[0, 1])
        return accuracy(), corr

    rows = []
    for L in args.lengths:
        acc, corr = moved(lambda w0, g, L=L: -L * g / gnorm)
        rows.append({"step": "gradient", "size": L, "accuracy": acc, "corr_dlogp_adv": corr})
    for s in args.signs:
        acc, corr = moved(lambda w0, g, s=s: -s * torch.sign(g))
        rows.append({"step": "sign", "size": s, "accuracy": acc, "corr_dlogp_adv": corr})
    gen = torch.Generator().manual_seed(args.seed + 3)
    acc, corr = moved(lambda w0, g: args.random * torch.sign(torch.randn(w0.shape, generator=gen)))
    rows.append({"step": "random sign", "size": args.random, "accuracy": acc, "corr_dlogp_adv": corr})
    print(f"\n{'step':<12} {'size':>8} {'accuracy':>9} {'vs before':>10} {'corr(dlogp, A)':>15}")
    for row in rows:
        print(f"{row['step']:<12} {row['size']:>8.0e} {row['accuracy']:>9.3f} {row['accuracy'] - base:>+10.3f}"
              f" {row['corr_dlogp_adv']:>15.3f}")
    print(json.dumps({"bench": "rl_step_size", "model": args.model, "prompts": args.prompts, "group": args.group,
                      "samples": args.samples, "levels": args.levels, "grad_norm": gnorm, "accuracy_before": base,
                      "steps": rows}))


if __name__ == "__main__":
    main()
