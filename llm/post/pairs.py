"""Making preference pairs from the SFT model's own samples: the algorithm of the `samples` and
`pairs` stages.

    prompts = sample_prompts(cfg, seed, math_path, sft_path)          # math questions + task prompts
    assign_splits(prompts, cfg.val_fraction, seed)                    # train or val, by prompt
    samples, n_tokens = sample_responses(policy, tok, prompt_ids, cfg, seed, device)
    x["verifier"] = verify(x["text"], prompt)                         # None where nothing can check
    add_likelihoods(samples, prompt_ids, policy, tok, ...)           # SFT's log-probability of each
    pairs, ties, tied = choose_pairs(prompts, samples, cfg.tie_epsilon, cfg.tie_break)
    pairs += adversarial_pairs(prompts, prompt_ids, samples, tied, ...)

1. Prompts: round(n_prompts * math_fraction) math questions, the rest task prompts (unique
   user turns of SFT conversations whose source is not math); round(val_fraction * n) of them
   held out, so no prompt is on both sides.
2. Samples: for each temperature, samples_per_temperature responses per prompt from the SFT
   model (batched `llm.sample.generate.generate` with the KV cache, prompts batched by length).
3. Scores: math with the verifier (`llm.sample.rewards.math_reward`: 1.0 correct + 0.2 formatted);
   continuations of passages (`continuation_prompts`, check "gold") with the gold judge
   (llm/sample/gold.py), a comparison only where two scores differ by more than `gold_margin`.
   With `verify_tasks`, the generated instruction tasks and bare calculations are checked
   against the reference answers of their SFT conversations (a task: 1.2 for exactly the
   reference, else 0, as the evaluation scores it; a calculation: the math verifier on the
   reference's number). Prompts with no check (a user's own SFT data) are scored by the reward
   model in the `pairs` stage, after the reward model has learned from the checked ones.
4. Pairs: chosen = the best response, rejected = the worst (`choose_pair`); a prompt whose best
   and worst differ by at most `tie_epsilon` (or are the same text) is a tie: dropped and
   counted. `preference_score = sigmoid(r_chosen - r_rejected)`, strictly inside (0.5, 1), on
   the scorer's own scale.
5. Adversarial pairs (`adversarial_fraction` of the output, DPO's pairs only): a right,
   well-formatted math answer as chosen, the same text with its `#### N` line removed or mangled
   as rejected (`break_format`: right content, broken format), scored by the verifier (1.2 vs
   1.0). Prompts whose samples tied are used first.
"""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Sequence

import torch

from llm.config import PairsConfig
from llm.data.batching import derive_seed
from llm.fileio import DataError, read_jsonl
from llm.runtime import sharded_map
from llm.data.continuation import SOURCE as CONTINUATION_SOURCE
from llm.sample.gold import gold_score
from llm.sample.prompts import read_passages
from llm.sample.rewards import math_reward, parse_answer, task_correct, to_number

CORRECT, FORMAT = 1.0, 0.2  # the verifier's rewards (llm.sample.rewards.math_reward defaults)


def is_math_source(source: str) -> bool:
    return "math" in source.lower()


def reference_check(source: str, reference: str) -> tuple[str | None, str | None]:
    """(answer, check) for an SFT conversation's task prompt: how its responses can be verified.

    generated/task_*: the reference text itself, matched exactly ("exact"); generated/arithmetic:
    the number of its `#### N` line, for the math verifier ("math"); anything else, or a
    reference without a number: (None, None), scored by the reward model."""
    if source.startswith("generated/task_"):
        return reference, "exact"
    if source == "generated/arithmetic":
        value, formatted = parse_answer(reference)
        if value is not None and formatted:
            return str(value), "math"
    return None, None


def sample_prompts(cfg: PairsConfig, seed: int, math_path: Path, sft_path: Path,
                   continuation_path: Path | None = None) -> list[dict]:
    """The prompts: {"id", "prompt": [messages], "answer": str | None, "check": "math" | "exact" |
    "gold" | None, "source", "kind"}; a prompt with a check is scored by the verifier (or, for a
    passage to continue, by the gold judge, its "answer" the passage), else by the RM. The
    continuation prompts (`cfg.continuation_prompts` of `continuation_path`) come last, from a
    generator of their own: the other prompts are those drawn without them (their split and
    samples are not: `assign_splits` and the length-sorted batches run over all prompts)."""
    rng = random.Random(derive_seed(seed, "prompts"))
    n_math = round(cfg.n_prompts * cfg.math_fraction)
    math = [r for r in read_jsonl(math_path) if r.get("question") and r.get("answer") is not None]
    tasks, seen = [], set()
    for r in read_jsonl(sft_path):
        msgs = r.get("messages") or []
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
        if last < 1 or is_math_source(str(r.get("source", ""))) or r.get("source") == CONTINUATION_SOURCE:
            continue  # SFT's continuation lessons were trained on: the preference asks passages of its own
        prompt = msgs[:last]
        key = tuple((m["role"], m["content"]) for m in prompt)
        if key in seen:
            continue
        seen.add(key)
        src = str(r.get("source", "sft"))
        answer, check = reference_check(src, str(msgs[last].get("content", ""))) if cfg.verify_tasks else (None, None)
        tasks.append({"id": str(r.get("id", f"sft-{len(tasks)}")), "prompt": prompt, "answer": answer,
                      "check": check, "source": src, "kind": src.rsplit("/", 1)[-1]})
    n_task = cfg.n_prompts - n_math
    if len(math) < n_math:
        raise DataError(f"{math_path}: {len(math)} math questions, pairs.n_prompts * pairs.math_fraction ="
                        f" {n_math} needed; lower pairs.n_prompts or pairs.math_fraction")
    if len(tasks) < n_task:
        raise DataError(f"{sft_path}: {len(tasks)} unique non-math prompts, {n_task} needed"
                        f" (pairs.n_prompts * (1 - pairs.math_fraction)); lower pairs.n_prompts, raise"
                        f" pairs.math_fraction, or give SFT more task prompts (prepare.task_train or"
                        f" prepare.sft_sources)")
    out = [{"id": str(r.get("id", f"math-{i}")), "prompt": [{"role": "user", "content": r["question"]}],
            "answer": str(r["answer"]), "check": "math", "source": str(r.get("source", "math")), "kind": "math"}
           for i, r in enumerate(rng.sample(math, n_math))]
    return out + rng.sample(tasks, n_task) + continuation_prompts(cfg, seed, continuation_path)


def continuation_prompts(cfg: PairsConfig, seed: int, path: Path | None) -> list[dict]:
    """`cfg.continuation_prompts` passages of `path` (continue/train.jsonl) to continue, judged by
    the gold judge (llm/sample/gold.py)."""
    if not cfg.continuation_prompts:
        return []
    if path is None:
        raise DataError(f"pairs.continuation_prompts = {cfg.continuation_prompts} needs the passages to continue"
                        f" (the samples stage's --continuation, prepare's continue/train.jsonl)")
    recs = read_passages(path)
    if len(recs) < cfg.continuation_prompts:
        raise DataError(f"{path}: {len(recs)} passages to continue, pairs.continuation_prompts ="
                        f" {cfg.continuation_prompts} needed; lower it or raise prepare.continuation_rl")
    rng = random.Random(derive_seed(seed, "continuation"))
    return [{"id": str(r["id"]), "prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["passage"],
             "check": "gold", "source": CONTINUATION_SOURCE, "kind": "continuation"}
            for r in rng.sample(recs, cfg.continuation_prompts)]




def sample_responses(policy, tok, prompt_ids: list[list[int]], cfg: PairsConfig, seed: int, device,
                     say: Callable[[str], None] = lambda m: None, rt=None) -> tuple[list[list[dict]], int]:
    """Per prompt, the samples {"text", "temperature", "tokens", "stopped"}; and the tokens generated.

    Prompts are batched by length; batch b of temperature ti's sample s draws from its own
    generator, seeded by (seed, ti, s, b), so no batch depends on another. A distributed `rt`
    shares the batches out over the ranks and gathers them (llm.runtime.sharded_map): every
    rank gets the samples one process would draw."""
    from llm.sample import generate as gen_lib  # looked up at run time (tests substitute a fake generate)

    seq_len = policy.config.seq_len
    stop = (tok.end_id, tok.eot_id)
    samples: list[list[dict]] = [[] for _ in prompt_ids]
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    chunks = [order[b:b + cfg.batch_size] for b in range(0, len(order), cfg.batch_size)]
    gen_tokens = 0
    for ti, temp in enumerate(cfg.temperatures):
        for s in range(cfg.samples_per_temperature):
            def one(b: int) -> tuple[list[dict], int]:
                chunk = [prompt_ids[i] for i in chunks[b]]
                room = min(cfg.max_new_tokens, seq_len - max(map(len, chunk)))
                g = torch.Generator(device=device).manual_seed(derive_seed(seed, "sample", ti, s, b))
                gen = gen_lib.generate(policy, chunk, room, temperature=temp, stop_ids=stop, pad_id=tok.pad_id,
                                       generator=g)
                resp = gen.responses()
                return ([{"text": tok.decode(r), "temperature": temp, "tokens": len(r), "stopped": bool(stopped)}
                         for r, stopped in zip(resp, gen.stopped.tolist())], int(gen.response_mask.sum()))

            for ix, (drawn, n) in zip(chunks, sharded_map(one, len(chunks), rt)):
                gen_tokens += n
                for i, smp in zip(ix, drawn):
                    samples[i].append(smp)
            say(f"sampled temperature {temp} #{s + 1}")
    return samples, gen_tokens


def verify(text: str, prompt: dict) -> float | None:
    """The verifier's score of a response to `prompt`, or None where the prompt has no check:
    math (and bare calculations) `math_reward`; an instruction task CORRECT + FORMAT when the
    response is exactly the reference (surrounding whitespace aside), else 0."""
    if prompt["check"] == "math":
        return math_reward(text, prompt["answer"], CORRECT, FORMAT)
    if prompt["check"] == "exact":
        return CORRECT + FORMAT if task_correct(text, prompt["answer"]) else 0.0
    if prompt["check"] == "gold":
        return gold_score(text, prompt["answer"])
    return None


def margin_of(prompt: dict, tie_epsilon: float, gold_margin: float) -> float:
    """How far apart two scores of `prompt`'s answers must be to make a comparison: the gold
    judge's scores are continuous, and closer than `gold_margin` they are a near-tie, dropped."""
    return gold_margin if prompt.get("check") == "gold" else tie_epsilon


def scorer_of(prompt: dict) -> str:
    return "gold" if prompt.get("check") == "gold" else "verifier" if prompt["answer"] is not None else "rm"


@torch.no_grad()
def add_likelihoods(samples: list[list[dict]], prompt_ids: list[list[int]], policy, tok, *, batch_size: int,
                    device, rt=None) -> None:
    """Add "logp" to every sample, in place: its answer's log-probability (sum over the answer
    tokens and the closing <|end|>, temperature 1) under `policy`, and "logp_mean", the same per
    token (what the reward model's likelihood feature reads), batched by length. A
    distributed `rt` shares the batches out over the ranks (llm.runtime.sharded_map)."""
    from llm.data.batching import pad_right
    from llm.data.preference import encode_response
    from llm.nn.losses import answer_logprob

    seq_len = policy.config.seq_len
    flat = [(i, k) for i in range(len(samples)) for k in range(len(samples[i]))]
    seqs, starts = [], []
    for i, k in flat:
        full = encode_response(prompt_ids[i], samples[i][k]["text"], tok)
        cut = max(0, len(full) - seq_len)           # as the reward model reads it: keep the end, where the answer is
        seqs.append(full[cut:])
        starts.append(max(0, len(prompt_ids[i]) - cut))
    order = sorted(range(len(seqs)), key=lambda j: len(seqs[j]))
    chunks = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    policy.eval()

    def one(b: int) -> list[float]:
        ix = chunks[b]
        idx, mask, resp = pad_right([seqs[j] for j in ix], tok.pad_id, [starts[j] for j in ix])
        return answer_logprob(policy, idx.to(device), mask.to(device), resp.to(device)).float().cpu().tolist()

    for ix, lps in zip(chunks, sharded_map(one, len(chunks), rt)):
        for j, v in zip(ix, lps):
            i, k = flat[j]
            samples[i][k]["logp"] = v
            samples[i][k]["logp_mean"] = v / max(1, len(seqs[j]) - starts[j])


def choose_pairs(prompts: list[dict], samples: list[list[dict]], tie_epsilon: float, tie_break: str = "first",
                 gold_margin: float = 0.0) -> tuple[list[dict], Counter, list[int]]:
    """(pair records, ties by scorer, the indices of the prompts that tied).

    tie_break: which of several equally scored best (or worst) samples is taken: "first", or
    "likelihood", the one the SFT model finds most likely (each sample's "logp"). The verifier's
    scores tie often (every right answer scores 1.2), so with "likelihood" the rejected answer is
    the wrong one the model itself would most readily write: a hard negative, a pair whose
    ranking the model's own likelihood does not already give away."""
    pairs, ties, tied_prompts = [], Counter(), []
    for i, p in enumerate(prompts):
        smp = samples[i]
        pick = choose_pair([x["score"] for x in smp], margin_of(p, tie_epsilon, gold_margin))
        if pick is not None and tie_break == "likelihood":
            best, worst = smp[pick[0]]["score"], smp[pick[1]]["score"]
            pick = (max((j for j, x in enumerate(smp) if x["score"] == best), key=lambda j: smp[j]["logp"]),
                    max((j for j, x in enumerate(smp) if x["score"] == worst), key=lambda j: smp[j]["logp"]))
        scorer = scorer_of(p)
        if pick is None or smp[pick[0]]["text"] == smp[pick[1]]["text"]:
            ties[scorer] += 1
            tied_prompts.append(i)
            continue
        c, r = smp[pick[0]], smp[pick[1]]
        pairs.append(_record(p, c, r, c["score"], r["score"], scorer, kind=p["kind"], adversarial=False))
    return pairs, ties, tied_prompts


def comparisons(prompts: list[dict], samples: list[list[dict]], tie_epsilon: float, gold_margin: float = 0.0
                ) -> list[dict]:
    """Every comparison the scores make within one prompt: each pair of distinct answers whose
    scores differ by more than `tie_epsilon` (`gold_margin` for the gold judge's), the higher one chosen (three answers, two right and
    one wrong: two pairs). These are the reward model's lessons and its held-out test, as PPO
    uses it: any two of the policy's answers, not only the hardest pair that `choose_pairs`
    keeps for DPO."""
    out = []
    for p, smp in zip(prompts, samples):
        seen = set()
        eps = margin_of(p, tie_epsilon, gold_margin)
        for a in smp:
            for b in smp:
                if a["score"] is None or b["score"] is None or a["score"] - b["score"] <= eps:
                    continue
                if a["text"] == b["text"] or (a["text"], b["text"]) in seen:
                    continue
                seen.add((a["text"], b["text"]))
                scorer = scorer_of(p)
                out.append(_record(p, a, b, a["score"], b["score"], scorer, kind=p["kind"], adversarial=False))
    return out


@torch.no_grad()
def errors_sft_would_make(policy, tok, records: list[dict], prompt_ids: dict[str, list[int]]) -> dict:
    """Of the comparisons whose rejected answer has a wrong worked step (`check_steps`: a wrong
    result, or a wrong number carried from the step before), how many went wrong exactly where
    the SFT model's own greedy choice goes: every token of the first wrong result is the argmax
    of its next-token prediction, given the answer so far.

    Those errors are what the model believes. A reward read from the same model (its likelihood,
    a head on its trunk) has no information to rank them, so their share bounds what such a
    reward can rank right: {"with_wrong_step", "sft_would_make", "share"}."""
    from llm.data.preference import encode_response
    from llm.sample.rewards import check_steps

    n_wrong = n_believed = 0
    for r in records:
        ids = encode_response(prompt_ids[r["prompt_id"]], r["rejected"], tok)[-policy.config.seq_len:]
        start = len(ids) - 1 - len(tok.encode(r["rejected"], allowed_special="none"))
        toks = ids[start:-1]
        pieces = [tok.token_bytes(t) if 0 <= t < tok.n_base else b"" for t in toks]
        wrong = [(a, b) for a, b, right in check_steps(b"".join(pieces)) if not right]
        if not wrong or start < 1:
            continue
        n_wrong += 1
        a, b = wrong[0]
        ends, pos = [], 0
        for piece in pieces:
            pos += len(piece)
            ends.append(pos)
        at = [start + u for u in range(len(toks)) if ends[u] > a and ends[u] - len(pieces[u]) < b]
        greedy = policy(torch.tensor([ids], device=next(policy.parameters()).device)).argmax(-1)[0].tolist()
        n_believed += all(greedy[t - 1] == ids[t] for t in at)
    return {"with_wrong_step": n_wrong, "sft_would_make": n_believed,
            "share": n_believed / n_wrong if n_wrong else None}


def adversarial_pairs(prompts: list[dict], prompt_ids: list[list[int]], samples: list[list[dict]], *,
                      wanted: int, tied_prompts: list[int], rng: random.Random,
                      rm_score: Callable[[list[list[int]]], list[float]], tok, seq_len: int) -> list[dict]:
    """Up to `wanted` format-broken pairs from math prompts with a right answer; tied prompts first."""
    from llm.data.preference import encode_response

    tied = set(tied_prompts)
    candidates = [i for i in tied_prompts + [i for i in range(len(prompts)) if i not in tied]
                  if prompts[i]["kind"] == "math" and prompts[i]["answer"] is not None]
    out = []
    for i in candidates:
        if len(out) >= wanted:
            break
        found = [(x, b) for x in samples[i] for b in [break_format(x["text"], prompts[i]["answer"], rng)] if b]
        if not found:
            continue
        c, broken = found[0]
        rb = math_reward(broken, prompts[i]["answer"], CORRECT, FORMAT)
        rm_c, rm_b = rm_score([encode_response(prompt_ids[i], text, tok)[-seq_len:] for text in (c["text"], broken)])
        c = {**c, "rm": float(rm_c)}
        rej = {"text": broken, "temperature": c["temperature"], "rm": float(rm_b)}
        out.append(_record(prompts[i], c, rej, c["verifier"], rb, "verifier", kind="adversarial_format",
                           adversarial=True))
    return out


def adversarial_wanted(fraction: float, n_pairs: int, n_prompts: int) -> int:
    """How many adversarial pairs make `fraction` of the output."""
    return round(fraction * n_pairs / (1 - fraction)) if fraction < 1 else n_prompts


def assign_splits(prompts: list[dict], val_fraction: float, seed: int) -> None:
    """Add "split" ("train" or "val") to every prompt, in place: round(val_fraction * n) prompts,
    drawn with a generator seeded by (seed, "split"), are held out. The split is by prompt, so the
    reward model and DPO never see a held-out prompt in training, whichever answers they pair."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i]["id"])
    random.Random(derive_seed(seed, "split")).shuffle(order)
    n_val = round(val_fraction * len(prompts))
    if val_fraction > 0 and len(prompts) >= 2:
        n_val = max(1, n_val)
    held = set(order[:n_val])
    for i, p in enumerate(prompts):
        p["split"] = "val" if i in held else "train"


def too_few_pairs(n_pairs: int, stage: str, verify_tasks: bool):
    """Raise the DataError of a pair set with an empty train or val side, saying what to change."""
    weak = (" With pairs.verify_tasks every prompt whose samples are all right or all wrong is a tie, so a"
            " model that gets no task right gives no task pair; pairs.verify_tasks: false lets the reward"
            " model rank them.") if verify_tasks else ""
    raise DataError(f"{stage}: {n_pairs} pairs are too few for a train/val split; raise pairs.n_prompts, add"
                    f" temperatures or samples, or lower pairs.tie_epsilon.{weak}")


def summarize(prompts: list[dict], samples: list[list[dict]], pairs: list[dict], adversarial: list[dict],
              ties: Counter, temperatures: Sequence[float]) -> dict:
    """The metrics of a pair set: counts, preference-score quantiles, RM-verifier agreement on the
    held-out prompts' pairs (prompts with "split" "val": the others taught the reward model), per
    temperature."""
    heldout = {p["id"] for p in prompts if p.get("split", "val") == "val"}
    scorers = ("rm", "verifier") + (("gold",) if any(r["scorer"] == "gold" for r in pairs) else ())
    scores = {s: [r["preference_score"] for r in pairs if r["scorer"] == s] for s in scorers}
    all_scores = [r["preference_score"] for r in pairs]
    assert all(0.5 < x < 1.0 for x in all_scores), "preference_score outside (0.5, 1)"
    natural_v = [r for r in pairs if r["scorer"] == "verifier" and not r["adversarial"] and r["prompt_id"] in heldout]
    by_temp = quality_by_temperature(prompts, samples, temperatures)
    return {
        "prompts": len(prompts),
        "prompt_sources": dict(sorted(Counter(p["kind"] for p in prompts).items())),
        "responses": sum(len(s) for s in samples),
        "pairs": len(pairs), "ties_dropped": sum(ties.values()), "ties_dropped_by_scorer": dict(ties),
        "adversarial": len(adversarial),
        "pairs_by_kind": dict(sorted(Counter(r["kind"] for r in pairs).items())),
        "pairs_by_scorer": {s: len(v) for s, v in scores.items()},
        "preference_score": _quantiles(all_scores),
        "preference_score_by_scorer": {s: _quantiles(v) for s, v in scores.items()},
        "reward_chosen_mean": {s: mean(r["reward_chosen"] for r in pairs if r["scorer"] == s) for s in scores},
        "reward_rejected_mean": {s: mean(r["reward_rejected"] for r in pairs if r["scorer"] == s) for s in scores},
        # how often the RM ranks held-out verifier-labelled pairs of SFT's own answers the verifier's way
        "rm_accuracy_on_verifier_pairs": mean(r["rm_chosen"] > r["rm_rejected"] for r in natural_v),
        "rm_verifier_pairs": len(natural_v),
        "rm_accuracy_on_adversarial_pairs": mean(r["rm_chosen"] > r["rm_rejected"] for r in adversarial),
        "by_temperature": by_temp,
    }


def _record(p: dict, c: dict, r: dict, rc: float, rr: float, scorer: str, *, kind: str, adversarial: bool) -> dict:
    return {"id": "", "prompt_id": p["id"], "prompt": p["prompt"], "chosen": c["text"], "rejected": r["text"],
            "kind": kind, "source": p["source"], "scorer": scorer, "reward_chosen": rc, "reward_rejected": rr,
            "preference_score": preference_score(rc, rr), "adversarial": adversarial,
            "rm_chosen": c.get("rm"), "rm_rejected": r.get("rm"),
            "sft_logp_chosen": c.get("logp_mean"), "sft_logp_rejected": r.get("logp_mean"),
            "temperature_chosen": c["temperature"], "temperature_rejected": r["temperature"]}


def choose_pair(scores: Sequence[float], tie_epsilon: float) -> tuple[int, int] | None:
    """(index of the best sample, index of the worst) or None for a tie (best - worst <= tie_epsilon).

    The first best and the first worst win among equals, so the choice is deterministic.
    """
    if len(scores) < 2:
        return None
    best = max(range(len(scores)), key=lambda i: scores[i])
    worst = min(range(len(scores)), key=lambda i: scores[i])
    if not scores[best] - scores[worst] > tie_epsilon:
        return None
    return best, worst


_JUST_ABOVE_HALF = math.nextafter(0.5, 1.0)
_JUST_BELOW_ONE = math.nextafter(1.0, 0.0)


def preference_score(r_chosen: float, r_rejected: float) -> float:
    """sigmoid(r_chosen - r_rejected), kept strictly inside (0.5, 1).

    For a non-tied pair the difference is positive, so the score is above 0.5; float64
    rounds sigmoid(d) to exactly 1.0 for d > ~37 (and to 0.5 for d < ~1e-16), which the
    clamp moves to the nearest representable value inside the interval.
    """
    d = r_chosen - r_rejected
    if not d > 0:
        raise ValueError(f"preference_score: r_chosen {r_chosen} is not above r_rejected {r_rejected}")
    s = 1.0 / (1.0 + math.exp(-d)) if d < 700 else 1.0
    return min(max(s, _JUST_ABOVE_HALF), _JUST_BELOW_ONE)


def break_format(response: str, answer: str, rng: random.Random) -> str | None:
    """An adversarial rejected answer: the same worked solution with its final `#### N` line
    removed or mangled, so the content is still right and only the format is wrong.

    Returns None when `response` is not a right, well-formatted answer to `answer`. Every
    candidate is checked with the verifier's parser: correct value, not formatted.
    """
    value, formatted = parse_answer(response)
    target = to_number(answer)
    if not formatted or value is None or target is None or value != target:
        return None
    lines = response.rstrip().splitlines()
    body, n = lines[:-1], lines[-1].strip()[4:].strip()
    variants = [body + [f"The answer is {n}."], body + [n], body + [f"### {n}"], body + [f"Answer: {n}"],
                body + [f"#### {n} is the answer"], body + [f"{n} ####"]]
    if body:
        variants.append(list(body))
    rng.shuffle(variants)
    for v in variants:
        text = "\n".join(v)
        val, fmt = parse_answer(text)
        if not fmt and val == target:
            return text
    return None


def _quantiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {k: None for k in ("mean", "min", "p05", "p25", "p50", "p75", "p95", "max")}
    s = sorted(xs)

    def q(p: float) -> float:  # linear interpolation between order statistics
        pos = p * (len(s) - 1)
        lo = int(pos)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)
    return {"mean": sum(s) / len(s), "min": s[0], "p05": q(0.05), "p25": q(0.25), "p50": q(0.5), "p75": q(0.75),
            "p95": q(0.95), "max": s[-1]}


def mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def histogram(pairs: list[dict], bins: int = 20) -> str:
    """TSV: preference_score (bin centre over (0.5, 1)), pairs, pairs_rm, pairs_verifier, pairs_gold
    (the passages' continuations the gold judge labelled)."""
    counts = {s: [0] * bins for s in ("all", "rm", "verifier", "gold")}
    for r in pairs:
        b = min(bins - 1, int((r["preference_score"] - 0.5) * 2 * bins))
        counts["all"][b] += 1
        counts[r["scorer"]][b] += 1
    lines = ["preference_score\tpairs\tpairs_rm\tpairs_verifier\tpairs_gold"]
    for b in range(bins):
        centre = 0.5 + (b + 0.5) / (2 * bins)
        lines.append(f"{centre:.4f}\t{counts['all'][b]}\t{counts['rm'][b]}\t{counts['verifier'][b]}"
                     f"\t{counts['gold'][b]}")
    return "\n".join(lines) + "\n"


def quality_by_temperature(prompts: list[dict], samples: list[list[dict]], temperatures: Sequence[float]) -> dict:
    """Per sampling temperature: the share of math answers right and formatted, of checked task
    answers right, the reward model's mean on unchecked answers (where scored), mean length and
    the share cut off at max_new_tokens."""
    by_temp = {}
    for temp in temperatures:
        at = [(p, x) for p, ss in zip(prompts, samples) for x in ss if x["temperature"] == temp]
        smp = [x for _, x in at]
        m_smp = [x for p, x in at if p["kind"] == "math" and x["verifier"] is not None]
        v_smp = [x for p, x in at if p["kind"] != "math" and p.get("check") != "gold" and x["verifier"] is not None]
        g_smp = [x for p, x in at if p.get("check") == "gold"]
        t_smp = [x for x in smp if x["verifier"] is None and x.get("rm") is not None]
        by_temp[str(temp)] = {
            "math_correct": mean(x["verifier"] >= CORRECT for x in m_smp),
            "math_formatted": mean(x["verifier"] in (FORMAT, CORRECT + FORMAT) for x in m_smp),
            **({"task_correct": mean(x["verifier"] >= CORRECT for x in v_smp)} if v_smp else {}),
            "task_rm_mean": mean(x["rm"] for x in t_smp),
            **({"continuation_gold_mean": mean(x["verifier"] for x in g_smp)} if g_smp else {}),
            "mean_tokens": mean(x["tokens"] for x in smp), "truncated": mean(not x["stopped"] for x in smp)}
    return by_temp
