"""bench/lm_eval_tasks: the generate-style lm-evaluation-harness task the README's command runs
against llm.serve's chat endpoint. Its data is what make.py writes, its answer filter reads the
answers the chat models are taught to write, and lm-eval (where installed) asks each question as
one user message and gets the server's greedy answer within the context."""
from __future__ import annotations

import json
import random
import re

import pytest
import yaml

from bench.lm_eval_tasks import make
from llm.data.generators import arithmetic_question, math_problem
from tests.conftest import ROOT
from llm.tools.serve import make_app
from tests.test_serve import Server, babbler, expected, tok  # noqa: F401 (tok is a fixture)

TASKS = ROOT / "bench" / "lm_eval_tasks"


def task() -> dict:
    return yaml.safe_load((TASKS / "chat_math.yaml").read_text(encoding="utf-8"))


def test_the_task_data_is_what_make_writes_with_answers_that_are_right():
    rows = [json.loads(line) for line in make.DATA.read_text(encoding="utf-8").splitlines()]
    assert rows == make.rows()  # rerun `python -m bench.lm_eval_tasks.make` after changing the generators
    assert len({r["question"] for r in rows}) == len(rows) == 24
    assert {r["lang"] for r in rows} == {"en", "zh"}
    assert {r["kind"] for r in rows} == {"word problem", "bare arithmetic"}
    for r in rows:  # a bare calculation's answer is its value (a word problem's is its generator's)
        if r["kind"] == "bare arithmetic":
            a, op, b = re.fullmatch(r"(?:What is )?(\d+) ([-+*/]) (\d+)(?:\?| 等于多少？)", r["question"]).groups()
            value = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}[op](int(a), int(b))
            assert r["answer"] == str(value), r


def test_the_task_file_is_a_generate_task_over_the_shipped_data_that_reads_the_taught_answer():
    t = task()
    assert t["task"] == "chat_math" and t["output_type"] == "generate_until"
    assert t["dataset_path"] == "json" and (ROOT / t["dataset_kwargs"]["data_files"]["test"]).resolve() == make.DATA
    gen = t["generation_kwargs"]
    assert gen["do_sample"] is False and gen["temperature"] == 0 and 0 < gen["max_gen_toks"] <= 128
    [flt] = t["filter_list"]
    regex = next(f for f in flt["filter"] if f["function"] == "regex")
    pattern, pick = re.compile(regex["regex_pattern"]), regex["group_select"]
    rng = random.Random(0)
    answers = [p.solution for p in (math_problem(rng, 2, lang) for lang in ("en", "zh"))]
    answers += [q.solution for q in (arithmetic_question(rng, lang) for lang in ("en", "zh"))]
    for solution in answers:  # the format the chat models are taught: steps, then `#### N`
        assert pattern.findall(solution)[pick] == solution.rsplit("#### ", 1)[1]
    assert pattern.findall("12 + 7 = 19\n#### 18\n#### 19")[pick] == "19"  # the last answer counts
    assert [m["metric"] for m in t["metric_list"]] == ["exact_match"]


@pytest.mark.slow
def test_lm_eval_asks_each_question_as_one_user_message_and_scores_the_servers_answer(tok, monkeypatch):
    """The whole task, as the README runs it, against a model with the pipeline's 256-token context
    and the test tokenizer (fewer merges than a real one: longer prompts): every request fits."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    model = babbler(tok, seq_len=256)
    server = Server(make_app(model, tok, model_id="sft"))
    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository
    new = task()["generation_kwargs"]["max_gen_toks"]
    try:
        results = lm_eval.simple_evaluate(
            model="local-chat-completions", tasks=["chat_math"], task_manager=TaskManager(include_path=str(TASKS)),
            model_args={"model": "sft", "base_url": server.url + "/v1/chat/completions", "num_concurrent": 1,
                        "max_retries": 1},
            apply_chat_template=True, log_samples=True,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    finally:
        server.close()
    samples = results["samples"]["chat_math"]
    assert len(samples) == 24
    right = 0
    for s in samples:
        [[answer]] = s["resps"]
        assert answer == expected(model, tok, [{"role": "user", "content": s["doc"]["question"]}], new)
        found = re.findall(r"#### (-?[0-9]+)", answer)
        right += bool(found) and found[-1] == s["doc"]["answer"]
    assert results["results"]["chat_math"]["exact_match,last-answer"] == pytest.approx(right / 24)
