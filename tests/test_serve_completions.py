"""llm.serve's legacy /v1/completions and tokenizer endpoints: the text it generates is what
llm.sample.generate gives, the log-probs it returns are the model's own full-forward ones, and
lm-evaluation-harness's `local-completions` model scores a small multiple-choice task through it.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from llm.nn.losses import token_logprobs
from llm.sample.generate import generate
from llm.tools.serve import make_app
from tests.conftest import ROOT
from tests.test_serve import Server, babbler, raw, tok  # noqa: F401 (tok is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
FIXTURES = ROOT / "tests" / "fixtures" / "lm_eval"


@pytest.fixture(scope="module")
def served(tok):
    model = babbler(tok)
    server = Server(make_app(model, tok, model_id="sft"))
    yield server, model
    server.close()


def complete(url: str, **body) -> tuple[int, dict]:
    return raw(url + "/v1/completions", json.dumps(body).encode())


def own_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1, from the model's forward and llm.nn.losses."""
    with torch.no_grad():
        x = torch.tensor([ids])
        return token_logprobs(model(x)[:, :-1], x[:, 1:])[0].tolist()


def test_echo_with_no_new_tokens_gives_the_prompts_full_forward_logprobs(served, tok):
    server, model = served
    ids = tok.encode("To be, or not to be, that is the question")
    status, body = complete(server.url, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(own_logprobs(model, ids), abs=1e-5)
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    assert all(len(t) == 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]))


def test_a_greedy_completion_is_what_generate_gives_and_its_logprobs_the_forwards(served, tok):
    server, model = served
    prompt = "Whether 'tis nobler"
    status, body = complete(server.url, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    ids = tok.encode(prompt)
    new = generate(model, [ids], 8, temperature=0.0, pad_id=tok.pad_id).responses()[0]
    choice = body["choices"][0]
    assert status == 200 and choice["text"] == tok.decode(new) and body["usage"]["completion_tokens"] == 8
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(own_logprobs(model, ids + new)[len(ids) - 1:], abs=1e-5)
    # greedy: every chosen token is its position's likeliest
    assert all(max(t.values()) == v for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == len(prompt)


def test_each_prompt_of_a_list_gets_its_own_choice(served, tok):
    server, _ = served
    prompts = ["To be", "小明有"]
    _, body = complete(server.url, prompt=prompts, max_tokens=4, temperature=0)
    alone = [complete(server.url, prompt=p, max_tokens=4, temperature=0)[1]["choices"][0]["text"] for p in prompts]
    assert [c["index"] for c in body["choices"]] == [0, 1] and [c["text"] for c in body["choices"]] == alone
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)


def test_a_stop_string_cuts_the_text_and_its_tokens(served):
    server, _ = served
    full = complete(server.url, prompt="To be", max_tokens=20, temperature=0)[1]["choices"][0]["text"]
    stop = full[6:9]
    _, body = complete(server.url, prompt="To be", max_tokens=20, temperature=0, stop=stop, logprobs=0)
    choice = body["choices"][0]
    assert choice["text"] == full[:full.index(stop)] and choice["finish_reason"] == "stop"
    offsets = choice["logprobs"]["text_offset"]  # the tokens kept are those that begin before the cut
    assert offsets and all(o < len("To be") + len(choice["text"]) for o in offsets) and len(offsets) < 20


def test_the_seed_decides_a_sample(served):
    server, _ = served
    texts = [complete(server.url, prompt="To be", max_tokens=8, seed=s)[1]["choices"][0]["text"] for s in (3, 3, 4)]
    assert texts[0] == texts[1] != texts[2]


BAD = [
    ({}, "prompt must be"),
    ({"prompt": ""}, "non-empty"),
    ({"prompt": [[]]}, "non-empty"),
    ({"prompt": [10**6]}, "token ids must be integers in [0,"),
    ({"prompt": "x", "logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens must be an integer"),
    ({"prompt": "x", "stream": True}, "stream is not supported on /v1/completions"),
    ({"prompt": "x", "n": 2}, "n: this server returns one choice"),
    ({"prompt": "x", "echo": "yes"}, "echo must be true or false"),
    ({"prompt": "x", "max_tokens": 64}, "> this model's context of 64 tokens"),
    ({"prompt": [1] * 65, "max_tokens": 0}, "> this model's context of 64 tokens"),
    ({"prompt": " " * 100_000}, "bytes of text"),
]


@pytest.mark.parametrize("body,message", BAD, ids=[m[:24] for _, m in BAD])
def test_malformed_completion_requests_are_400(served, body, message):
    status, answer = complete(served[0].url, **body)
    assert status == 400 and message in answer["error"]["message"], answer


def test_the_tokenizer_endpoints_are_the_servers_tokenizer(served, tok):
    url = served[0].url
    text = "To be <|endoftext|> 小明"
    _, info = raw(url + "/tokenizer_info")
    _, ids = raw(url + "/tokenize", json.dumps({"prompt": text, "add_special_tokens": False}).encode())
    _, back = raw(url + "/detokenize", json.dumps({"tokens": ids["tokens"]}).encode())
    assert ids["tokens"] == tok.encode(text, allowed_special="all") and back["prompt"] == text
    assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 64


@pytest.mark.slow
def test_lm_eval_scores_a_multiple_choice_task_with_the_models_own_logprobs(served, tok, monkeypatch):
    """lm-evaluation-harness's local-completions model against the running server, tokenizing
    through its /tokenize: each choice's log-likelihood equals the model's full forward."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    server, model = served
    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_choice"], task_manager=TaskManager(include_path=str(FIXTURES)),
        model_args={"model": "sft", "base_url": server.url + "/v1/completions", "tokenizer_backend": "remote",
                    "max_length": 64, "num_concurrent": 1, "max_retries": 1},
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    acc = results["results"]["tiny_choice"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["tiny_choice"]
    docs = [json.loads(line) for line in (FIXTURES / "tiny_choice.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs)
    correct = 0
    for s in samples:
        doc = s["doc"]
        context = f"Question: {doc['question']}\nAnswer:"
        mine = []
        assert len(s["resps"]) == len(doc["choices"]), s["resps"]
        for choice, resp in zip(doc["choices"], s["resps"]):
            got = float(resp[0][0])  # one (log-likelihood, is_greedy) per choice
            ctx = tok.encode(context, allowed_special="all")
            whole = tok.encode(f"{context} {choice}", allowed_special="all")  # the task's target_delimiter, " "
            want = sum(own_logprobs(model, whole)[len(ctx) - 1:])
            assert math.isclose(got, want, abs_tol=1e-5), (doc["question"], choice, got, want)
            mine.append(want)
        correct += max(range(len(mine)), key=mine.__getitem__) == doc["answer"]
    assert acc == pytest.approx(correct / len(docs))
