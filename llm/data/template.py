"""The chat template: how a conversation becomes token ids, and which of them SFT trains on.

    <|endoftext|><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{answer}<|end|>

Special tokens are single ids; no extra newlines. The leading <|endoftext|> is the document
separator of pretraining, so a conversation starts the way every pretraining document did.
`render()` returns the token ids and a per-token loss mask that is True exactly on assistant
content and its closing <|end|>: role headers, system and user turns are never trained on.
Message text is encoded as plain text: a user who types "<|end|>" gets the bytes of that
string, never the control token.

Every part of the pipeline that turns messages into ids goes through here: SFT's batches, the
preference pairs, the RL and evaluation prompts, the terminal chat (llm/tools/chat.py), the server
and the exported tokenizer's template (llm/tools/export.py writes the same format for other tools).
"""
from __future__ import annotations

from typing import Callable, Sequence

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END, BOS = "<|end|>", "<|endoftext|>"
STOP_TOKENS = (END, BOS)  # an answer ends at either (a model may close a turn by ending the document)


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


def render_all(conversations: Sequence[Sequence[dict]], tokenizer, max_tokens: int
               ) -> tuple[list[tuple[list[int], list[bool]]], int]:
    """(ids, loss_mask) of each conversation `render` keeps within max_tokens, and how many it dropped."""
    out, dropped = [], 0
    for messages in conversations:
        x = render(messages, tokenizer, max_tokens=max_tokens)
        if x is None:
            dropped += 1
        else:
            out.append(x)
    return out, dropped


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


class ContextError(ValueError):
    """The newest message alone does not leave room for an answer in the model's context."""


def fit_context(messages: Sequence[dict], count: Callable[[str], int], seq_len: int, answer: int
                ) -> tuple[list[dict], int]:
    """(the conversation without its earliest messages, how many were dropped): as few as needed
    for render_prompt's ids to leave `answer` tokens of the `seq_len` context for the reply.

    A leading system message stays and so does the newest message; whole exchanges go, so what
    is kept never starts with an answer. `count(text)` is the number of tokens of a message's
    text (the template adds its role token and <|end|>, and the prompt <|endoftext|> and
    <|assistant|>). Raises ContextError when even the newest message leaves no room for one token.
    """
    first = 1 if messages and messages[0]["role"] == "system" else 0
    sizes = [count(m["content"]) + 2 for m in messages]  # role token, text, <|end|>
    length, k = 2 + sum(sizes), first  # <|endoftext|> ... <|assistant|>; k: the oldest message kept
    while length + answer > seq_len and len(messages) - k > 1:
        length, k = length - sizes[k], k + 1
        if messages[k]["role"] == "assistant" and len(messages) - k > 1:
            length, k = length - sizes[k], k + 1
    if length >= seq_len:
        raise ContextError(f"this message makes a prompt of {length} tokens and the model's context"
                           f" is {seq_len} tokens: write a shorter one")
    return [*messages[:first], *messages[k:]], k - first
