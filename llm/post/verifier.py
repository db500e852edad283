"""A generative verifier: the SFT model taught to say whether its own math answer is right.

    train, val = verification_examples(samples_rows, seed=s, val_fraction=0.1)   # from the samples stage
    ids, mask = render_verification(train[0]["messages"], tok)                    # loss on "Yes"/"No" only
    scores = verifier_scores(model, tok, prompt_ids, texts, batch_size=64, device="cpu")

After an answer, the conversation goes on with one more exchange:

    user:      {problem}
    assistant: {an answer SFT sampled}
    user:      Is the answer right?
    assistant: Yes | No                  (what the exact checker said of that answer)

The examples are SFT's own answers to training problems (the samples stage draws several per
problem at three temperatures and the checker, llm/sample/rewards.py `is_correct`, labels them):
from each problem as many right answers as wrong ones, drawn at random, so "Yes" and "No" are
equally common on every problem and only the answer tells them apart. Only the last reply is
trained on (`render_verification`), and stage `verifier` trains on these mixed with SFT's own
conversations, so the model keeps answering as SFT did while it learns to judge (the joint loss of
Cobbe et al. 2021's verifiers and of generative verifiers, Zhang et al. 2024). Its score of an answer (`verifier_scores`) is log p(Yes) - log p(No) at the reply's first
token: a ranker that reads the whole answer before it judges, where SFT's likelihood has judged
each token as it was written. Problems are split into train and validation whole, so the held-out
scores are of problems the verifier never saw.
"""
from __future__ import annotations

import random
from typing import Iterable, Sequence

from llm.data.batching import derive_seed
from llm.data.template import ROLE_TOKENS, END, render
from llm.sample.rewards import is_correct

QUESTION = "Is the answer right?"   # the user's second turn
YES, NO = "Yes", "No"               # the reply; each one token of the project's tokenizers


def verify_messages(prompt: Sequence[dict], answer: str, right: bool | None = None) -> list[dict]:
    """The conversation that asks about `answer`; with `right`, the reply too."""
    msgs = [*prompt, {"role": "assistant", "content": answer}, {"role": "user", "content": QUESTION}]
    return msgs + ([{"role": "assistant", "content": YES if right else NO}] if right is not None else [])


def verification_examples(rows: Iterable[dict], *, seed: int, val_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, val) examples {"id", "messages", "right"} from the samples stage's rows
    (samples.jsonl: {"id", "prompt", "answer", "kind", "samples": [{"text"}...]}), math rows only.

    Per problem its distinct answers, each labelled by the checker, and of them as many right as
    wrong ones, chosen at random: a problem with only right or only wrong answers gives none. So the
    verdict cannot be read off the problem (a hard one's answers are more often wrong), only off the
    answer, which is what ranking a problem's answers needs. A problem goes to val with probability
    val_fraction (by its id and the seed, so a row's split does not depend on the others)."""
    out: dict[str, list[dict]] = {"train": [], "val": []}
    for r in rows:
        if r.get("kind") != "math" or not r.get("answer"):
            continue
        name = "val" if random.Random(derive_seed(seed, "split", r["id"])).random() < val_fraction else "train"
        texts = list(dict.fromkeys(s["text"] for s in r.get("samples") or []))   # distinct, in order
        ok = [is_correct(t, r["answer"]) for t in texts]
        right = [(k, t) for k, t in enumerate(texts) if ok[k]]
        wrong = [(k, t) for k, t in enumerate(texts) if not ok[k]]
        rng = random.Random(derive_seed(seed, "balance", r["id"]))
        m = min(len(right), len(wrong))
        for (k, t), good in [(x, True) for x in rng.sample(right, m)] + [(x, False) for x in rng.sample(wrong, m)]:
            out[name].append({"id": f"{r['id']}/{k}", "messages": verify_messages(r["prompt"], t, good),
                              "right": good})
    for name, examples in out.items():
        random.Random(derive_seed(seed, "order", name)).shuffle(examples)
    return out["train"], out["val"]


def render_verification(messages: Sequence[dict], tokenizer, max_tokens: int | None = None
                        ) -> tuple[list[int], list[bool]] | None:
    """render()'s ids with the loss on the last assistant reply only (the verdict and its <|end|>):
    the answer being judged may be wrong and must not be learned. None if truncation cuts the verdict."""
    ids, mask = render(messages, tokenizer)             # never None: the verdict is an assistant turn
    if max_tokens is not None and len(ids) > max_tokens:
        return None                                     # the verdict is the end: cutting it leaves nothing
    head, _ = render(messages[:-1] + [{"role": "assistant", "content": ""}], tokenizer)
    start = len(head) - 1                               # the reply's first token (head ends with its <|end|>)
    return ids, [m and i >= start for i, m in enumerate(mask)]


def question_ids(tokenizer) -> list[int]:
    """The ids after an answer's <|end|> that ask for the verdict: <|user|> QUESTION <|end|> <|assistant|>."""
    sp = tokenizer.special
    return [sp[ROLE_TOKENS["user"]], *tokenizer.encode(QUESTION, allowed_special="none"), sp[END],
            sp[ROLE_TOKENS["assistant"]]]


def verdict_ids(tokenizer) -> tuple[int, int]:
    """The first token of YES and of NO (they differ: checked)."""
    y, n = tokenizer.encode(YES, allowed_special="none")[0], tokenizer.encode(NO, allowed_special="none")[0]
    if y == n:
        raise ValueError(f"{YES!r} and {NO!r} start with the same token ({y}) in this tokenizer; the verifier's"
                         f" score reads the first token of its reply")
    return y, n


def verifier_scores(model, tokenizer, prompt_ids: Sequence[Sequence[int]], answers: Sequence[str], *,
                    batch_size: int, device, rt=None) -> list[float]:
    """log p(Yes) - log p(No) for each (prompt, answer): the model reads the prompt (ids ending
    with <|assistant|>), the answer and the question, and its next-token distribution is read.
    Sequences longer than the context keep their end (the question and the answer's end)."""
    import torch

    from llm.data.batching import pad_right
    from llm.data.preference import encode_response
    from llm.runtime import sharded_map

    yes, no = verdict_ids(tokenizer)
    seq_len, q = model.config.seq_len, question_ids(tokenizer)
    seqs = [(encode_response(p, a, tokenizer) + q)[-seq_len:] for p, a in zip(prompt_ids, answers)]
    order = sorted(range(len(seqs)), key=lambda j: len(seqs[j]))
    chunks = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    model.eval()

    def one(b: int) -> list[float]:
        ix = chunks[b]
        idx, mask, _ = pad_right([seqs[j] for j in ix], tokenizer.pad_id)
        last = torch.zeros_like(mask)
        last[torch.arange(len(ix)), mask.sum(1) - 1] = True          # each row's last real token
        with torch.no_grad():
            lp = torch.log_softmax(model(idx.to(device), attention_mask=mask.to(device),
                                         logits_at=last.to(device)).float(), dim=-1)
        return (lp[:, yes] - lp[:, no]).cpu().tolist()

    out = [0.0] * len(seqs)
    for ix, vals in zip(chunks, sharded_map(one, len(chunks), rt)):
        for j, v in zip(ix, vals):
            out[j] = v
    return out


def pair_accuracy(groups: Sequence[str], scores: Sequence[float], right: Sequence[bool]) -> tuple[float | None, int]:
    """(the share of (right, wrong) pairs of answers to the same problem that `scores` orders right,
    ties half; the number of pairs): the ranking a best-of-n pick needs, where an AUC
    (llm/eval/paired.py `separation`) also compares answers to different problems (an easy
    problem's answers are more often right)."""
    by: dict[str, tuple[list[float], list[float]]] = {}
    for g, s, ok in zip(groups, scores, right):
        by.setdefault(g, ([], []))[0 if ok else 1].append(s)
    total = pairs = 0.0
    for pos, neg in by.values():
        for a in pos:
            for b in neg:
                total += 1.0 if a > b else 0.5 if a == b else 0.0
                pairs += 1
    return (total / pairs if pairs else None), int(pairs)


def candidate_scores(model, tokenizer, cands: Sequence[dict], *, batch_size: int, device,
                     rt=None) -> tuple[list[list[float]], list[float]]:
    """The verifier's score of the rankers' candidates (llm/post/rankers.py `draw_candidates`):
    ([per sample] per problem, each problem's greedy answer's)."""
    texts = [[*c["samples"], c["greedy"]] for c in cands]   # the greedy answer last
    flat = verifier_scores(model, tokenizer, [c["prompt_ids"] for c, ts in zip(cands, texts) for _ in ts],
                           [t for ts in texts for t in ts], batch_size=batch_size, device=device, rt=rt)
    width = len(texts[0]) if texts else 0
    rows = [flat[i * width:(i + 1) * width] for i in range(len(texts))]
    return [r[:-1] for r in rows], [r[-1] for r in rows]
