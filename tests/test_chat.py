"""llm/tools/chat.py's terminal chat: flags, commands, piped JSON Lines, Ctrl-C, context, bad input.

Most tests call main() in this process with a fake stdin; the slow ones run
`python -m llm.chat` as a subprocess (real stdin bytes) and inside tmux (a real terminal,
a real Ctrl-C).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from llm.config import ModelConfig
from llm.data.template import render, render_prompt
from llm.data.tokenizer import Tokenizer
from llm.nn.artifacts import save_model_dir
from llm.nn.model import GPT
from llm.sample.generate import generate
from llm.tools.chat import COMMANDS, Chat, TextStream, _parser, main, run_command
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ["To be, or not to be, that is the question: 12 + 7 = 19\n#### 19",
        "Whether 'tis nobler in the mind to suffer the slings and arrows", "小明有 3 个苹果。"] * 5


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(TEXT, vocab_size=300, min_frequency=1, jieba=False)


def babbler(tok: Tokenizer, seq_len: int, seed: int = 6) -> GPT:
    """A random model that never ends its answer: every special token scores 0 while the best of
    the ~290 random ordinary logits is above 0, so greedy answers always run to the length limit."""
    m = GPT(ModelConfig(vocab_size=tok.vocab_size, seq_len=seq_len, n_layer=2, n_head=4, n_kv_head=4,
                        n_embd=32, tie_embeddings=False), seed=seed)
    with torch.no_grad():
        m.lm_head.weight[tok.n_base:] = 0.0
    return m.eval()


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "sft"
    save_model_dir(path, babbler(tok, 64), tok, {"stage": "sft"})
    return path


class FakeTerminal:
    """stdin of a terminal: input() reads it with readline(); an exception in `lines` is raised there."""

    def __init__(self, *lines):
        self.lines = list(lines)

    def isatty(self) -> bool:
        return True

    def readline(self) -> str:
        if not self.lines:
            return ""  # Ctrl-D
        item = self.lines.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item + "\n"


def piped(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def greedy(tok, model_dir, messages, n):
    from llm.nn.artifacts import load_model_dir
    m, _, _ = load_model_dir(model_dir)
    out = generate(m, [render_prompt(messages, tok)], n, temperature=0.0, pad_id=tok.pad_id,
                   stop_ids=(tok.special["<|end|>"], tok.special["<|endoftext|>"]))
    return tok.decode(out.responses()[0])


# ---------------------------------------------------------------------------
# flags


def test_help_shows_the_default_of_every_flag():
    ap = _parser()
    flags = [a for a in ap._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in flags} >= {"temperature", "top_k", "top_p", "max_new_tokens", "prompt", "device"}
    for a in flags:
        assert "default" in (a.help or ""), f"{a.option_strings[0]} does not say its default"


@pytest.mark.parametrize("flag,value,why", [
    ("--temperature", "nan", "finite"), ("--temperature", "-1", "finite"), ("--temperature", "1e-320", "finite"),
    ("--temperature", "warm", "a number"), ("--top-p", "0", "top_p"), ("--top-p", "1.5", "top_p"),
    ("--top-p", "nan", "top_p"), ("--top-k", "-1", "top_k"), ("--top-k", "2.5", "an integer"),
    ("--max-new-tokens", "0", ">= 1"), ("--device", "toaster", "not a torch device"),
    ("--seed", "-1", "[0, 2**64 - 1]"), ("--seed", str(2 ** 64), "[0, 2**64 - 1]"), ("--seed", "x", "an integer"),
    ("--prompt", "caf\udce9", "not valid UTF-8 (byte b'\\xe9' at offset 3)"),
    ("--system", "\udcff", "not valid UTF-8 (byte b'\\xff' at offset 0)")])
def test_bad_flags_exit_2_naming_the_flag_and_the_reason(model_dir, capsys, flag, value, why):
    with pytest.raises(SystemExit) as e:
        main([str(model_dir), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and why in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(model_dir), "--device", "cuda"])
    assert e.value.code == 2
    assert "--device: cuda:" in capsys.readouterr().err


def test_max_new_tokens_must_leave_room_for_the_conversation(model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(model_dir), "--max-new-tokens", "64"])
    assert e.value.code == 2
    assert "at most 63" in capsys.readouterr().err


def test_a_missing_model_directory_is_reported_without_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nothing"), "--prompt", "hi"])
    assert e.value.code == 1 and "no model directory" in capsys.readouterr().err


def test_a_tokenizer_directory_is_named_as_such_with_the_model_directories_beside_it(tok, model_dir, capsys):
    """`python -m llm.chat models/tokenizer`: the error says what the directory is and which to pass."""
    tok.save(model_dir.parent / "tokenizer")
    with pytest.raises(SystemExit) as e:
        main([str(model_dir.parent / "tokenizer"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "a tokenizer directory" in err and "re-run" not in err
    assert f"pass a model directory: {model_dir}" in err


# ---------------------------------------------------------------------------
# one-shot and piped


def test_one_shot_prompt_prints_the_greedy_answer(tok, model_dir, capsys):
    assert main([str(model_dir), "--prompt", "What is 12 + 7?", "--temperature", "0",
                 "--max-new-tokens", "20"]) == 0
    want = greedy(tok, model_dir, [{"role": "user", "content": "What is 12 + 7?"}], 20)
    assert want and capsys.readouterr().out == want + "\n"


def test_piped_output_is_one_json_object_per_user_turn(model_dir, monkeypatch, capsys):
    piped(monkeypatch, "first\n\nsecond line\n  \nthird: 小明\n".encode())
    assert main([str(model_dir), "--temperature", "0", "--max-new-tokens", "10"]) == 0
    recs = records(capsys.readouterr().out)
    assert [(r["line"], r["user"]) for r in recs] == [(1, "first"), (3, "second line"), (5, "third: 小明")]
    assert all(r["finish"] == "length" and isinstance(r["assistant"], str) for r in recs)


def test_sampling_is_reproducible_for_a_seed(model_dir, monkeypatch, capsys):
    answers = []
    for seed in ("1", "1", "2"):
        piped(monkeypatch, b"hello\nagain\n")
        assert main([str(model_dir), "--seed", seed, "--temperature", "1", "--top-k", "50",
                     "--top-p", "0.9", "--max-new-tokens", "12"]) == 0
        answers.append([r["assistant"] for r in records(capsys.readouterr().out)])
    assert answers[0] == answers[1] != answers[2]


def test_commands_and_unknown_commands_never_reach_the_model(model_dir, monkeypatch, capsys):
    piped(monkeypatch, b"/help\n/tmp 0\n/temp nan\n/temp 1e-320\n/temp 0\n/reset\nhi\n/quit\nnever read\n")
    assert main([str(model_dir), "--max-new-tokens", "5"]) == 0
    cap = capsys.readouterr()
    assert [r["user"] for r in records(cap.out)] == ["hi"]
    assert "unknown command /tmp; nothing was sent to the model" in cap.err
    assert cap.err.count("/temp: temperature must be 0 (greedy) or a finite number") == 2
    assert "(temperature 0.0)" in cap.err and "(conversation reset)" in cap.err
    assert all(c.split()[0] in cap.err for c in COMMANDS)


def test_temp_command_refuses_nan_and_subnormal_and_keeps_the_temperature(tok, model_dir):
    from llm.nn.artifacts import load_model_dir
    chat = Chat(load_model_dir(model_dir)[0], tok, temperature=0.5)
    for bad in ("nan", "inf", "1e-320", "-1", "warm", ""):
        assert "0.5" in run_command(chat, f"/temp {bad}") or "usage" in run_command(chat, f"/temp {bad}")
        assert chat.temperature == 0.5
    run_command(chat, "/temp 0")
    assert chat.temperature == 0.0


def test_a_double_slash_sends_a_line_that_starts_with_a_slash(model_dir, monkeypatch, capsys):
    piped(monkeypatch, b"//etc/passwd\n")
    assert main([str(model_dir), "--max-new-tokens", "3"]) == 0
    assert [r["user"] for r in records(capsys.readouterr().out)] == ["/etc/passwd"]


def test_a_line_that_is_not_utf8_is_reported_and_the_chat_goes_on(model_dir, monkeypatch, capsys):
    piped(monkeypatch, b"hello\nbad \xff byte\nstill here\n")
    assert main([str(model_dir), "--max-new-tokens", "3"]) == 0
    recs = records(capsys.readouterr().out)
    assert [r.get("user") for r in recs] == ["hello", None, "still here"]
    assert recs[1]["line"] == 2 and "not valid UTF-8" in recs[1]["error"] and "xff" in recs[1]["error"]


def test_a_long_conversation_forgets_its_earliest_turns_instead_of_refusing(model_dir, monkeypatch, capsys):
    """The default answer length is half the context: every turn is answered in full, however many."""
    piped(monkeypatch, b"".join(b"turn %d\n" % i for i in range(8)))
    assert main([str(model_dir), "--temperature", "0"]) == 0
    cap = capsys.readouterr()
    recs = records(cap.out)
    assert len(recs) == 8 and all("error" not in r and r["finish"] == "length" for r in recs)
    assert "forgot the 2 earliest messages" in cap.err


def test_the_history_keeps_the_system_message_and_whole_exchanges(tok, model_dir):
    from llm.nn.artifacts import load_model_dir
    chat = Chat(load_model_dir(model_dir)[0], tok, system="Be brief.", temperature=0.0, max_new_tokens=20)
    for i in range(4):
        chat.reply(f"question {i}")
        assert len(render_prompt(chat.history[:-1], tok)) + 20 <= 64
    assert chat.history[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in chat.history[1:]] == ["user", "assistant"] * ((len(chat.history) - 1) // 2)
    assert chat.history[-2]["content"] == "question 3"


def test_a_refused_message_leaves_the_conversation_as_it_was(tok, model_dir):
    from llm.data.template import ContextError
    from llm.nn.artifacts import load_model_dir
    chat = Chat(load_model_dir(model_dir)[0], tok, system="Be brief.", temperature=0.0, max_new_tokens=8)
    chat.reply("hi")
    before = list(chat.history)
    with pytest.raises(ContextError, match="tokens and the model's context is 64"):
        chat.reply("x " * 80)
    assert chat.history == before


def test_fit_context_drops_the_fewest_earliest_exchanges_and_counts_as_the_template_does(tok):
    """What is kept renders to the length fit_context counted, leaves the answer its room, and
    keeping one more exchange would not: the fewest messages go, oldest first, never the system one."""
    from llm.data.template import fit_context

    def count(text):
        return len(tok.encode(text, allowed_special="none"))

    conv = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        conv += [{"role": "user", "content": f"question {i} about the slings"},
                 {"role": "assistant", "content": f"answer {i}: 12 + 7 = 19"}]
    conv.append({"role": "user", "content": "the last one"})
    for answer in (1, 20, 40):
        kept, forgotten = fit_context(conv, count, 64, answer)
        assert kept[0] == conv[0] and kept[1]["role"] == "user" and kept[1:] == conv[1 + forgotten:]
        assert forgotten > 0 and forgotten % 2 == 0 and len(render_prompt(kept, tok)) + answer <= 64
        one_more = [conv[0], *conv[forgotten - 1:]]
        assert len(render_prompt(one_more, tok)) + answer > 64
    assert fit_context(conv[:3], count, 64, 8) == (conv[:3], 0)  # what fits is sent whole


def test_a_message_longer_than_the_context_is_refused_with_its_length(tok, model_dir, monkeypatch, capsys):
    piped(monkeypatch, b"hi\n" + b"x " * 80 + b"\nshort\n")
    assert main([str(model_dir), "--max-new-tokens", "3"]) == 0
    recs = records(capsys.readouterr().out)
    assert [r.get("user", "")[:3] for r in recs] == ["hi", "x x", "sho"]
    assert "tokens and the model's context is 64 tokens" in recs[1]["error"]
    n = len(render_prompt([{"role": "user", "content": ("x " * 80).strip()}], tok))
    assert f"a prompt of {n} tokens" in recs[1]["error"]


# ---------------------------------------------------------------------------
# a terminal: Ctrl-C, Ctrl-D, what is shown


def interrupt_after(monkeypatch, n: int) -> None:
    """Ctrl-C arrives while the n-th token of an answer is being shown."""
    push, calls = TextStream.push, [0]

    def push_then_interrupt(self, token_id):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return push(self, token_id)

    monkeypatch.setattr(TextStream, "push", push_then_interrupt)


def test_ctrl_c_mid_answer_keeps_the_part_shown_as_the_answer(tok, model_dir, monkeypatch):
    from llm.nn.artifacts import load_model_dir
    chat = Chat(load_model_dir(model_dir)[0], tok, temperature=0.0, max_new_tokens=20)
    shown = []
    interrupt_after(monkeypatch, 6)
    reply = chat.reply("hello", on_text=shown.append)
    assert reply.finish == "interrupted" and reply.text == "".join(shown)
    assert chat.history == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply.text}]
    full = greedy(tok, model_dir, [{"role": "user", "content": "hello"}], 20)
    assert reply.text and full.startswith(reply.text) and len(reply.text) < len(full)


def test_in_a_terminal_ctrl_c_mid_answer_returns_to_the_prompt(model_dir, monkeypatch, capsys):
    interrupt_after(monkeypatch, 4)
    monkeypatch.setattr(sys, "stdin", FakeTerminal("hello", "/help", "again"))
    assert main([str(model_dir), "--temperature", "0", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2 and out.count(" [interrupted]") == 1
    assert out.index(" [interrupted]") < out.index("commands:") < out.rindex("assistant> ")


@pytest.mark.parametrize("key", [KeyboardInterrupt(), EOFError()], ids=["ctrl-c", "ctrl-d"])
def test_in_a_terminal_ctrl_c_or_ctrl_d_at_the_prompt_exits_0(model_dir, monkeypatch, capsys, key):
    monkeypatch.setattr(sys, "stdin", FakeTerminal("hello", key, "never read"))
    assert main([str(model_dir), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.count("assistant> ") == 1


def test_in_a_terminal_unknown_commands_get_the_list(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", FakeTerminal("/tmp 0", "/quit", "never read"))
    assert main([str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "unknown command /tmp" in out and "/reset" in out and "assistant> " not in out


def test_in_a_terminal_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(model_dir, monkeypatch, capsys):
    """main() reads a terminal with errors="surrogateescape": a bad byte arrives as U+DCxx."""
    monkeypatch.setattr(sys, "stdin", FakeTerminal("caf\udce9", "hello"))
    assert main([str(model_dir), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "not valid UTF-8" in out and out.count("assistant> ") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_sampled_turn_runs_and_is_reproducible(model_dir, monkeypatch, capsys):
    answers = []
    for _ in range(2):
        piped(monkeypatch, b"hello\n")
        assert main([str(model_dir), "--device", "cuda", "--temperature", "1", "--max-new-tokens", "8"]) == 0
        answers.append(records(capsys.readouterr().out)[0]["assistant"])
    assert answers[0] == answers[1]


def test_in_a_terminal_control_characters_of_an_answer_are_shown_escaped(tok, model_dir, monkeypatch, capsys):
    esc = tok.encode("\x1b[2J")  # clear screen
    monkeypatch.setattr(TextStream, "push", lambda self, t, p=TextStream.push: p(self, esc[0]) + p(self, esc[1]))
    monkeypatch.setattr(sys, "stdin", FakeTerminal("hello"))
    assert main([str(model_dir), "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "\\x1b[" in out and "\x1b" not in out


def test_text_stream_never_shows_half_a_character(tok):
    text = "小明有 3 个苹果。 café"
    ids = [b for b in text.encode()]  # one byte per token: every multi-byte character arrives in pieces
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids + [tok.special["<|end|>"]]] + [stream.flush()]
    assert "".join(pieces) == text == stream.text and not any("\ufffd" in p for p in pieces)


# ---------------------------------------------------------------------------
# the real program


def run_chat(args, stdin: bytes, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llm.chat", *args], input=stdin, capture_output=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"})


@pytest.mark.slow
def test_the_program_survives_bad_bytes_on_a_strict_stdin(model_dir):
    r = run_chat([str(model_dir), "--max-new-tokens", "3"], b"\xff\xfe\n\xc3(\nhello\n")
    assert r.returncode == 0 and b"Traceback" not in r.stderr
    recs = records(r.stdout.decode())
    assert [x.get("error", "")[:14] for x in recs] == ["stdin line 1: ", "stdin line 2: ", ""]
    assert recs[2]["user"] == "hello"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_in_tmux_ctrl_c_stops_an_answer_and_the_chat_goes_on(tok, tmp_path):
    """A real terminal: a long answer is interrupted with Ctrl-C, the next question is answered,
    and Ctrl-C at the prompt ends the program with status 0 and no traceback."""
    save_model_dir(tmp_path / "long", babbler(tok, 4096), tok, {"stage": "sft"})
    session = f"llm-chat-test-{os.getpid()}"
    cmd = (f"cd {ROOT} && {sys.executable} -m llm.chat {tmp_path / 'long'} --temperature 0"
           f" --max-new-tokens 4000 2>{tmp_path / 'err'}; echo EXIT=$?; sleep 30")

    def screen() -> str:  # the pane and its scrollback (a long answer may scroll away), wrapped lines joined (-J)
        return subprocess.run(["tmux", "capture-pane", "-p", "-J", "-S", "-", "-t", session], capture_output=True,
                              text=True).stdout

    def wait_for(pred, timeout=90.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = screen()
            if pred(s):
                return s
            time.sleep(0.2)
        raise AssertionError(f"timed out; the screen:\n{screen()}")

    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd], check=True)
    try:
        wait_for(lambda s: "you>" in s)  # capture-pane drops trailing spaces
        for i, question in enumerate(["hello", "again"]):
            subprocess.run(["tmux", "send-keys", "-t", session, question, "Enter"], check=True)
            # mid-answer: some of it is on the screen (4000 tokens take far longer than this)
            wait_for(lambda s: len(s.split("assistant> ")[-1].split("\n")[0]) > 20)
            subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
            wait_for(lambda s: s.count("[interrupted]") == i + 1 and s.rstrip().endswith("you>"))
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        s = wait_for(lambda s: "EXIT=" in s)
        assert "EXIT=0" in s and "Traceback" not in s
        assert "Traceback" not in (tmp_path / "err").read_text()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_the_loss_mask_covers_every_assistant_turn_and_its_end_and_nothing_else(tok):
    """Two exchanges: the supervised tokens are exactly both answers, each with its closing <|end|>."""
    messages = [{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": "7 + 5 = 12\n#### 12"},
                {"role": "user", "content": "And times 2?"}, {"role": "assistant", "content": "12 * 2 = 24\n#### 24"}]
    ids, mask = render(messages, tok)
    end = tok.special["<|end|>"]
    supervised = [i for i, m in zip(ids, mask) if m]
    answers = [tok.encode(m["content"], allowed_special="none") for m in messages[1::2]]
    assert supervised == answers[0] + [end] + answers[1] + [end]
    # the user turns and every role header are outside the mask
    unsupervised = [i for i, m in zip(ids, mask) if not m]
    assert unsupervised.count(tok.special["<|assistant|>"]) == 2 and unsupervised.count(end) == 2
