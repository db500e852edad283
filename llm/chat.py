"""The chat template, loss masks for SFT, and a terminal chat.

Template (special tokens are single ids; no extra newlines):

    <|endoftext|><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{answer}<|end|>

The leading <|endoftext|> is the document separator of pretraining, so a
conversation starts the way every pretraining document did. `render()` returns the
token ids and a per-token loss mask that is True exactly on assistant content and its
closing <|end|>: role headers, system and user turns are never trained on.

Chat in a terminal with any stage's model directory:

    python -m llm.chat models/sft [--system "You are terse."] [--temperature 0.7]

Commands: /reset (forget the conversation), /temp 0.7 (sampling temperature; 0 =
greedy), /quit. When stdin is not a terminal, each input line is one user turn and
the program exits at end of input, e.g. `echo "What is 7 + 5?" | python -m llm.chat models/sft`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END, BOS = "<|end|>", "<|endoftext|>"


def render(messages: Sequence[dict], tokenizer, max_tokens: int | None = None
           ) -> tuple[list[int], list[bool]] | None:
    """Token ids and loss mask of a conversation; None if truncation leaves nothing to learn.

    `mask[i]` is True when token i is supervised (an assistant content token or the
    <|end|> that closes an assistant turn). With `max_tokens`, the conversation is cut
    at the end; if that removes every supervised token the sample is unusable and
    None is returned, so callers drop and count it instead of training on nothing.
    """
    sp = tokenizer.special
    ids, mask = [sp[BOS]], [False]
    for m in messages:
        role, content = m["role"], m["content"]
        if role not in ROLE_TOKENS:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLE_TOKENS)}")
        body = tokenizer.encode(content, allowed_special="none")  # user text never becomes a special id
        train = role == "assistant"
        ids += [sp[ROLE_TOKENS[role]], *body, sp[END]]
        mask += [False] + [train] * (len(body) + 1)
    if max_tokens is not None and len(ids) > max_tokens:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    if not any(mask):
        return None
    return ids, mask


def render_prompt(messages: Sequence[dict], tokenizer) -> list[int]:
    """Ids of a conversation ready for the assistant's next answer (ends with <|assistant|>)."""
    sp = tokenizer.special
    ids = [sp[BOS]]
    for m in messages:
        ids += [sp[ROLE_TOKENS[m["role"]]], *tokenizer.encode(m["content"], allowed_special="none"), sp[END]]
    return ids + [sp[ROLE_TOKENS["assistant"]]]


def user_prompt(question: str, tokenizer, system: str | None = None) -> list[int]:
    """The prompt ids for a single user question (math eval, RL rollouts, pairs)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return render_prompt(msgs, tokenizer)


def as_text(messages: Sequence[dict]) -> str:
    """The template as a string, for reading and for tokenizer-training text."""
    return BOS + "".join(f"{ROLE_TOKENS[m['role']]}{m['content']}{END}" for m in messages)


# ---------------------------------------------------------------------------
# Terminal chat

class _Streamer:
    """Prints tokens as they arrive, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tok, self.out, self.ids, self.shown = tokenizer, out, [], 0

    def __call__(self, token_ids) -> None:
        self.ids.append(int(token_ids[0]))
        text = self.tok.decode([i for i in self.ids if i not in self.tok.special.values()])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


def chat_turn(model, tokenizer, history: list[dict], temperature: float, max_new_tokens: int,
              generator, stream: Callable | None = None) -> str:
    """Generate the assistant's answer to `history`; returns its text."""
    from llm.generate import generate  # torch-heavy: imported when chatting, not at import of llm.chat

    prompt = render_prompt(history, tokenizer)
    room = model.config.seq_len - len(prompt)
    if room < 1:
        raise ValueError(f"the conversation is {len(prompt)} tokens, the model's context is"
                         f" {model.config.seq_len}: /reset to start over")
    out = generate(model, [prompt], min(max_new_tokens, room), temperature=temperature,
                   stop_ids=(tokenizer.special[END], tokenizer.special[BOS]), pad_id=tokenizer.pad_id,
                   generator=generator, stream=stream)
    return tokenizer.decode(out.responses()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Chat with a model directory (any stage).",
                                 epilog="Commands inside the chat: /reset, /temp <t>, /quit")
    ap.add_argument("model_dir", help="e.g. models/sft")
    ap.add_argument("--system", default=None, help="system message for every conversation")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    import torch

    from llm.artifacts import load_model_dir

    try:
        model, tok, meta = load_model_dir(args.model_dir, device=args.device)
    except (FileNotFoundError, ValueError) as e:
        print(f"chat: {e}", file=sys.stderr)
        return 1
    model.eval()
    g = torch.Generator(device=args.device).manual_seed(args.seed)
    interactive = sys.stdin.isatty()
    temperature = args.temperature
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    if interactive:
        print(f"chatting with {args.model_dir} ({meta.get('stage', '?')}, {meta.get('n_params', '?')} parameters);"
              f" /reset, /temp <t>, /quit")
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
        else:
            line = sys.stdin.readline()
            if not line:
                return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history = list(base)
            print("(conversation reset)")
            continue
        if line.startswith("/temp"):
            try:
                temperature = float(line.split()[1])
                if temperature < 0:
                    raise ValueError
                print(f"(temperature {temperature})")
            except (IndexError, ValueError):
                print("usage: /temp <non-negative number>, e.g. /temp 0.7")
            continue
        history.append({"role": "user", "content": line})
        if interactive:
            print("assistant> ", end="", flush=True)
        try:
            answer = chat_turn(model, tok, history, temperature, args.max_new_tokens, g,
                               stream=_Streamer(tok))
        except ValueError as e:
            print(f"\n({e})")
            history.pop()
            continue
        print()
        history.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    raise SystemExit(main())
