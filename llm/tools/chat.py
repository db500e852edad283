"""A terminal chat with a model directory, over the chat template of llm/data/template.py.

Chat with any stage's model directory (`--help` lists every flag with its default):

    python -m llm.chat models/sft [--system "You are terse."] [--temperature 0.7] [--top-p 0.9]
    python -m llm.chat models/sft --prompt "What is 7 + 5?"      # one answer, printed, then exit

In a terminal: answers stream as they are generated. Ctrl-C while the model answers
stops that answer and returns to the prompt; the part already shown is kept as the
assistant's turn, so the conversation goes on from what you saw. Ctrl-C or Ctrl-D at the
prompt leaves (exit 0). Commands: /help, /reset (forget the conversation), /temp T
(0 = greedy), /quit. Any other /word is answered with that list and never sent to the
model; start a line with // to send a line that begins with /. When the conversation no
longer fits the model's context, its earliest messages are forgotten (and you are told).

When stdin is not a terminal, each input line is one user turn (blank lines are skipped,
commands work) and stdout is JSON Lines, one object per user turn, so answers that
span several lines stay unambiguous (the answers shown are made up):

    $ printf 'What is 7 + 5?\nAnd times 2?\n' | python -m llm.chat models/sft --temperature 0
    {"line": 1, "user": "What is 7 + 5?", "assistant": "7 + 5 = 12\n#### 12", "finish": "stop"}
    {"line": 2, "user": "And times 2?", "assistant": "...", "finish": "stop"}

`finish` is "stop" (the model ended its answer), "length" (--max-new-tokens or the
context ran out) or "interrupted" (Ctrl-C; the program then exits 130). A line that cannot
be answered gives {"line": N, "error": "..."} instead (not UTF-8, or longer than the
context) and the rest still runs. Command replies and notices go to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator

from llm.data.template import STOP_TOKENS, ContextError, fit_context, render_prompt

# ---------------------------------------------------------------------------
# Answers as text, as they stream


class TextStream:
    """Generated ids -> text pieces, as they arrive.

    Special tokens are dropped. The bytes of an unfinished UTF-8 character are held back
    until the rest arrives; a character is at most 4 bytes and every token holds at least
    one, so after 4 held tokens the bytes are invalid for good and are shown as U+FFFD.
    `text` is everything handed out so far.
    """

    def __init__(self, tokenizer):
        self.tok, self.special = tokenizer, set(tokenizer.special.values())
        self.pending: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        if token_id in self.special:
            return ""
        self.pending.append(token_id)
        piece = self.tok.decode(self.pending)
        if piece.endswith("\ufffd") and len(self.pending) < 4:
            return ""
        return self._emit(piece)

    def flush(self) -> str:
        return self._emit(self.tok.decode(self.pending)) if self.pending else ""

    def _emit(self, piece: str) -> str:
        self.pending = []
        self.text += piece
        return piece


# ---------------------------------------------------------------------------
# A conversation


@dataclass
class Reply:
    text: str
    finish: str       # "stop" (the model ended it), "length" (max_new_tokens or the context), "interrupted"
    forgotten: int    # earliest messages dropped so that the conversation fits the context


class Chat:
    """A conversation with a model: the history, the sampling settings and one seeded generator.

    Before each answer the earliest messages (never the system message) are dropped until
    prompt + max_new_tokens fits the model's context, so a long conversation keeps going
    instead of refusing every turn; when the newest message alone is too long the turn is
    refused with its length (ContextError) and the conversation is unchanged.
    Ctrl-C while answering (KeyboardInterrupt) ends the answer: the part shown so far is kept
    as the assistant's turn, so the history is what the user saw.
    """

    def __init__(self, model, tokenizer, *, system: str | None = None, temperature: float = 0.7,
                 top_k: int = 0, top_p: float = 1.0, max_new_tokens: int = 128, seed: int = 0):
        import torch

        self.model, self.tok = model, tokenizer
        self.system = system
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator(device=model.wte.weight.device).manual_seed(seed)
        self.history: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def _fit(self) -> tuple[list[int], int]:
        """The prompt after dropping the earliest messages until the answer has max_new_tokens of room."""
        kept, forgotten = fit_context(self.history, lambda text: len(self.tok.encode(text, allowed_special="none")),
                                      self.model.config.seq_len, self.max_new_tokens)
        self.history = kept
        return render_prompt(kept, self.tok), forgotten

    def reply(self, text: str, on_text: Callable[[str], None] | None = None) -> Reply:
        """Add the user's `text`, generate the answer (streamed to on_text) and add it."""
        from llm.sample.generate import generate  # torch-heavy: imported when chatting, not at import of llm.chat

        self.history.append({"role": "user", "content": text})
        try:
            prompt, forgotten = self._fit()
        except ContextError:
            self.history.pop()  # the message that does not fit; the conversation is as it was
            raise
        stream, sink = TextStream(self.tok), on_text or (lambda piece: None)
        finish = "interrupted"
        try:
            room = self.model.config.seq_len - len(prompt)
            gen = generate(self.model, [prompt], min(self.max_new_tokens, room), temperature=self.temperature,
                           top_k=self.top_k, top_p=self.top_p,
                           stop_ids=[self.tok.special[t] for t in STOP_TOKENS], pad_id=self.tok.pad_id,
                           generator=self.generator, stream=lambda t: sink(stream.push(int(t[0]))))
            sink(stream.flush())
            finish = "stop" if bool(gen.stopped[0]) else "length"
        except KeyboardInterrupt:
            pass  # what was shown stays the answer; bytes of an unfinished character are dropped
        self.history.append({"role": "assistant", "content": stream.text})
        return Reply(stream.text, finish, forgotten)


# ---------------------------------------------------------------------------
# The command line

COMMANDS = {
    "/help": "show this list",
    "/reset": "forget the conversation (the system message stays)",
    "/temp T": "set the sampling temperature (0 = greedy)",
    "/quit": "leave (also /exit; in a terminal also Ctrl-D, or Ctrl-C at the prompt)",
}
HELP = ("commands:\n" + "\n".join(f"  {c:<8} {what}" for c, what in COMMANDS.items())
        + "\n  a line starting with // is sent with one / removed; Ctrl-C while the model answers stops the answer")


class _Quit(Exception):
    pass


def run_command(chat: Chat, line: str) -> str:
    """Carry out a /command; returns the message to show. Never sends anything to the model."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        raise _Quit
    if name == "/help":
        return HELP
    if name == "/reset":
        chat.reset()
        return "(conversation reset)"
    if name == "/temp":
        try:
            t = float(arg)
        except ValueError:
            return "usage: /temp T, e.g. /temp 0.7 (0 = greedy)"
        problem = sampling_problem(temperature=t)
        if problem:
            return f"/temp: {problem}; the temperature stays {chat.temperature}"
        chat.temperature = t
        return f"(temperature {t})"
    return f"unknown command {name}; nothing was sent to the model.\n{HELP}"


def sampling_problem(**settings) -> str | None:
    from llm.sample.generate import sampling_problem as check  # torch-heavy: not at import of llm.chat

    return check(**settings)


def checked_arg(check: Callable[[Any], str | None], convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: convert, then refuse with check's reason (argparse exits 2 with it)."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            kind = "an integer" if convert is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        problem = check(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    return parse


temperature_arg = checked_arg(lambda t: sampling_problem(temperature=t), float)
top_k_arg = checked_arg(lambda k: sampling_problem(top_k=k), int)
top_p_arg = checked_arg(lambda p: sampling_problem(top_p=p), float)
positive_int_arg = checked_arg(lambda n: None if n >= 1 else f"must be >= 1, got {n}", int)
seed_arg = checked_arg(lambda n: None if 0 <= n < 2 ** 64 else f"must be in [0, 2**64 - 1] (torch's seed range),"
                       f" got {n}", int)


def text_arg(text: str) -> str:
    """An argparse type for message text: Python hands over argv bytes that are not UTF-8 as lone
    surrogates (surrogateescape), which the tokenizer cannot encode; refuse them by byte and offset."""
    raw = text.encode("utf-8", "surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at offset {e.start});"
                                         f" pass the text in UTF-8") from None


def device_problem(name: str) -> str | None:
    """Why torch cannot run on device `name` here (None = it can)."""
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError:
        return f"{name!r} is not a torch device; use cpu, cuda, cuda:N or mps"
    if dev.type == "cuda":
        if torch.version.cuda is None:
            return f"{name}: this torch ({torch.__version__}) is built without CUDA; use cpu, or install a CUDA build"
        if not torch.cuda.is_available():
            return f"{name}: torch sees no CUDA GPU on this machine; use cpu"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"{name}: only {torch.cuda.device_count()} CUDA device(s) here"
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            return f"{name}: MPS is not available on this machine; use cpu"
    elif dev.type != "cpu":
        return f"{name}: unsupported device type {dev.type!r}; use cpu, cuda or mps"
    return None


def load_for_cli(ap: argparse.ArgumentParser, model_dir: str, device: str, heads: tuple[str, ...] | None = None):
    """(model in eval mode, tokenizer, meta) for a command line, or exit with the reason: a bad
    --device is a usage error (2), an unusable model directory 1, Ctrl-C while loading 130."""
    problem = device_problem(device)
    if problem:
        ap.error(f"argument --device: {problem}")
    from llm.nn.artifacts import load_model_dir

    try:
        model, tok, meta = load_model_dir(model_dir, device=device, heads=heads)
    except (FileNotFoundError, ValueError) as e:
        ap.exit(1, f"{ap.prog}: {e}\n")
    except KeyboardInterrupt:
        ap.exit(130)
    return model.eval(), tok, meta


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m llm.chat", description="Chat with a model directory (any stage).",
        epilog="Inside the chat: " + ", ".join(COMMANDS) + ". When stdin is not a terminal, each line is a"
               ' user turn and stdout is JSON Lines: {"line", "user", "assistant", "finish"} per turn.')
    ap.add_argument("model_dir", help="a model directory, e.g. models/sft")
    ap.add_argument("--prompt", type=text_arg, default=None, metavar="TEXT", help="answer this one message, print the answer and exit"
                    " (default: none, chat)")
    ap.add_argument("--system", type=text_arg, default=None, metavar="TEXT", help="system message at the start of every conversation"
                    " (default: none)")
    ap.add_argument("--temperature", type=temperature_arg, default=0.7, metavar="T",
                    help="sampling temperature; 0 = greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=top_k_arg, default=0, metavar="K",
                    help="sample only from the k most likely tokens; 0 = off (default: %(default)s)")
    ap.add_argument("--top-p", type=top_p_arg, default=1.0, metavar="P",
                    help="sample only from the smallest set of tokens holding this much probability;"
                         " 1 = off (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=positive_int_arg, default=None, metavar="N",
                    help="longest answer in tokens; the earliest turns are forgotten when the conversation"
                         " and the answer do not fit the context (default: half the model's context)")
    ap.add_argument("--seed", type=seed_arg, default=0, metavar="N", help="seed of the sampling generator (default: %(default)s)")
    ap.add_argument("--device", default="cpu", metavar="DEVICE", help="torch device, e.g. cuda (default: %(default)s)")
    return ap


def _decoded_lines(raw: IO[bytes]) -> Iterator[tuple[int, str | None, str]]:
    """(line number, text or None, why not) per input line; a line that is not UTF-8 is reported, not fatal."""
    for lineno, line in enumerate(raw, start=1):
        try:
            yield lineno, line.decode("utf-8").rstrip("\r\n"), ""
        except UnicodeDecodeError as e:
            yield lineno, None, (f"stdin line {lineno}: not valid UTF-8 (byte {line[e.start:e.start + 1]!r} at"
                                 f" offset {e.start}); nothing was sent to the model")


def _piped(chat: Chat, raw: IO[bytes], out: IO[str], err: IO[str]) -> int:
    """One user turn per input line; one JSON object per user turn on stdout."""
    def record(**fields) -> None:
        out.write(json.dumps(fields, ensure_ascii=False) + "\n")
        out.flush()

    for lineno, line, why in _decoded_lines(raw):
        if line is None:
            record(line=lineno, error=why)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            try:
                print(run_command(chat, text), file=err)
            except _Quit:
                return 0
            continue
        text = text[1:] if text.startswith("//") else text
        try:
            reply = chat.reply(text)
        except ContextError as e:
            record(line=lineno, user=text, error=str(e))
            continue
        if reply.forgotten:
            print(f"(line {lineno}: forgot the {reply.forgotten} earliest messages to fit the context)", file=err)
        record(line=lineno, user=text, assistant=reply.text, finish=reply.finish)
        if reply.finish == "interrupted":
            return 130
    return 0


# control characters other than newline and tab, shown escaped: a model's output must not be
# able to move the cursor, clear the screen or retitle the terminal
_SHOW = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)] if chr(c) not in "\n\t"}


def _interactive(chat: Chat, banner: str) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(banner)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if any("\udc80" <= c <= "\udcff" for c in text):  # surrogateescape's stand-ins for bad bytes
            print("(that line is not valid UTF-8; check the terminal's encoding. Nothing was sent.)")
            continue
        if text.startswith("/") and not text.startswith("//"):
            try:
                print(run_command(chat, text))
            except _Quit:
                return 0
            continue
        text = text[1:] if text.startswith("//") else text
        print("assistant> ", end="", flush=True)

        def show(piece: str) -> None:
            sys.stdout.write(piece.translate(_SHOW))
            sys.stdout.flush()

        try:
            reply = chat.reply(text, on_text=show)
        except ContextError as e:
            print(f"({e})")
            continue
        print(" [interrupted]" if reply.finish == "interrupted" else "")
        if reply.forgotten:
            print(f"(forgot the {reply.forgotten} earliest messages to fit the model's context)")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    model, tok, meta = load_for_cli(ap, args.model_dir, args.device)
    seq_len = model.config.seq_len
    max_new = args.max_new_tokens or max(1, seq_len // 2)
    if max_new >= seq_len:
        ap.error(f"argument --max-new-tokens: {max_new} leaves no room for the conversation in the model's"
                 f" context of {seq_len} tokens; use at most {seq_len - 1} (the default is {seq_len // 2})")
    chat = Chat(model, tok, system=args.system, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, max_new_tokens=max_new, seed=args.seed)
    for stream in (sys.stdout, sys.stderr):  # an answer must never fail to print on a non-UTF-8 terminal
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    if args.prompt is not None:
        try:
            reply = chat.reply(args.prompt)
        except ContextError as e:
            print(f"{ap.prog}: {e}", file=sys.stderr)
            return 1
        print(reply.text)
        return 130 if reply.finish == "interrupted" else 0
    if sys.stdin.isatty():
        if hasattr(sys.stdin, "reconfigure"):  # a bad byte typed or pasted is reported, not a crash
            sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
        return _interactive(chat, f"chatting with {args.model_dir} ({meta.get('stage', '?')},"
                                  f" {meta.get('n_params', '?')} parameters); /help for commands")
    try:
        return _piped(chat, sys.stdin.buffer, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
