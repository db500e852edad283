"""Export a model directory to Hugging Face Llama format.

    python -m llm.export models/sft exported/sft

writes, atomically, into <out_dir>:
    model.safetensors        weights under HF Llama names (model.layers.{i}.self_attn.q_proj.weight, ...)
    config.json              a LlamaForCausalLM config
    generation_config.json   eos = <|end|>, pad = <|pad|>
    tokenizer.json           Tokenizer.to_hf_json(), loadable by `tokenizers` / PreTrainedTokenizerFast
    tokenizer_config.json    special tokens and our chat template as Jinja

so that `AutoModelForCausalLM.from_pretrained(out_dir)` gives the same logits as our GPT
(tests/test_export.py checks it to atol 1e-4). Llama is pre-norm RMSNorm + RoPE + SwiGLU with
grouped-query attention. Our RoPE rotates adjacent pairs (2i, 2i+1) of each head; HF's
rotate_half rotates (i, i + head_dim/2) with the same frequency i, so the rows of q_proj and
k_proj are permuted per head (even rows first, then odd rows), which gives identical attention
scores. Our fused qkv / gate-up matrices are split into HF's separate projections.
Configs Llama cannot express (layernorm, learned positions, gelu/relu MLP) are refused with the
reason. Biases map to Llama's attention_bias / mlp_bias; a parameter-free RMSNorm is exported
with unit weights. Value and reward heads are not part of a causal LM and are left out.

Nothing here imports transformers: the files are plain safetensors and JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from llm.config import ModelConfig
from llm.model import GPT, NORM_EPS, mlp_hidden


class ExportError(ValueError):
    """The model cannot be expressed in the target format; the message says why."""


# llm/chat.py's format: <|endoftext|> then <|role|>content<|end|> per message, then <|assistant|>
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


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
        "bos_token_id": special.get("<|endoftext|>"),
        "eos_token_id": special.get("<|end|>"),
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


def export_hf(model: GPT, tokenizer: Any, out_dir: str | Path) -> Path:
    """Write the HF files for `model` (+ `tokenizer` if not None) into out_dir atomically."""
    from safetensors.torch import save_file

    from llm.fileio import atomic_dir

    problems = export_problems(model.config, model.head_names)
    if problems:
        raise ExportError("cannot export as LlamaForCausalLM:\n  " + "\n  ".join(problems))
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = hf_config(model.config, tokenizer)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_text(json.dumps(tokenizer.to_hf_json(), ensure_ascii=False) + "\n",
                                                encoding="utf-8")
            tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.seq_len,
                       "bos_token": "<|endoftext|>", "eos_token": "<|end|>", "pad_token": "<|pad|>",
                       "chat_template": CHAT_TEMPLATE}
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export models/<stage> to Hugging Face Llama format.")
    ap.add_argument("model_dir", help="a model directory, e.g. models/sft")
    ap.add_argument("out_dir", help="where to write the HF files (replaced atomically)")
    args = ap.parse_args(argv)
    from llm.artifacts import load_model_dir

    try:
        model, tokenizer, _ = load_model_dir(args.model_dir)
        dropped = [h for h in model.head_names if h != "lm"]
        export_hf(model, tokenizer, args.out_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 1
    note = f" (left out heads {dropped}: not part of a causal LM)" if dropped else ""
    print(f"export: {args.model_dir} -> {args.out_dir} as LlamaForCausalLM, {model.summary()}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
