"""Every data set the pipeline trains and evaluates on, drawn and split: the logic of stage `prepare`.

    data, stats = build(cfg, seed)      # {kind: {split: [record, ...]}}, external sources' statistics
    check_required(data)                # every kind/split a later stage reads has records
    metrics = summarize(data, stats)    # records, characters, sources per kind/split

`cfg` is the `prepare` params section (llm.config.PrepareConfig). Records come from the
Shakespeare corpus, the sources listed in params (llm/data/sources.py) and the project's own
generators (llm/data/generators.py); the same (cfg, seed) gives the same records in the same order.
stages/prepare.py writes them and says what each file holds.

Splits share no prompt: held-out math (`rl/test`, the evaluation set) is drawn first,
then validation, and every later draw skips the questions already taken.

The two evaluation-only files come last, each from its own seeded generator, so they leave
every training record as it would be without them (`prepare.task_test` instruction tasks per
kind, `prepare.arithmetic_test` bare calculations such as "What is 7 + 5?"). After them,
`prepare.arithmetic_train` bare calculations, from a generator of their own, are appended to
sft/train, answered `7 + 5 = 12` then `#### 12` as the word problems are; none computes a
calculation the evaluation asks, in either language. Neither evaluation file holds a
prompt that a policy model trains on: a user turn of sft/train or a question of rl/train
(DPO's pairs and the RL rollouts are drawn from those two). Task prompts may coincide with
sft/val ones, which SFT only computes a loss on, and with the reward model's preference
pairs, on which no policy trains: the reverse and repeat kinds have only 60 and 90 distinct
prompts, all of them in sft/train, sft/val or prefs/train on the default profile, so a
kind's test set is whatever SFT never trained on (26 and 19 prompts there), fewer than
`task_test` where the kind runs out.

Last come two skills that are off by default (counts 0, which leave every record above as it
is): conversations of two exchanges whose second question reads the first (llm/data/generators.py
`multiturn_conversation`: "And times 2?" after a sum, a new problem after an old one, a task
after a sum), `prepare.multiturn_test` held out for the evaluation (its first three turns and
the last answer) and `prepare.multiturn_train` appended to sft/train; and requests outside the
model's skills ("Write a poem about the sea."), `prepare.scope_test` held out and
`prepare.scope_train` in sft/train, answered with a statement of what the model can do. No
held-out conversation or request opens with, or asks as a new problem, a training prompt, and
no training conversation asks a held-out math question or bare calculation.

After them, also off by default, math asked in the contexts a chat brings
(llm/data/generators.py `context_conversation`): `prepare.context_train` word problems and bare
calculations in sft/train, each after an out-of-scope request answered with the statement,
after an instruction task, or alone, under a system message for a
`prepare.context_system_share` of them and for every one asked alone. None asks a held-out
question or calculation or a user turn of the evaluation's conversations, and none opens with
an evaluation prompt (an instruction task or out-of-scope request of the test files): the
evaluation asks its own held-out questions after its own held-out requests and tasks
(llm/eval/evaluate.py `context_items`).

Then, from a generator of its own, the difficulty tiers (`tiers/test`, off at
`prepare.tier_test: 0`): that many word problems per tier, in distribution (the trained levels
below the edge), the edge (`prepare.edge_levels`, where SFT is right about half the time) and
harder (`prepare.harder_levels`, levels no stage trains on), none a question of any other file;
llm/eval/tiers.py asks them.

Last of all, off by default and from a generator of its own, the passages of the continuation
preference (llm/data/continuation.py; llm/sample/gold.py judges it): `prepare.continuation_train`
lessons in sft/train ("Continue this passage:" and two lines of verse, answered with the next
two) and `prepare.continuation_rl` prompts in continue/train, from the pretraining works, no
passage in both; `prepare.continuation_test` prompts in continue/test from the works held out of
pretraining.
"""
from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from pathlib import Path

from llm.data.generators import (TASK_KINDS, arithmetic_question, context_conversation, math_problem,
                                 multiturn_conversation, opening_exchange, paraphrase_answer, preference_pair,
                                 scope_prompt_count, scope_request, task, task_preference_pair)
from llm.data import continuation
from llm.data.sources import KIND_OF_SCHEMA, read_source, shakespeare_works
from llm.fileio import DataError

# Share of generated SFT samples re-emitted as exact duplicates / same-instruction
# paraphrases, so that clean_sft has real work on the embedded data (it reports them).
PLANTED_EXACT_DUPLICATES = 0.01
PLANTED_PARAPHRASES = 0.02


def _split_of(text: str, seed: int, val_fraction: float) -> str:
    """Deterministic train/val assignment of an external record by content hash."""
    h = int(hashlib.sha256(f"{seed}:{text}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if h < val_fraction else "train"


def _math_splits(cfg, rng: random.Random) -> dict[str, list]:
    """Disjoint test, val, train math problems (test first: it is what eval reports)."""
    taken: set[str] = set()
    out = {}
    for split, n in (("test", cfg.math_test), ("val", cfg.math_val), ("train", cfg.math_train)):
        probs = []
        attempts = 0
        while len(probs) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise DataError(f"prepare: could not draw {n} distinct {split} math problems at levels"
                                f" {cfg.math_levels}; lower prepare.math_{split}")
            level = cfg.math_levels[len(probs) % len(cfg.math_levels)]
            lang = "zh" if rng.random() < cfg.math_zh_fraction else "en"
            p = math_problem(rng, level, lang)
            if p.question in taken:
                continue
            taken.add(p.question)
            probs.append(p)
        out[split] = probs
    return out


def _eval_items(cfg, seed: int, trained: set[str]) -> tuple[dict[str, list[dict]], set[str]]:
    """The evaluation-only instruction tasks (up to cfg.task_test per kind) and bare arithmetic
    questions (cfg.arithmetic_test), none of them in `trained`, from generators seeded apart
    from the training draws; and the calculations those questions ask ("7 + 5")."""
    rng = random.Random(f"{seed}:prepare:task_test")
    tasks: list[dict] = []
    for kind in TASK_KINDS:
        seen: set[str] = set()
        attempts = 0
        while len(seen) < cfg.task_test and attempts < 50 * cfg.task_test + 1000:  # a small kind runs out
            attempts += 1
            t = task(rng, kind)
            if t.prompt in trained or t.prompt in seen:
                continue
            seen.add(t.prompt)
            tasks.append({"id": f"task-test-{len(tasks)}", "prompt": t.prompt, "answer": t.answer, "kind": kind,
                          "source": f"generated/task_{kind}"})
    questions = _bare_calculations(random.Random(f"{seed}:prepare:arithmetic_test"), cfg, "arithmetic_test",
                                   lambda q: q.question in trained, "outside the training prompts")
    arithmetic = [{"id": f"arithmetic-test-{i}", "question": q.question, "answer": str(q.answer), "op": q.op,
                   "lang": q.lang, "source": "generated/arithmetic"} for i, q in enumerate(questions)]
    return {"tasks": tasks, "arithmetic": arithmetic}, {q.expression for q in questions}


def _arithmetic_conversations(cfg, seed: int, asked: set[str]) -> list[dict]:
    """cfg.arithmetic_train distinct bare calculations as SFT conversations ("What is 7 + 5?" ->
    `7 + 5 = 12`, `#### 12`), from their own seeded generator; none computes an expression in
    `asked` (the evaluation's), in either language."""
    questions = _bare_calculations(random.Random(f"{seed}:prepare:arithmetic_train"), cfg, "arithmetic_train",
                                   lambda q: q.expression in asked, f"apart from the evaluation's {len(asked)}")
    return [{"id": f"arithmetic-train-{i}", "source": "generated/arithmetic", "messages": [
        {"role": "user", "content": q.question}, {"role": "assistant", "content": q.solution}]}
        for i, q in enumerate(questions)]


def _bare_calculations(rng: random.Random, cfg, key: str, skip, where: str) -> list:
    """`cfg.<key>` distinct bare calculations (by question) for which `skip` is false."""
    n = getattr(cfg, key)
    return _distinct(n, lambda: arithmetic_question(rng, "zh" if rng.random() < cfg.math_zh_fraction else "en"),
                     lambda q: q.question, skip,
                     f"prepare: could not draw {n} distinct bare calculations {where}; lower prepare.{key}")


def _distinct(n: int, draw, key_of, skip, error: str) -> list:
    """`n` results of `draw()`, distinct by `key_of`, for which `skip` is false, in the order drawn;
    a DataError saying `error` when 50 n + 1000 draws do not give them."""
    out, seen, attempts = [], set(), 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise DataError(error)
        x = draw()
        if key_of(x) in seen or skip(x):
            continue
        seen.add(key_of(x))
        out.append(x)
    return out


def build(cfg, seed: int) -> tuple[dict[str, dict[str, list[dict]]], dict]:
    """Every output record, by kind and split, plus read statistics of external sources.

    `cfg` is the `prepare` params section. The draws happen in this order, from generators
    seeded by `seed`; reordering them changes every record after the change."""
    rng = random.Random(f"{seed}:prepare")
    data: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    if cfg.shakespeare:
        _shakespeare(cfg, seed, data)
    eval_questions = _math(cfg, rng, data)
    _tasks(cfg, rng, data)
    _prefs(cfg, rng, data, eval_questions)
    sources_stats = _external(cfg, seed, data, eval_questions)

    # Evaluation-only items, last: what a policy model trains on is known by now.
    trained = {m["content"] for r in data["sft"]["train"] for m in r["messages"] if m["role"] == "user"}
    trained |= {r["question"] for r in data["rl"]["train"]}
    items, asked = _eval_items(cfg, seed, trained)
    for kind, recs in items.items():
        data[kind]["test"] = recs
    # Bare calculations for SFT, after the evaluation's: they skip its calculations, which stay
    # what they would be without them.
    data["sft"]["train"] += _arithmetic_conversations(cfg, seed, asked)
    # Two-exchange conversations and out-of-scope requests, each from generators of their own:
    # at their default counts (0) they draw nothing, and at any count they change no record above.
    trained |= {m["content"] for r in data["sft"]["train"] for m in r["messages"] if m["role"] == "user"}
    prompts = {t["prompt"] for t in items["tasks"]} | {q["question"] for q in items["arithmetic"]}
    data["multiturn"]["test"], train = _multiturn(cfg, seed, trained, asked | eval_questions, prompts)
    data["sft"]["train"] += train
    opened = {m["content"] for c in data["multiturn"]["test"] for m in c["messages"] if m["role"] == "user"}
    data["scope"]["test"], train = _scope(cfg, seed, trained, asked | eval_questions | opened)
    data["sft"]["train"] += train
    # Math after another request or under a system message, last and from its own generator.
    requests = {r["prompt"] for r in data["scope"]["test"]} | {t["prompt"] for t in items["tasks"]}
    data["sft"]["train"] += _context(cfg, seed, asked | eval_questions | opened | prompts, requests)
    # The difficulty tiers, last of all and from their own generator: they change no record above.
    trained |= {m["content"] for r in data["sft"]["train"] for m in r["messages"] if m["role"] == "user"}
    data["tiers"]["test"] = _tiers(cfg, seed, trained | eval_questions | asked)
    # The continuation preference's passages, after everything else, from their own generator.
    _continuation(cfg, seed, data)
    return data, {"sources": sources_stats}


def tier_levels(cfg) -> dict[str, list[int]]:
    """The levels of each difficulty tier: the trained levels not at the edge, the edge, and the
    harder levels that nothing trains on."""
    return {"in_distribution": [lv for lv in cfg.math_levels if lv not in cfg.edge_levels],
            "edge": list(cfg.edge_levels), "harder": list(cfg.harder_levels)}


def _tiers(cfg, seed: int, held_out: set[str]) -> list[dict]:
    """cfg.tier_test evaluation-only word problems per tier (`tier_levels`; the levels of a tier
    in turn, cfg.math_zh_fraction in Chinese), distinct, none a question in `held_out` (every
    training question and the other evaluation sets' questions)."""
    rng = random.Random(f"{seed}:prepare:tiers")
    out: list[dict] = []
    taken = set(held_out)
    for tier, levels in tier_levels(cfg).items():
        drawn, attempts = 0, 0
        while drawn < cfg.tier_test:
            attempts += 1
            if attempts > 50 * cfg.tier_test + 1000:
                raise DataError(f"prepare: could not draw {cfg.tier_test} distinct unseen problems at levels {levels}"
                                f" for the {tier} tier; lower prepare.tier_test")
            level = levels[drawn % len(levels)]
            p = math_problem(rng, level, "zh" if rng.random() < cfg.math_zh_fraction else "en")
            if p.question in taken:
                continue
            taken.add(p.question)
            out.append({"id": f"tier-{tier}-{drawn}", "question": p.question, "answer": str(p.answer),
                        "level": p.level, "lang": p.lang, "tier": tier, "source": "generated/math"})
            drawn += 1
    return out


def _context(cfg, seed: int, held_out: set[str], eval_requests: set[str]) -> list[dict]:
    """cfg.context_train SFT conversations that ask a math question after another exchange or
    under a system message (llm/data/generators.py `context_conversation`), distinct by their
    system and user turns; none asks a question or calculation in `held_out` (the evaluation's
    math, bare calculations and conversation turns) or opens with a request in `eval_requests`
    (the evaluation's instruction tasks and out-of-scope requests)."""
    rng = random.Random(f"{seed}:prepare:context_train")
    n = cfg.context_train
    convs = _distinct(n, lambda: context_conversation(rng, "zh" if rng.random() < cfg.math_zh_fraction else "en",
                                                      system_share=cfg.context_system_share,
                                                      levels=tuple(cfg.math_levels),
                                                      verse=cfg.continuation_train > 0),
                      lambda c: tuple(m["content"] for m in c.messages if m["role"] != "assistant"),
                      lambda c: c.question in held_out or c.expression in held_out or c.opening_prompt in eval_requests,
                      f"prepare: could not draw {n} distinct conversations for prepare.context_train; lower it")
    return [{"id": f"context-train-{i}", "source": f"generated/context_{c.opening}", "messages": list(c.messages)}
            for i, c in enumerate(convs)]


def _multiturn(cfg, seed: int, trained: set[str], held_out: set[str], eval_prompts: set[str]
               ) -> tuple[list[dict], list[dict]]:
    """cfg.multiturn_test evaluation conversations (the first three turns, and the last turn's
    answer) whose first question, and second when it is a word problem, is no training prompt;
    then cfg.multiturn_train SFT conversations that share no such question with them, ask no
    question or calculation in `held_out` (the evaluation's math and bare calculations) and have
    no user turn among `eval_prompts` (the evaluation's instruction tasks and bare calculations,
    word for word: a task after a sum asks a task prompt in its second turn)."""
    test, test_questions = [], set()
    for i, c in enumerate(_conversations(cfg, seed, "multiturn_test", lambda c: bool(_asked(c) & trained))):
        test_questions |= _asked(c)
        test.append({"id": f"multiturn-test-{i}", "messages": list(c.messages[:3]), "answer": c.answer,
                     "kind": c.kind, "lang": c.lang, "source": "generated/multiturn"})
    train = [{"id": f"multiturn-train-{i}", "source": "generated/multiturn", "messages": list(c.messages)}
             for i, c in enumerate(_conversations(
                 cfg, seed, "multiturn_train",
                 lambda c: bool(_asked(c) & test_questions or (_asked(c) | set(c.expressions)) & held_out
                                or _user_turns(c) & eval_prompts)))]
    return test, train


def _user_turns(c) -> set[str]:
    return {m["content"] for m in c.messages if m["role"] == "user"}


def _asked(c) -> set[str]:
    """The questions of a conversation that are prompts in their own right: the first, and the
    second unless it only reads the first (a follow-up) or is an instruction task."""
    return {c.messages[0]["content"]} | ({c.messages[2]["content"]} if c.kind == "new_problem" else set())


def _conversations(cfg, seed: int, key: str, skip) -> list:
    """`cfg.<key>` two-exchange conversations, distinct by their user turns, for which `skip` is false."""
    rng = random.Random(f"{seed}:prepare:{key}")
    n = getattr(cfg, key)
    return _distinct(n, lambda: multiturn_conversation(rng, "zh" if rng.random() < cfg.math_zh_fraction else "en",
                                                       levels=tuple(cfg.math_levels)),
                     lambda c: (c.messages[0]["content"], c.messages[2]["content"]), skip,
                     f"prepare: could not draw {n} distinct conversations for prepare.{key}; lower it")


def _scope(cfg, seed: int, trained: set[str], held_out: set[str] = frozenset()) -> tuple[list[dict], list[dict]]:
    """cfg.scope_test requests outside the model's skills, none a training prompt, then
    cfg.scope_train others as SFT conversations answered with what the model can do (the list
    names continuing verse where SFT learns it: prepare.continuation_train above 0). A
    cfg.scope_second_turn share of each is asked after a first exchange (`opening_exchange`: a
    sum or word problem, answered), whose question and calculation are none in `held_out` (the
    evaluation's questions and calculations, and the user turns of its conversations); the
    test records carry it as "history". The openings draw from a generator of their own, so the
    requests are those drawn without them."""
    rng = random.Random(f"{seed}:prepare:scope")
    opening_rng = random.Random(f"{seed}:prepare:scope:opening")
    drawn: dict[str, list] = {}
    taken = set(trained)
    for key in ("scope_test", "scope_train"):
        n = getattr(cfg, key)
        drawn[key] = _distinct(n, lambda: scope_request(rng, "zh" if rng.random() < cfg.math_zh_fraction else "en",
                                                        verse=cfg.continuation_train > 0),
                               lambda r: r.prompt, lambda r: r.prompt in taken,
                               f"prepare: could not draw {n} distinct requests for prepare.{key} (there are"
                               f" {scope_prompt_count('en')} English and {scope_prompt_count('zh')} Chinese ones"
                               f" for scope_test and scope_train together); lower it")
        taken |= {r.prompt for r in drawn[key]}

    def opening(lang: str) -> list[dict]:
        if opening_rng.random() >= cfg.scope_second_turn:
            return []
        while True:
            messages, expr = opening_exchange(opening_rng, lang, levels=tuple(cfg.math_levels))
            if messages[0]["content"] not in held_out and expr not in held_out:
                return list(messages)

    test = []
    for i, r in enumerate(drawn["scope_test"]):
        history = opening(r.lang)
        test.append({"id": f"scope-test-{i}", "prompt": r.prompt, "answer": r.answer, "lang": r.lang,
                     "source": "generated/scope", **({"history": history} if history else {})})
    train = [{"id": f"scope-train-{i}", "source": "generated/scope", "messages": [
        *opening(r.lang), {"role": "user", "content": r.prompt}, {"role": "assistant", "content": r.answer}]}
        for i, r in enumerate(drawn["scope_train"])]
    return test, train


def _shakespeare(cfg, seed: int, data: dict) -> None:
    """Pretraining text: whole works, `cfg.shakespeare_val_works` of them held out."""
    works = shakespeare_works()
    names = sorted(n for n, _ in works)
    if cfg.shakespeare_val_works >= len(names):
        raise DataError(f"prepare.shakespeare_val_works={cfg.shakespeare_val_works} leaves no training"
                        f" text ({len(names)} works)")
    val_names = _held_out_works(cfg, seed, names)
    for name, text in works:
        data["pretrain"]["val" if name in val_names else "train"].append(
            {"text": text, "source": f"shakespeare/{name}"})


def _held_out_works(cfg, seed: int, names: list[str]) -> set[str]:
    """The Shakespeare works held out of pretraining (pretrain/val), from `names` sorted."""
    return set(random.Random(f"{seed}:shakespeare").sample(names, cfg.shakespeare_val_works))


def _continuation(cfg, seed: int, data: dict) -> None:
    """The continuation preference's passages (llm/data/continuation.py), from a generator of its
    own: cfg.continuation_train lessons in sft/train (the real next lines as the answer) and
    cfg.continuation_rl prompts in continue/train (the samples' and PPO's), from the pretraining
    works, no passage in both; cfg.continuation_test prompts in continue/test from the works
    held out of pretraining (no model trains on those works' text)."""
    wanted = cfg.continuation_train + cfg.continuation_rl + cfg.continuation_test
    if not wanted:
        return
    if not cfg.shakespeare:
        raise DataError("prepare.continuation_*: the passages to continue come from the Shakespeare corpus;"
                        " set prepare.shakespeare: true or the continuation counts to 0")
    works = shakespeare_works()
    held_out = _held_out_works(cfg, seed, sorted(n for n, _ in works))
    windows = {split: [(name, p, a) for name, text in works if (name in held_out) == (split == "test")
                       for p, a in continuation.passages(text)] for split in ("train", "test")}
    rng = random.Random(f"{seed}:prepare:continuation")
    lessons = cfg.continuation_train + cfg.continuation_rl
    trained = continuation.draw(windows["train"], lessons, rng)
    # a few lines stand in more than one work (Love's Labour's Lost and The Passionate Pilgrim):
    # no held-out passage or continuation holds a line of a pretraining work's window
    seen = {line for _, p, a in windows["train"] for line in (p + "\n" + a).split("\n")}
    test = continuation.draw([w for w in windows["test"] if not set((w[1] + "\n" + w[2]).split("\n")) & seen],
                             cfg.continuation_test, rng)
    if len(trained) < lessons or len(test) < cfg.continuation_test:
        raise DataError(f"prepare: {len(windows['train'])} passages in the pretraining works and"
                        f" {len(windows['test'])} in the held-out ones; continuation_train + continuation_rl ="
                        f" {lessons} and continuation_test = {cfg.continuation_test} ask for more: lower them")
    for i, (work, passage, answer) in enumerate(trained[:cfg.continuation_train]):
        data["sft"]["train"].append({"id": f"continue-sft-{i}", "source": CONTINUATION_SOURCE, "messages": [
            {"role": "user", "content": continuation.continuation_prompt(passage)},
            {"role": "assistant", "content": answer}]})
    for split, items in (("train", trained[cfg.continuation_train:]), ("test", test)):
        data["continue"][split] = [{"id": f"continue-{split}-{i}", "prompt": continuation.continuation_prompt(p),
                                    "passage": p, "reference": a, "source": f"shakespeare/{work}"}
                                   for i, (work, p, a) in enumerate(items)]


def _math(cfg, rng: random.Random, data: dict) -> set[str]:
    """Math documents for pretraining, then RL prompts and SFT conversations from the same
    disjoint splits; returns the held-out (test and val) questions, which nothing trains on."""
    math = _math_splits(cfg, rng)
    eval_questions = {p.question for p in math["test"]} | {p.question for p in math["val"]}
    for i in range(cfg.math_pretrain_docs):
        level = cfg.math_levels[i % len(cfg.math_levels)]
        p = math_problem(rng, level, "zh" if rng.random() < cfg.math_zh_fraction else "en")
        if p.question in eval_questions:
            continue
        data["pretrain"]["train"].append({"text": f"Question: {p.question}\nAnswer: {p.solution}",
                                          "source": "generated/math"})
    for split, probs in math.items():
        for i, p in enumerate(probs):
            rid = f"math-{split}-{i}"
            data["rl"][split].append({"id": rid, "question": p.question, "answer": str(p.answer),
                                      "level": p.level, "lang": p.lang, "source": "generated/math"})
            if split != "test":
                data["sft"][split].append({"id": rid, "source": f"generated/math_{p.lang}", "messages": [
                    {"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}]})
    return eval_questions


def _tasks(cfg, rng: random.Random, data: dict) -> None:
    """Instruction tasks as SFT conversations (prompts already used for val are not reused for
    train), of kinds drawn evenly or in the shares of `task_weights`. A kind with few distinct
    prompts (reverse, repeat) runs out early and leaves its share to the others. A few training
    conversations are planted again as duplicates and paraphrases for clean_sft to find."""
    seen_tasks: set[str] = set()
    weights = cfg.task_weights or None  # None: one `rng.choice`, as runs before the key drew (same bytes)
    for split, n in (("val", cfg.task_val), ("train", cfg.task_train)):
        count, attempts = 0, 0
        while count < n and attempts < 50 * n + 1000:
            attempts += 1
            t = task(rng, rng.choices(TASK_KINDS, weights)[0] if weights else None)
            if t.prompt in seen_tasks:
                continue
            seen_tasks.add(t.prompt)
            rec = {"id": f"task-{split}-{count}", "source": f"generated/task_{t.kind}", "messages": [
                {"role": "user", "content": t.prompt}, {"role": "assistant", "content": t.answer}]}
            data["sft"][split].append(rec)
            count += 1
            if split == "train":
                r = rng.random()
                if r < PLANTED_EXACT_DUPLICATES:
                    data["sft"][split].append({**rec, "id": rec["id"] + "-dup"})
                elif r < PLANTED_EXACT_DUPLICATES + PLANTED_PARAPHRASES:
                    data["sft"][split].append({**rec, "id": rec["id"] + "-para", "messages": [
                        rec["messages"][0],
                        {"role": "assistant", "content": paraphrase_answer(rng, t.answer)}]})
        if count < n:
            raise DataError(f"prepare.task_{split}={n}: only {count} distinct task prompts could be drawn (the kinds"
                            f" weighted in prepare.task_weights have too few); lower it, or weight other kinds")


def _prefs(cfg, rng: random.Random, data: dict, eval_questions: set[str]) -> None:
    """Preference pairs: 3 math pairs for each task pair; never on an eval question."""
    for split, n in (("val", cfg.pref_val), ("train", cfg.pref_train)):
        count = 0
        while count < n:
            if count % 4 == 3:
                pair = task_preference_pair(rng)
            else:
                level = cfg.math_levels[count % len(cfg.math_levels)]
                lang = "zh" if rng.random() < cfg.math_zh_fraction else "en"
                pair = preference_pair(rng, level, lang, cfg.pref_broken_format_fraction)
            if pair["prompt"][0]["content"] in eval_questions:
                continue
            data["prefs"][split].append({"id": f"pref-{split}-{count}", "source": "generated/prefs", **pair})
            count += 1


def _external(cfg, seed: int, data: dict, eval_questions: set[str]) -> list[dict]:
    """The sources listed in params, split by content hash; returns their read statistics.
    `math_test_sources` (GSM8K's test split) are read first: their problems go to rl/test after
    the generated ones and join `eval_questions`, so that no other source trains on them."""
    sources_stats = []
    sources = [(True, src) for src in cfg.math_test_sources] + [
        (False, src) for group in (cfg.pretrain_sources, cfg.sft_sources, cfg.pref_sources) for src in group]
    for is_test, src in sources:
        records, stats = read_source(src, cfg.on_bad_record, cfg.max_bad_fraction)
        name = src.path or f"hub:{src.hub}"
        stats["schema"] = src.schema
        sources_stats.append(stats)
        kind = KIND_OF_SCHEMA[src.schema]
        for i, rec in enumerate(records):
            key = rec.get("text") or str(rec.get("messages") or rec.get("prompt"))
            if src.schema == "gsm8k" and rec["question"] in eval_questions:
                continue
            rid = f"{Path(name).stem}-{'test-' if is_test else ''}{i}"
            if is_test:
                eval_questions.add(rec["question"])
                data["rl"]["test"].append({"id": rid, "question": rec["question"], "answer": rec["answer"],
                                           "level": 0, "lang": "en", "source": name})
                continue
            split = _split_of(key, seed, cfg.val_fraction)
            if kind == "pretrain":
                data["pretrain"][split].append({"text": rec["text"], "source": name})
            elif kind == "sft":
                data["sft"][split].append({"id": rid, "messages": rec["messages"], "source": name})
                if src.schema == "gsm8k":
                    data["rl"][split].append({"id": rid, "question": rec["question"], "answer": rec["answer"],
                                              "level": 0, "lang": "en", "source": name})
            else:
                data["prefs"][split].append({"id": rid, "prompt": rec["prompt"], "chosen": rec["chosen"],
                                             "rejected": rec["rejected"], "kind": "external", "source": name})
    return sources_stats


# What the stage writes: kind -> splits. The evaluation-only files may be empty (eval then skips them).
REQUIRED = {"pretrain": ("train", "val"), "sft": ("train", "val"), "prefs": ("train", "val"),
            "rl": ("train", "val", "test")}
EVALUATION_ONLY = {"tasks": ("test",), "arithmetic": ("test",), "multiturn": ("test",), "scope": ("test",),
                   "tiers": ("test",)}
# The continuation preference's prompts (RL and evaluation), empty at their default counts (0).
CONTINUATION = {"continue": ("train", "test")}
WRITTEN = {**REQUIRED, **EVALUATION_ONLY, **CONTINUATION}
CONTINUATION_SOURCE = continuation.SOURCE


def check_required(data: dict[str, dict[str, list[dict]]]) -> None:
    """A DataError naming the first required kind/split that has no record."""
    for kind, splits in REQUIRED.items():
        for split in splits:
            if not data[kind][split]:
                raise DataError(f"no {kind}/{split} records: raise the matching prepare.* count in params.yaml"
                                f" or add a source")


def summarize(data: dict[str, dict[str, list[dict]]], stats: dict) -> dict:
    """The metrics: records, characters and records per source of every kind/split, and the
    external sources' read statistics."""
    metrics: dict = {"records": {}, "chars": {}, "by_source": {}, **stats}
    for kind, splits in WRITTEN.items():
        for split in splits:
            recs = data[kind][split]
            if kind in CONTINUATION and not recs:
                continue  # off (the default): the metrics stay what they were before the preference existed
            metrics["records"][f"{kind}/{split}"] = len(recs)
            metrics["chars"][f"{kind}/{split}"] = sum(map(_chars, recs))
            by_src: dict[str, int] = defaultdict(int)
            for r in recs:
                src = r["source"]
                by_src["shakespeare" if src.startswith("shakespeare/") else src] += 1
            metrics["by_source"][f"{kind}/{split}"] = dict(sorted(by_src.items()))
    metrics["bad_records"] = sum(s["bad"] for s in stats["sources"])
    return metrics


def _chars(rec: dict) -> int:
    if "text" in rec:
        return len(rec["text"])
    if "prompt" in rec and isinstance(rec["prompt"], str):  # an instruction task or an out-of-scope request
        return len(rec["prompt"])
    if "messages" in rec:
        return sum(len(m["content"]) for m in rec["messages"])
    if "question" in rec:
        return len(rec["question"])
    return sum(len(m["content"]) for m in rec["prompt"]) + len(rec["chosen"]) + len(rec["rejected"])
