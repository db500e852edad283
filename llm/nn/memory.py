"""Memory per GPU of every stage that holds a model, from a params mapping: exact parts and estimates.

    python -m llm.profile memory gpu-77m          # one row per stage, GiB per GPU
    stage_memory(params)                          # {stage: StageMemory}, bytes
    fit_problems(params, card_gib)                # what does not fit, naming the key to change

Each stage is split into phases (training, generation, scoring, ...) that do not overlap in
time; a stage's peak is its largest phase. A phase's parts:

exact, from the shapes and dtypes (tests/test_memory.py checks them against tensors allocated at
full size on the CPU, as the stages allocate them):
    weights     every model the stage holds at that moment, parameters + buffers, fp32 (autocast
                keeps fp32 weights): the policy, its reference, the reward model, a second copy
                the stage builds to save
    gradients   4 bytes per trainable parameter (fp32, like the weights)
    optimizer   AdamW: two fp32 moments per trainable parameter + one fp32 `step` per tensor
    kv_cache    llm.sample.generate.KVCache: keys and values of every layer for batch x max_len
                positions in the weights' dtype (fp32), + its mask; max_len is taken as seq_len,
                the most a prompt plus its answer may use (generate allocates prompt + new tokens)

estimated (formulas below; `b` = 2 with bf16/fp16 autocast, 4 in fp32):
    activations training: TRAIN_ACT[b] bytes per token per layer per channel, for the layers
                from the first trainable one up. fp32: 68, twice Korthikanti et al. 2022
                ("Reducing Activation Recomputation") without the attention-score term that
                fused attention never stores. 16-bit: 45, TRAIN_ACT_COMPILED 40 where the stage
                compiles, fitted with the 12 of LM_TRAIN_LOGITS to the peak allocated memory of
                77m and 406m pretraining on an H200 (bench/gpu_check.py; Korthikanti's 34 and
                10 were 20-26% below it); with activation checkpointing, the 4-byte fp32 block
                input of every layer + one layer's worth. With 16-bit autocast also the 16-bit copies of
                the weights that backward keeps (2 bytes per parameter). Without grad: one
                layer's temporaries, INFER_ACT[b] bytes per token per channel
    logits      per token per vocabulary entry: LM_TRAIN_LOGITS (lm_loss: the logits, their fp32
                copy, its gradient, the 16-bit gradient), SEQ_LOGITS (sequence log-probs with
                grad: + the log-softmax kept for backward; taken at every position, an upper
                bound for DPO, whose uncompiled policy computes them at the answer positions
                only), RESP_LOGITS (RL update over the response positions: the tempered logits,
                log-softmax, entropy, gradients), INFER_LOGITS (no grad: logits
                + log-softmax), KL_LOGITS (llm.sample.rollout.sampled_kl over the response positions:
                both models' log-softmax + exp, difference, product)
    context     CUDA context, cuBLAS workspace and allocator slack: ~1 GiB on a GPU; on the CPU
                the Python process with torch and the libraries (~0.3 GiB)

Sequence lengths are taken at their most (seq_len): a padded batch is as long as its longest
sequence. On a GPU, common.dtype auto is taken as bf16. With common.nproc > 1, a supervised
stage (pretrain, sft, reward, dpo) with `distributed: fsdp` shards weights, gradients and
optimizer over the processes; with `ddp` it keeps a whole copy per process and adds its
gradient buckets (one more gradient's worth); ppo and grpo keep a whole copy per process and
roll out and score their share of the step's prompts (1 / (nproc x nnodes) of them).

Not counted: the CUDA caching allocator's fragmentation beyond the 1 GiB, torch.compile's
workspace, NCCL buffers, and data held on the host.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30
# bytes; the key is the activation width b (2: bf16/fp16 autocast, 4: fp32)
TRAIN_ACT = {2: 45, 4: 68}        # saved per token, per layer, per channel (16-bit: measured, see above)
TRAIN_ACT_COMPILED = {2: 40, 4: 68}  # the same where the stage's `compile` is on (fp32 not measured)
CKPT_INPUT = 4                     # activation checkpointing: each block's fp32 input
INFER_ACT = {2: 32, 4: 48}         # one layer's temporaries per token per channel, no grad
LM_TRAIN_LOGITS = {2: 12, 4: 8}    # per token per vocab entry
SEQ_LOGITS = {2: 14, 4: 12}
RESP_LOGITS = {2: 26, 4: 24}
INFER_LOGITS = {2: 10, 4: 8}
KL_LOGITS = 20                     # per response token per vocab entry
PROMPT_TOKENS = 256                # longest prompt assumed where a stage generates (see the docstring)
CUDA_CONTEXT = 1 * GIB
CPU_PROCESS = int(0.3 * GIB)
EXACT = ("weights", "gradients", "optimizer", "kv_cache")
ESTIMATED = ("activations", "logits", "context")
SFT_EVAL_BATCH = 64      # stages/sft.py: the held-out math check after training
HELDOUT_BATCH = 64       # llm.post.heldout.heldout_eval's default, used by PPO and GRPO


@dataclass
class Phase:
    """One part of a stage that allocates what it needs at once; bytes per GPU."""
    name: str
    key: str | None              # the params key that sizes it (what to lower when it does not fit)
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def exact(self) -> int:
        return sum(v for k, v in self.parts.items() if k in EXACT)


@dataclass
class StageMemory:
    stage: str
    phases: list[Phase]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


@dataclass
class ModelSize:
    """What one GPT costs at rest, from a meta-device build (no memory allocated)."""
    weight_bytes: int       # parameters (a tied matrix once) + buffers
    n_params: int
    trainable: int          # trainable parameter count
    trainable_tensors: int
    first_trained_layer: int  # blocks from this index on keep activations for backward (n_layer: none)


def model_size(mcfg, heads: tuple[str, ...], *, trainable: list[str] | None = None,
               reward_view: bool = False) -> ModelSize:
    """Sizes of GPT(mcfg, heads), with `trainable` globs frozen as llm.nn.optim.set_trainable does
    (None: all), and as llm.nn.reward_model.RewardModel sees it when reward_view."""
    from llm.nn.model import GPT
    from llm.nn.optim import set_trainable

    gpt = GPT(mcfg, heads=tuple(h for h in heads if h != "reward_logprob"), device="meta")
    if "reward_logprob" in heads:
        gpt.add_head("reward_logprob", marker=0)
    if trainable is not None:
        set_trainable(gpt, trainable, "trainable")
    if reward_view:
        from llm.nn.reward_model import RewardModel
        RewardModel(gpt)  # freezes an untied LM head the reward does not read
    params = {id(p): (n, p) for n, p in gpt.named_parameters()}.values()
    weights = sum(p.numel() * p.element_size() for _, p in params)
    weights += sum(b.numel() * b.element_size() for b in gpt.buffers())
    train = [(n, p) for n, p in params if p.requires_grad]
    first = mcfg.n_layer
    for n, _ in train:
        if n.startswith("blocks."):
            first = min(first, int(n.split(".")[1]))
        elif n.startswith(("wte.", "wpe.")):
            first = 0
    return ModelSize(weight_bytes=weights, n_params=sum(p.numel() for _, p in params),
                     trainable=sum(p.numel() for _, p in train), trainable_tensors=len(train),
                     first_trained_layer=first)


def kv_cache_bytes(mcfg, batch: int, max_len: int) -> int:
    """llm.sample.generate.KVCache: k and v (n_layer, batch, n_kv_head, max_len, head_dim) fp32, the
    (batch, max_len) bool mask and the (batch,) int64 position counter."""
    kv = 2 * mcfg.n_layer * batch * mcfg.n_kv_head * max_len * mcfg.head_dim * 4
    return kv + batch * max_len + batch * 8


_SIZES: dict[Any, ModelSize] = {}


def model_config(params: dict):
    """The ModelConfig every stage's model has: pretrain.model with the tokenizer's vocab_size
    where it says 0 (the tokenizer's requested size: one that stops short is smaller)."""
    from llm.config import ModelConfig

    m = dict(params["pretrain"]["model"])
    m["vocab_size"] = m["vocab_size"] or params["tokenizer"]["vocab_size"]
    return ModelConfig(**m)


class _Setting:
    """What the estimate needs from common + the model: device, widths, sizes."""

    def __init__(self, params: dict):
        common = params["common"]
        self.m = model_config(params)
        self.cuda = common["device"] != "cpu"
        self.b = 2 if self.cuda and common["dtype"] != "fp32" else 4
        self.nproc = common["nproc"]
        self.world = common["nproc"] * common.get("nnodes", 1)
        self.context = CUDA_CONTEXT if self.cuda else CPU_PROCESS
        self.rm_heads = ("lm", "reward", "reward_logprob") if params["reward"]["logprob_feature"] else ("lm", "reward")
        self.logprob_feature = params["reward"]["logprob_feature"]

    def size(self, heads: tuple[str, ...], trainable: tuple[str, ...] | None = None,
             reward_view: bool = False) -> ModelSize:
        k = (tuple(sorted(vars(self.m).items())), heads, trainable, reward_view)
        if k not in _SIZES:  # a meta-device build takes ~40 ms at 406m; largest_fitting asks often
            _SIZES[k] = model_size(self.m, heads, trainable=list(trainable) if trainable else None,
                                   reward_view=reward_view)
        return _SIZES[k]

    # -- formulas -------------------------------------------------------------------------

    def shard(self, section: dict) -> int:
        """Over how many processes a supervised stage's weights, gradients and AdamW are sharded."""
        return self.nproc if self.nproc > 1 and section.get("distributed") == "fsdp" else 1

    def trained(self, s: ModelSize, shard: int = 1) -> dict[str, int]:
        """weights + gradients + AdamW of a model being trained."""
        return {"weights": s.weight_bytes // shard, "gradients": 4 * s.trainable // shard,
                "optimizer": (8 * s.trainable + 4 * s.trainable_tensors) // shard}

    def train_acts(self, tokens: int, s: ModelSize, checkpointing: bool = False, compiled: bool = False) -> int:
        """Saved activations of a training forward over `tokens` positions."""
        m = self.m
        layers = m.n_layer - s.first_trained_layer
        per_layer = (TRAIN_ACT_COMPILED if compiled else TRAIN_ACT)[self.b] * tokens * m.n_embd
        if checkpointing and layers:
            acts = CKPT_INPUT * tokens * m.n_embd * layers + per_layer
        else:
            acts = per_layer * layers
        return acts + (2 * s.n_params if self.b == 2 else 0)  # 16-bit weight copies kept for backward

    def gen_len(self, max_new_tokens: int) -> int:
        """Positions of a prompt and its answer: PROMPT_TOKENS + max_new_tokens, at most seq_len."""
        return min(self.m.seq_len, PROMPT_TOKENS + max_new_tokens)

    def infer_acts(self, tokens: int, width: int | None = None) -> int:
        return INFER_ACT[width or self.b] * tokens * self.m.n_embd

    def logits(self, positions: int, per: int) -> int:
        """`per` bytes per position per vocabulary entry."""
        return per * positions * self.m.vocab_size

    def phase(self, name: str, key: str | None, **parts: int) -> Phase:
        return Phase(name, key, {**{k: v for k, v in parts.items() if v}, "context": self.context})


def stage_memory(params: dict) -> dict[str, StageMemory]:
    """Memory per GPU of every model-holding stage at these params (bytes). See the module docstring.

    One long function on purpose: each stage's block is a few lines of the same arithmetic on the
    shared sizes above it, and read in pipeline order they are the table `llm.profile memory` prints."""
    st = _Setting(params)
    m, T = st.m, st.m.seq_len
    lm = st.size(("lm",))
    rm = st.size(st.rm_heads)
    out: dict[str, StageMemory] = {}

    # pretrain and sft: one model, lm_loss over batch_size x seq_len tokens (SFT takes the logits
    # only where targets are supervised; the bound is for a batch that supervises every token)
    for name in ("pretrain", "sft"):
        c = params[name]
        shard = st.shard(c)
        ddp_buckets = 4 * lm.trainable if st.nproc > 1 and shard == 1 else 0
        tokens = c["batch_size"] * T
        phases = [st.phase("train", f"{name}.batch_size", **st.trained(lm, shard),
                           activations=st.train_acts(tokens, lm, c["activation_checkpointing"], c["compile"])
                           + ddp_buckets,
                           logits=st.logits(tokens, LM_TRAIN_LOGITS[st.b]))]
        if name == "sft" and c["eval_math_problems"]:
            # the trained model and the copy that is saved, decoding the held-out math check
            B, G = min(SFT_EVAL_BATCH, c["eval_math_problems"]), st.gen_len(c["max_new_tokens"])
            phases.append(st.phase("math eval", None, weights=2 * lm.weight_bytes, kv_cache=kv_cache_bytes(m, B, G),
                                   activations=st.infer_acts(B * G)))
        out[name] = StageMemory(name, phases)

    # reward: 2B sequences a batch (chosen, rejected); the likelihood feature reads the logits
    # at every position, with grad when the trunk trains
    c = params["reward"]
    heads = st.rm_heads
    probe = None if c["train_trunk"] else tuple(f"{h}_head.*" for h in heads if h.startswith("reward"))
    s = st.size(heads, probe, reward_view=True)
    tokens = 2 * c["batch_size"] * T
    per = SEQ_LOGITS[st.b] if s.first_trained_layer < m.n_layer else INFER_LOGITS[st.b]
    ddp_buckets = 4 * s.trainable if st.nproc > 1 and st.shard(c) == 1 else 0
    out["reward"] = StageMemory("reward", [
        st.phase("train", "reward.batch_size", **st.trained(s, st.shard(c)),
                 activations=st.train_acts(tokens, s, compiled=c["compile"]) + ddp_buckets,
                 logits=st.logits(tokens, per) if st.logprob_feature else 0),
        # every held-out answer, 2 x batch_size sequences at a time, by the trained model's saved copy
        st.phase("held-out scoring", "reward.batch_size", weights=2 * s.weight_bytes,
                 activations=st.infer_acts(tokens),
                 logits=st.logits(tokens, INFER_LOGITS[st.b]) if st.logprob_feature else 0)])

    # pairs: the SFT model samples, the RM scores
    c = params["pairs"]
    B, G = c["batch_size"], st.gen_len(c["max_new_tokens"])
    both = lm.weight_bytes + rm.weight_bytes
    out["pairs"] = StageMemory("pairs", [
        st.phase("generate", "pairs.batch_size", weights=both, kv_cache=kv_cache_bytes(m, B, G),
                 activations=st.infer_acts(B * G)),
        st.phase("RM scoring", "pairs.batch_size", weights=both, activations=st.infer_acts(B * G),
                 logits=st.logits(B * G, INFER_LOGITS[st.b]) if st.logprob_feature else 0)])

    # dpo: the policy trains, the frozen SFT reference stays on the device
    c = params["dpo"]
    pol = st.size(("lm",), None if c["trainable"] == ["*"] else tuple(c["trainable"]))
    B2, G = 2 * c["batch_size"], st.gen_len(c["max_new_tokens"])
    train = st.trained(pol, st.shard(c))
    train["weights"] += lm.weight_bytes  # the frozen reference: never sharded
    ddp_buckets = 4 * pol.trainable if st.nproc > 1 and st.shard(c) == 1 else 0
    out["dpo"] = StageMemory("dpo", [
        st.phase("reference log-probs", "dpo.batch_size", weights=pol.weight_bytes + lm.weight_bytes,
                 activations=st.infer_acts(B2 * T), logits=st.logits(B2 * T, INFER_LOGITS[st.b])),
        st.phase("train", "dpo.batch_size", **train,
                 activations=st.train_acts(B2 * T, pol, compiled=c["compile"]) + ddp_buckets,
                 logits=st.logits(B2 * T, SEQ_LOGITS[st.b])),
        # the trained policy, its saved copy and the reference; responses sampled, then both
        # models' log-softmax at the response positions (llm.sample.rollout.sampled_kl)
        st.phase("KL to SFT", "dpo.batch_size", weights=2 * pol.weight_bytes + lm.weight_bytes,
                 kv_cache=kv_cache_bytes(m, B2, G), activations=st.infer_acts(B2 * G),
                 logits=st.logits(B2 * c["max_new_tokens"], KL_LOGITS))])

    # ppo and grpo: every model stays resident, and AdamW's moments from the first update on
    for name in ("ppo", "grpo"):
        c = params[name]
        N, G = c["max_new_tokens"], st.gen_len(c["max_new_tokens"])
        if name == "ppo":
            pol, B, key = st.size(("lm", "value")), -(-c["rollout_prompts"] // st.world), "ppo.rollout_prompts"
            uses_rm = c["reward_source"] != "verifier"
            held = pol.weight_bytes + lm.weight_bytes + (rm.weight_bytes if uses_rm else 0)
            rm_logits = st.logits(B * G, INFER_LOGITS[st.b]) if uses_rm and st.logprob_feature else 0
        else:
            prompts = c["prompts_per_step"] * c.get("oversample", 1)
            pol, B, key = lm, -(-prompts // st.world) * c["group_size"], "grpo.prompts_per_step"
            held = lm.weight_bytes * (2 if c["beta"] > 0 else 1)
            rm_logits = 0
        adam = st.trained(pol)["optimizer"]
        update = st.trained(pol)
        update["weights"] = held
        phases = [
            st.phase("rollout", key, weights=held, optimizer=adam, kv_cache=kv_cache_bytes(m, B, G),
                     activations=st.infer_acts(B * G)),
            # old log-probs (and values), reference log-probs, rewards: the whole batch, no grad
            st.phase("scoring", key, weights=held, optimizer=adam, activations=st.infer_acts(B * G),
                     logits=max(st.logits(B * N, INFER_LOGITS[st.b]), rm_logits)),
            st.phase("update", f"{name}.minibatch_size", **update,
                     activations=st.train_acts(c["minibatch_size"] * G, pol),
                     logits=st.logits(c["minibatch_size"] * N, RESP_LOGITS[st.b]))]
        if c["eval_problems"]:
            Bh = min(HELDOUT_BATCH, c["eval_problems"])
            phases.append(st.phase("held-out eval", None, weights=held, optimizer=adam,
                                   kv_cache=kv_cache_bytes(m, Bh, G), activations=st.infer_acts(Bh * G),
                                   logits=st.logits(Bh * N, KL_LOGITS)))
        out[name] = StageMemory(name, phases)

    # eval: the model, SFT (its reference) and the RM; llm/eval/evaluate.py runs without autocast
    c = params["eval"]
    B, G = c["batch_size"], st.gen_len(c["max_new_tokens"])
    w3 = 2 * lm.weight_bytes + rm.weight_bytes
    out["eval"] = StageMemory("eval", [
        st.phase("perplexity", "eval.batch_size", weights=w3, activations=st.infer_acts(B * T, 4),
                 logits=st.logits(B * T, INFER_LOGITS[4])),
        st.phase("generate", "eval.batch_size", weights=w3, kv_cache=kv_cache_bytes(m, B, G),
                 activations=st.infer_acts(B * G, 4)),
        st.phase("RM scoring", "eval.batch_size", weights=w3, activations=st.infer_acts(B * G, 4),
                 logits=st.logits(B * G, INFER_LOGITS[4]) if st.logprob_feature else 0),
        st.phase("KL to SFT", "eval.batch_size", weights=w3, kv_cache=kv_cache_bytes(m, B, G),
                 activations=st.infer_acts(B * G, 4), logits=st.logits(B * c["max_new_tokens"], KL_LOGITS))])
    return out


# ---------------------------------------------------------------------------
# Does it fit?

HEADROOM = 0.10  # share of the card kept free: fragmentation, and what the estimate leaves out


def _set(params: dict, key: str, value: int) -> dict:
    p = copy.deepcopy(params)
    section, name = key.split(".")
    p[section][name] = value
    return p


def largest_fitting(params: dict, stage: str, key: str, budget: int) -> int:
    """The largest value of `key` (1..its current value) at which every phase of `stage` that
    `key` sizes stays within `budget` bytes; 0 if even 1 does not fit."""
    def fits(v: int) -> bool:
        return all(p.total <= budget for p in stage_memory(_set(params, key, v))[stage].phases if p.key == key)
    section, name = key.split(".")
    lo, hi = 0, params[section][name]
    while lo < hi:  # lo fits (or is 0); everything above hi does not
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def fit_problems(params: dict, card_gib: float, headroom: float = HEADROOM) -> list[str]:
    """One line per stage and key whose phases are estimated above card_gib less headroom per
    GPU, naming the key to change and the largest value of it that fits."""
    budget = int(card_gib * (1 - headroom) * GIB)
    out = []
    for name, sm in stage_memory(params).items():
        over = [p for p in sm.phases if p.total > budget]
        for key in dict.fromkeys(p.key for p in over):
            p = max((q for q in over if q.key == key), key=lambda q: q.total)
            what = (f"{name}: estimated {p.total / GIB:.1f} GiB per GPU in its {p.name} phase ({describe(p)}),"
                    f" above {budget / GIB:.1f} GiB (the {card_gib:g} GiB card less {headroom:.0%} headroom)")
            best = largest_fitting(params, name, key, budget) if key else 0
            if best:
                section, k = key.split(".")
                out.append(f"{what}; lower {key}: {params[section][k]} -> at most {best}")
            else:
                out.append(f"{what}; {'even ' + key + ': 1 does not fit' if key else 'no batch key sizes it'}:"
                           f" use a card with more memory or a smaller pretrain.model")
    return out


def describe(p: Phase) -> str:
    """'weights 0.16 + gradients 0.16 + ... GiB' for a phase."""
    return " + ".join(f"{k} {v / GIB:.2f}" for k, v in p.parts.items()) + " GiB"


def table(params: dict) -> list[list[str]]:
    """Rows (header first) of each stage's peak phase, GiB per GPU, for `llm.profile memory`."""
    cols = EXACT + ESTIMATED
    rows = [["stage", "peak phase", "sized by", *cols, "total"]]
    for name, sm in stage_memory(params).items():
        p = sm.peak
        rows.append([name, p.name, p.key or "-", *(f"{p.parts[c] / GIB:.2f}" if p.parts.get(c) else "-"
                                                   for c in cols), f"{p.total / GIB:.1f}"])
    return rows


def format_table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned text lines (the first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def report(params: dict, label: str, card_gib: float | None) -> list[str]:
    """What `python -m llm.profile memory` prints: the model, the table, the fit."""
    st = _Setting(params)
    m = st.m
    width = "fp32" if st.b == 4 else "bf16/fp16 autocast, fp32 weights"
    where = "per GPU" if st.cuda else "on the CPU"
    lines = [f"{label}: GPT {m.preset}, {st.size(('lm',)).n_params / 1e6:.1f}M parameters ({m.n_layer} layers x"
             f" {m.n_embd}, vocab {m.vocab_size}, seq_len {m.seq_len}); GiB {where}, {width}; each stage's largest"
             f" phase", *format_table(table(params)),
             "exact from shapes: weights, gradients, optimizer, kv_cache; estimated: activations, logits, context"
             " (formulas in llm/nn/memory.py)"]
    if card_gib:
        problems = fit_problems(params, card_gib)
        budget = card_gib * (1 - HEADROOM)
        lines += ([f"fits: every stage within {budget:.1f} GiB (the {card_gib:g} GiB card less {HEADROOM:.0%})"]
                  if not problems else [f"does NOT fit a {card_gib:g} GiB card:", *(f"  {p}" for p in problems)])
    return lines
