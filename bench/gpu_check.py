"""The device check: the one script a session with a GPU runs, printing one table of this project's GPU figures.

    python bench/gpu_check.py [--parts speedrun,dag,pretrain,rl,stages,resume] [--budget-s 540]
    python bench/gpu_check.py --cpu-plumbing        # tiny sizes on the CPU: checks the script, no GPU figures
    python bench/gpu_check.py --save-dag-plan F     # where DVC is: the DAG part's stages, for --dag-plan F on
                                                    # a GPU machine that has no DVC and cannot install it

Written for one H200 lent for a few minutes: at the defaults it should take under 9 minutes there
(`--budget-s`: a part that would start after that many seconds is skipped and its row says so).
Without CUDA it refuses (exit 2) unless `--cpu-plumbing` is given. Parts, in order:

0. speedrun: the gpu-speedrun profile's whole DAG at its own step counts, from nothing, on the
   device, in a scratch copy of the work tree (`python -m llm.rehearse`'s machinery, nothing cut),
   with common.nproc = the number of GPUs found. One row per stage: wall seconds (process start
   included) and, for a stage that trains through llm/train/trainer.py (pretrain, sft, reward, dpo), its
   tokens/s (tokens_seen / train_time_s of metrics/run/<stage>.json), TFLOP/s and MFU by two counts
   of FLOPs per token (see `flop_counts`); then one row per evaluated model from
   metrics/eval/<model>.json: math greedy and sampled, pass@k, tasks, bare arithmetic. It takes
   about 8 minutes on one H100 by the estimate in docs/gpu.md, so at the default --budget-s it
   leaves room for little else: `--parts dag,pretrain,rl,stages,resume` runs the rest.
1. dag: the gpu-13m profile's whole DAG on the device (bf16), each stage cut to one step as
   `python -m llm.rehearse` cuts it (llm/tools/rehearse.py), in a scratch copy of the work tree:
   every stage's code path on CUDA at the profile's model shapes. One row per stage.
2. pretrain: the 77m and 406m presets at their profiles' batch (grad_accum 1) and seq_len, bf16
   autocast, eager and `torch.compile`d, through llm.train.trainer.train (the loop every stage uses) on
   uniformly random tokens: tokens/s over the steps after the warm-up (the loop's own elapsed_s),
   MFU = flops_per_token x tokens/s / the card's dense bf16 peak (llm.train.monitor.peak_flops), and
   torch.cuda.max_memory_allocated against llm/nn/memory.py's estimate of the pretrain stage
   without its 1 GiB of CUDA context (which the allocator does not see).
3. rl: one PPO step and one GRPO step (llm/post/ppo.py, llm/post/grpo.py) at 77m with the gpu-77m profile's
   ppo / grpo settings, from a random policy (it never emits its stop token, so every response runs
   to max_new_tokens: the most memory), random prompts as long as llm/nn/memory.py assumes
   (PROMPT_TOKENS), PPO's reward from a random reward model with the likelihood feature; peak
   allocated memory against the estimate's largest phase of the rollout, scoring and update (the
   held-out evaluation is not run).
4. stages: 3 optimizer steps (STAGE_STEPS) each of SFT, the reward model and DPO at 77m with the
   gpu-77m profile's settings (batch_size; the reward's likelihood feature and train_trunk; DPO's
   trainable and loss_type) but grad_accum 1, bf16 autocast, eager, through llm.train.trainer.train with
   each stage's own loss: SFT's supervised_lm_loss, the reward model's Bradley-Terry loss, DPO's
   loss on reference log-probs that the frozen reference computes first and that stays on the
   device, as in the stage. Random tokens at full length (SFT: seq_len targets; each side of a
   pair: seq_len tokens) whose answer is every position after a one-token prompt: the case
   llm/nn/memory.py bounds, since it takes the logits at every position. Peak allocated memory against
   the estimate of the stage's train phase without the CUDA context; a stage passes when its losses
   are finite. Then 10 steps (FP16_STEPS) of 77m pretraining under fp16 autocast, the loop's
   GradScaler path: whether every loss is finite, the loss scale at the end (read from the last
   checkpoint), the overflowed steps the scaler dropped (the loop runs them again), peak memory
   against the pretrain estimate. Last, SFT as the profile runs it where it compiles (`sft.compile`:
   torch.compile, the full-head loss) against the compiled estimate. With --cpu-plumbing: tiny
   sizes in fp32, nothing compiled, and the fp16 row in the CPU's fp16 autocast with a CPU
   GradScaler.
5. resume: SIGTERM during step k of a 2k-step 77m run on the device (the trainer's preemption path:
   finish the step, write ckpt-k, exit 143), resume to 2k, and compare losses k+1..2k with an
   uninterrupted run: passes when max |diff| / loss <= 1e-3 (CUDA kernels need not be bitwise
   reproducible; on the CPU they are, and --cpu-plumbing requires bitwise equality).

Prints the table and, as its last line, one JSON object with every figure. Exit status: 0 every
part that ran passed, 1 one failed, 2 refused. Writes nothing outside temporary directories.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from llm.config import GRPOConfig, PPOConfig, TrainConfig  # noqa: E402
from llm.nn.memory import CUDA_CONTEXT, GIB, format_table, model_config, stage_memory  # noqa: E402
from llm.nn.model import GPT  # noqa: E402
from llm.runtime import Runtime  # noqa: E402
from llm.tools.profile import render  # noqa: E402
from llm.train.monitor import Plots, peak_flops  # noqa: E402
from llm.train.trainer import lm_loss, train  # noqa: E402

PROFILES = ROOT / "env" / "profiles"
MARKER = 1               # the RL steps' random prompts end with it, as a chat prompt ends with <|assistant|>
PAD = 0                  # padding id of the synthetic batches
STAGE_STEPS = 3          # optimizer steps of each stage in the stages part
FP16_STEPS = 10          # of the fp16 pretraining there
PLUMBING = "python bench/gpu_check.py --cpu-plumbing"


@dataclasses.dataclass
class Setup:
    """What differs between the device run and the CPU plumbing run."""
    rt: Runtime
    dag_profile: str
    dag_only: list[str] | None     # stages of the DAG part (None: all)
    pretrain: list[tuple[str, dict]]  # (profile, overrides of its params) per pretraining run
    rl_profile: str
    rl_overrides: dict
    stages_profile: str            # the stages part's SFT, reward, DPO and fp16 runs
    stages_overrides: dict
    steps: int                     # optimizer steps of a throughput run
    warmup: int                    # of them, left out of tokens/s
    resume_k: int
    compile: bool
    exact_resume: bool             # the CPU promises bitwise equality
    dag_plan: Path | None = None   # the DAG's stages saved where DVC is (--dag-plan)
    speedrun_profile: str = "gpu-speedrun"
    speedrun_only: list[str] | None = None  # stages of the speedrun part (None: all)
    speedrun_plan: Path | None = None       # its stages saved where DVC is (--speedrun-plan)
    gpus: int = 1                  # GPUs found: the speedrun's common.nproc


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


def refuse(msg: str) -> None:
    say(msg)
    raise SystemExit(2)


def setup(args: argparse.Namespace) -> Setup:
    if args.cpu_plumbing:
        tiny = {"pretrain": {"model": {"preset": "custom", "seq_len": 64, "n_layer": 2, "n_head": 2, "n_kv_head": 2,
                                       "n_embd": 32}, "batch_size": 2},
                "tokenizer": {"vocab_size": 512}, "common": {"device": "cpu", "dtype": "fp32"}}
        rl = {**tiny, "ppo": {"rollout_prompts": 4, "minibatch_size": 2, "max_new_tokens": 8},
              "grpo": {"prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "max_new_tokens": 8}}
        stages = {**tiny, **{name: {"batch_size": 2} for name in ("sft", "reward", "dpo")}}
        return Setup(Runtime(torch.device("cpu"), torch.float32), "smoke", ["prepare", "tokenizer", "tokenize"],
                     [("gpu-77m", tiny)], "gpu-77m", rl, stages_profile="gpu-77m", stages_overrides=stages,
                     steps=4, warmup=1, resume_k=2, compile=False, exact_resume=True, speedrun_profile="smoke",
                     speedrun_only=["prepare", "tokenizer", "tokenize", "pretrain"])
    if not torch.cuda.is_available():
        refuse(f"needs a CUDA GPU, and torch.cuda.is_available() is False here (torch {torch.__version__},"
               f" CUDA build {torch.version.cuda}). Run it on a machine with an NVIDIA GPU; to check only this"
               f" script's plumbing on a CPU (tiny sizes, no GPU figures):\n    {PLUMBING}")
    device = torch.device("cuda", 0)
    if not torch.cuda.is_bf16_supported():
        refuse(f"{torch.cuda.get_device_name(device)} has no bf16; this check measures bf16 training")
    return Setup(Runtime(device, torch.bfloat16), "gpu-13m", None, [("gpu-77m", {}), ("gpu-406m", {})], "gpu-77m",
                 {}, stages_profile="gpu-77m", stages_overrides={}, steps=30, warmup=10, resume_k=10, compile=True,
                 exact_resume=False, gpus=torch.cuda.device_count())


def profile_params(name: str, overrides: dict) -> dict:
    params = render(name, PROFILES)[0]
    for section, values in overrides.items():
        for k, v in values.items():
            if isinstance(v, dict):
                params[section][k].update(v)
            else:
                params[section][k] = v
    return params


def sync(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


def reset_peak(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        gc.collect()  # what an earlier run left in reference cycles would count in this one's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(rt.device)


def peak_gib(rt: Runtime) -> float | None:
    return torch.cuda.max_memory_allocated(rt.device) / GIB if rt.device.type == "cuda" else None


# ---------------------------------------------------------------------------
# 0. the speedrun: a whole profile at its own step counts

TRAINED = ("pretrain", "sft", "reward", "dpo")  # the stages whose metrics carry tokens_seen and train_time_s
EVAL_COLUMNS = (("math greedy", "math_exact_match"), ("math sampled", "math_sample_accuracy"),
                ("pass@k", "math_pass_at_k"), ("tasks", "task_exact_match"), ("arithmetic", "arithmetic_exact_match"))


def flop_counts(params: dict) -> tuple[int, int]:
    """Training FLOPs per token of the profile's model by two counts: (this project's, nanochat's).

    This project's (llm/nn/model.py GPT.flops_per_token): 6 x every weight that takes part in a matmul,
    the tied embedding included because the LM head multiplies by it, + 12 x n_layer x n_head x
    head_dim x seq_len for attention. nanochat's: 6 x the non-embedding parameters + 12 x n_layer x
    n_embd x seq_len. The attention terms agree (n_head x head_dim = n_embd); nanochat's model has
    an untied head, counted among its non-embedding parameters, while here the head is the tied
    embedding, so nanochat's count leaves out the LM head's 6 x vocab_size x n_embd: the larger
    the vocabulary against the model, the lower its MFU. Both count attention at the full seq_len,
    which overstates a stage whose sequences are shorter (SFT, reward, DPO)."""
    model = GPT(model_config(params), seed=0)
    c = model.config
    return model.flops_per_token(), 6 * model.n_params(non_embedding=True) + 12 * c.n_layer * c.n_embd * c.seq_len


def stage_throughput(repo: Path, stage: str, flops: tuple[int, int], peak: float | None) -> dict:
    """tokens/s, TFLOP/s and MFU (both counts) of a trained stage from its metrics in `repo`."""
    from llm.train.metrics import read_metrics
    m = read_metrics(repo / "metrics" / f"{stage}.json")
    tokens, secs = m.get("tokens_seen"), m.get("train_time_s")
    if not tokens or not secs:
        return {}
    tps = tokens / secs
    out = {"tokens_per_s": tps, "tflops": flops[0] * tps / 1e12, "tflops_nanochat": flops[1] * tps / 1e12,
           "mfu": flops[0] * tps / peak if peak else None, "mfu_nanochat": flops[1] * tps / peak if peak else None}
    out["note"] = (f"{tokens:,} tokens in {secs:.0f} s of training: {tps:,.0f} tok/s, {out['tflops']:.1f} TFLOP/s"
                   f" ({out['tflops_nanochat']:.1f} by nanochat's count)"
                   + (f", MFU {out['mfu']:.1%} ({out['mfu_nanochat']:.1%})" if peak else ", MFU n/a (no known peak)"))
    return out


def eval_rows(repo: Path, models: list[str]) -> list[dict]:
    """One row per evaluated model: the figures of metrics/eval/<model>.json a person compares first
    (by name: the scratch copy also holds the work tree's own committed metrics)."""
    rows = []
    for f in (repo / "metrics" / "eval" / f"{model}.json" for model in models):
        m = json.loads(f.read_text(encoding="utf-8"))
        figures = {key: m.get(key) for _, key in EVAL_COLUMNS}
        rows.append({"part": "speedrun", "what": f"eval {f.stem}", "ok": True, "seconds": 0.0, **figures,
                     "note": ", ".join(f"{label} " + ("-" if figures[key] is None else f"{figures[key]:.3f}")
                                       for label, key in EVAL_COLUMNS)})
    return rows


def part_speedrun(s: Setup, tmp: Path) -> list[dict]:
    from llm.tools.rehearse import run
    params = render(s.speedrun_profile, PROFILES)[0]
    flops, peak = flop_counts(params), peak_flops(s.rt.device, s.rt.dtype)
    with contextlib.redirect_stdout(sys.stderr):  # each stage's line as it ends; stdout holds the table
        rc, stages = run(s.speedrun_profile, only=s.speedrun_only, tmp=tmp, device=s.rt.device.type,
                         plan=s.speedrun_plan, real=True, nproc=s.gpus, keep=True)
    repos = list(tmp.glob(f"rehearse-{s.speedrun_profile}-*/repo"))
    rows = []
    for r in stages:
        row = {"part": "speedrun", "what": f"{s.speedrun_profile} {r.stage}", "ok": r.ok, "seconds": r.seconds,
               "note": r.error or f"host peak RSS {r.peak_rss / GIB:.2f} GiB"}
        if r.ok and r.stage in TRAINED and repos:
            row.update(stage_throughput(repos[0], r.stage, flops, peak))
        rows.append(row)
    if not rows:
        return [{"part": "speedrun", "what": s.speedrun_profile, "ok": False, "seconds": 0.0, "note": f"exit {rc}"}]
    total = sum(r["seconds"] for r in rows)
    rows.append({"part": "speedrun", "what": f"{s.speedrun_profile} whole DAG", "ok": rc == 0, "seconds": total,
                 "note": f"{len(stages)} stages on {s.gpus} device(s); FLOPs per token {flops[0]:,} (this project's"
                         f" count), {flops[1]:,} (nanochat's)"})
    evaluated = [r.stage.removeprefix("eval@") for r in stages if r.ok and r.stage.startswith("eval@")]
    return rows + (eval_rows(repos[0], evaluated) if repos else [])


# ---------------------------------------------------------------------------
# 1. the DAG

def part_dag(s: Setup, tmp: Path) -> list[dict]:
    from llm.tools.rehearse import run
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds only the table and the JSON
        rc, rows = run(s.dag_profile, only=s.dag_only, tmp=tmp, device=s.rt.device.type, plan=s.dag_plan)
    return [{"part": "dag", "what": f"{s.dag_profile} {r.stage}", "ok": r.ok, "seconds": r.seconds,
             "note": r.error or f"host peak RSS {r.peak_rss / GIB:.2f} GiB"} for r in rows] or \
        [{"part": "dag", "what": s.dag_profile, "ok": rc == 0, "seconds": 0.0, "note": f"exit {rc}"}]


# ---------------------------------------------------------------------------
# 2. pretraining throughput, MFU and memory

def train_config(pre: dict, max_steps: int, compile_: bool) -> TrainConfig:
    """TrainConfig from a profile's pretrain knobs: no eval, no checkpoint before the end."""
    knobs = {f.name: pre[f.name] for f in dataclasses.fields(TrainConfig)}
    knobs.update(max_steps=max_steps, grad_accum=1, warmup_steps=min(pre["warmup_steps"], max_steps // 10),
                 eval_every=10**9, checkpoint_every=10**9, log_every=max_steps, keep_checkpoints=2,
                 nonfinite_policy="raise", compile=compile_)
    return TrainConfig(**knobs)


def random_tokens(vocab: int, n: int, seed: int) -> np.ndarray:
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    return np.random.default_rng(seed).integers(0, vocab, n, dtype=dtype)


def windows(tokens: np.ndarray, seq_len: int, cfg: TrainConfig):
    """Pretraining's batch source: random windows of `tokens`."""
    from llm.data.batching import WindowSampler
    return WindowSampler(tokens, seq_len=seq_len, batch_size=cfg.batch_size, grad_accum=1, seed=0)


def run_train(model: torch.nn.Module, cfg: TrainConfig, rt: Runtime, batches, run_dir: Path, loss_fn=lm_loss):
    with contextlib.redirect_stdout(sys.stderr):
        return train(model, cfg, rt, stage="bench", seed=0, batches=batches, loss_fn=loss_fn, val_batches=None,
                     run_dir=run_dir, fingerprint="bench-gpu-check",
                     plots=Plots(tsv=run_dir.parent / f"{run_dir.name}.tsv"), progress=False)


def matmul_ceiling(rt: Runtime, n: int = 8192, reps: int = 10) -> float | None:
    """Measured bf16 n^3 matmul FLOP/s on this card (None on the CPU): what the card gives here."""
    if rt.device.type != "cuda":
        return None
    a = torch.randn(n, n, device=rt.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=rt.device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(rt)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(rt)
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    del a, b
    return flops


def part_pretrain(s: Setup, tmp: Path) -> list[dict]:
    ceiling = matmul_ceiling(s.rt)
    rows = []
    for name, over in s.pretrain:
        params = profile_params(name, over)
        params["pretrain"]["grad_accum"] = 1
        mcfg = model_config(params)
        tokens = random_tokens(mcfg.vocab_size, max(mcfg.seq_len + 2, 8_000_000), 0)
        for compiled in ([False, True] if s.compile else [False]):
            params["pretrain"]["compile"] = compiled  # the estimate keeps less where the stage compiles
            est = stage_memory(params)["pretrain"].peak
            est_alloc = (est.total - (CUDA_CONTEXT if s.rt.device.type == "cuda" else 0)) / GIB
            reset_peak(s.rt)
            model = GPT(mcfg, seed=0)
            cfg = train_config(params["pretrain"], s.steps, compiled)
            t0 = time.perf_counter()
            res = run_train(model, cfg, s.rt, windows(tokens, mcfg.seq_len, cfg), tmp / f"{name}-{compiled}")
            sync(s.rt)
            h = res.train_history
            w = h[s.warmup - 1]  # the end of the warm-up steps (compilation, allocator)
            tps = (h[-1]["tokens_seen"] - w["tokens_seen"]) / (h[-1]["elapsed_s"] - w["elapsed_s"])
            peak = peak_flops(s.rt.device, s.rt.dtype)
            mfu = model.flops_per_token() * tps / peak if peak else None
            mfu_measured = model.flops_per_token() * tps / ceiling if ceiling else None
            alloc = peak_gib(s.rt)
            rows.append({"part": "pretrain", "what": f"{mcfg.preset} {'compiled' if compiled else 'eager'}",
                         "ok": math.isfinite(h[-1]["loss"]), "seconds": time.perf_counter() - t0,
                         "tokens_per_s": tps, "mfu": mfu, "mfu_vs_matmul": mfu_measured, "matmul_flops": ceiling,
                         "peak_gib": alloc, "estimate_gib": est_alloc,
                         "note": (f"batch {cfg.batch_size} x {mcfg.seq_len}, {s.steps} steps ({s.warmup} warm-up):"
                                  f" {tps:,.0f} tok/s, MFU " + ("n/a (no known peak)" if mfu is None else
                                                                f"{mfu:.1%} of the datasheet bf16 peak")
                                  + (f", {mfu_measured:.1%} of a measured bf16 8192^3 matmul"
                                     f" ({ceiling / 1e12:.0f} TFLOP/s)" if ceiling else ""))})
            del model, res
    return rows


# ---------------------------------------------------------------------------
# 3. one PPO and one GRPO step

def part_rl(s: Setup, tmp: Path) -> list[dict]:
    from llm.nn.memory import PROMPT_TOKENS
    from llm.post.grpo import GRPO
    from llm.post.ppo import PPO
    from llm.train.loop import Updater

    params = profile_params(s.rl_profile, s.rl_overrides)
    mcfg = model_config(params)
    est = stage_memory(params)
    ctx = CUDA_CONTEXT if s.rt.device.type == "cuda" else 0
    g = torch.Generator().manual_seed(0)
    stop, pad = (mcfg.vocab_size - 1,), 0  # a stop id a random policy will hardly ever sample
    rows = []
    for name in ("ppo", "grpo"):
        c = dict(params[name])
        if name == "grpo":
            c["step_credit"] = 0.0  # random tokens hold no arithmetic steps to credit (and there is no tokenizer)
        cfg = (PPOConfig if name == "ppo" else GRPOConfig)(**c)
        n_prompts = cfg.rollout_prompts if name == "ppo" else cfg.prompts_per_step

        plen = min(PROMPT_TOKENS, mcfg.seq_len - cfg.max_new_tokens)

        def prompts_fn(step, n=n_prompts, plen=plen):
            ids = torch.randint(MARKER + 1, mcfg.vocab_size - 1, (n, plen), generator=g)
            ids[:, -1] = MARKER
            return ids.tolist(), [{} for _ in range(n)]

        reset_peak(s.rt)
        t0 = time.perf_counter()
        policy = GPT(mcfg, seed=1).to(s.rt.device)
        ref = GPT(mcfg, seed=1).to(s.rt.device)
        if name == "ppo":
            policy.add_head("value", seed=2)
            rm = GPT(mcfg, seed=3)
            rm.add_head("reward", seed=4)
            if params["reward"]["logprob_feature"]:
                rm.add_head("reward_logprob", marker=MARKER)
            rm = rm.to(s.rt.device).eval().requires_grad_(False)

            def reward_fn(ro, problems):  # the RM's score, as llm/sample/rewards.py's, without decoding text
                from llm.nn.reward_model import reward
                with torch.no_grad():
                    return reward(rm, ro.tokens, ro.attention_mask).float().cpu(), {}
            algo = PPO(policy, ref, cfg, prompts_fn=prompts_fn, reward_fn=reward_fn, stop_ids=stop, pad_id=pad,
                       seed=0, log=say)
        else:
            def reward_fn(ro, problems):  # distinct rewards within each group: every completion updates
                return torch.arange(len(ro), dtype=torch.float32) % cfg.group_size, {}
            algo = GRPO(policy, ref if cfg.beta > 0 else None, cfg, prompts_fn=prompts_fn, reward_fn=reward_fn,
                        stop_ids=stop, pad_id=pad, seed=0)
        updater = Updater(policy, cfg, s.rt, stage=name, say=say)
        updater.set_step(0)
        with s.rt.autocast():
            row = algo.step(0, updater)
        sync(s.rt)
        phases = [p for p in est[name].phases if p.name != "held-out eval"]
        est_alloc = (max(p.total for p in phases) - ctx) / GIB
        rows.append({"part": "rl", "what": f"{name} step {mcfg.preset}", "ok": math.isfinite(row["loss"]),
                     "seconds": time.perf_counter() - t0, "peak_gib": peak_gib(s.rt), "estimate_gib": est_alloc,
                     "note": (f"{len(prompts_fn(0)[0]) * (1 if name == 'ppo' else cfg.group_size)} rollouts x"
                              f" {cfg.max_new_tokens} tokens, minibatch {cfg.minibatch_size}: rollout"
                              f" {row['rollout_s']:.1f} s, scoring {row['scoring_s']:.1f} s,"
                              f" update {row['update_s']:.1f} s")})
        del policy, ref, algo, updater
        if name == "ppo":
            del rm
    return rows


# ---------------------------------------------------------------------------
# 4. SFT, reward-model and DPO training steps; fp16 pretraining

def answer_rows(n: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    """n token lists of `length`: the marker (a one-token prompt), then random answer tokens."""
    ids = torch.randint(MARKER + 1, vocab, (n, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = MARKER
    return ids.tolist()


def random_pairs(n: int, vocab: int, seq_len: int) -> list:
    """n preference pairs whose sides are seq_len tokens: the longest llm.data.preference keeps."""
    from llm.data.preference import EncodedPair
    rows = answer_rows(2 * n, vocab, seq_len, seed=3)
    return [EncodedPair(chosen=rows[i], rejected=rows[n + i], prompt_len=1) for i in range(n)]


def measure(rt: Runtime, params: dict, stage: str, what: str, model: torch.nn.Module, batches, loss_fn,
            run_dir: Path, steps: int = STAGE_STEPS):
    """Train `model` for `steps` steps with the `stage` section's knobs, compiled where the section
    says so: (its row, the TrainResult). The row's peak allocated memory is held against the
    estimate of the stage's train phase."""
    train_phase = next(p for p in stage_memory(params)[stage].phases if p.name == "train")
    est = (train_phase.total - (CUDA_CONTEXT if rt.device.type == "cuda" else 0)) / GIB
    reset_peak(rt)
    t0 = time.perf_counter()
    cfg = train_config(params[stage], steps, compile_=params[stage]["compile"])
    res = run_train(model, cfg, rt, batches, run_dir, loss_fn)
    sync(rt)
    losses = [r["loss"] for r in res.train_history]
    peak = peak_gib(rt)
    ratio = peak / est if peak is not None else None
    note = f"{steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return {"part": "stages", "what": what, "ok": all(math.isfinite(x) for x in losses),
            "seconds": time.perf_counter() - t0, "peak_gib": peak, "estimate_gib": est, "peak_vs_estimate": ratio,
            "losses": losses, "note": note + (f"; peak / estimate {ratio:.2f}" if ratio is not None else "")}, res


def stage_sft(s: Setup, params: dict, run_dir: Path) -> dict:
    """SFT's step; compiled (sft.compile) it takes the full-head loss, as stages/sft.py does."""
    from llm.data.batching import BucketBatchSampler, ExampleBatches, pad_collate
    from llm.train.trainer import supervised_lm_loss
    mcfg, c = model_config(params), params["sft"]
    seqs = answer_rows(c["batch_size"] * STAGE_STEPS, mcfg.vocab_size, mcfg.seq_len + 1, seed=2)
    masks = [[False] + [True] * mcfg.seq_len] * len(seqs)  # every target supervised
    sampler = BucketBatchSampler([len(x) for x in seqs], batch_size=c["batch_size"], bucket_width=c["bucket_width"],
                                 seed=0)
    batches = ExampleBatches(sampler, lambda ix: pad_collate([seqs[i] for i in ix], pad_id=PAD,
                                                             loss_masks=[masks[i] for i in ix]))
    compiled = c["compile"]
    row, _ = measure(s.rt, params, "sft", f"sft {mcfg.preset}" + (" compiled" if compiled else ""),
                     GPT(mcfg, seed=0), batches, lm_loss if compiled else supervised_lm_loss, run_dir)
    row["note"] = f"batch {c['batch_size']} x {mcfg.seq_len}, every target supervised: {row['note']}"
    return row


def stage_reward(s: Setup, params: dict, run_dir: Path) -> dict:
    from llm.data.preference import pair_batches
    from llm.nn.optim import set_trainable
    from llm.nn.reward_model import RewardModel, reward_loss_fn
    mcfg, c = model_config(params), params["reward"]
    gpt = GPT(mcfg, seed=0)
    gpt.add_head("reward", seed=1)
    if c["logprob_feature"]:
        gpt.add_head("reward_logprob", marker=MARKER)
    if not c["train_trunk"]:
        set_trainable(gpt, [f"{h}_head.*" for h in gpt.head_names if h.startswith("reward")], "reward.train_trunk")
    batches = pair_batches(random_pairs(c["batch_size"] * STAGE_STEPS, mcfg.vocab_size, mcfg.seq_len),
                           batch_size=c["batch_size"], bucket_width=c["bucket_width"], seed=0, pad_id=PAD)
    row, _ = measure(s.rt, params, "reward", f"reward {mcfg.preset}", RewardModel(gpt), batches,
                     reward_loss_fn(c["label_smoothing"], c["margin"]), run_dir)
    row["note"] = (f"{c['batch_size']} pairs x {mcfg.seq_len}, likelihood feature {c['logprob_feature']},"
                   f" train_trunk {c['train_trunk']}: {row['note']}")
    return row


def stage_dpo(s: Setup, params: dict, run_dir: Path) -> dict:
    from llm.data.preference import pair_batches
    from llm.nn.optim import set_trainable
    from llm.post.dpo import dpo_loss_fn, reference_logprobs
    mcfg, c = model_config(params), params["dpo"]
    # the frozen reference stays on the device while the policy trains, as in the stage and its estimate
    reference = GPT(mcfg, seed=0).to(s.rt.device).requires_grad_(False).eval()
    policy = GPT(mcfg, seed=0)
    set_trainable(policy, c["trainable"], "dpo.trainable")
    pairs = random_pairs(c["batch_size"] * STAGE_STEPS, mcfg.vocab_size, mcfg.seq_len)
    ref = reference_logprobs(reference, pairs, pad_id=PAD, batch_size=2 * c["batch_size"],
                             per_token=c["loss_type"] == "ipo", device=s.rt.device, autocast=s.rt.autocast)
    batches = pair_batches(pairs, batch_size=c["batch_size"], bucket_width=c["bucket_width"], seed=0, pad_id=PAD,
                           ref=ref)
    row, _ = measure(s.rt, params, "dpo", f"dpo {mcfg.preset}", policy, batches,
                     dpo_loss_fn(c["beta"], c["loss_type"], c["label_smoothing"]), run_dir)
    row["note"] = (f"{c['batch_size']} pairs x {mcfg.seq_len}, loss {c['loss_type']}, trainable {c['trainable']}:"
                   f" {row['note']}")
    return row


def fp16_pretrain(s: Setup, params: dict, run_dir: Path) -> dict:
    from llm.train.checkpoint import checkpoint_path, load_checkpoint
    params = {**params, "common": {**params["common"], "dtype": "fp16"}}
    mcfg, c = model_config(params), params["pretrain"]
    rt = Runtime(s.rt.device, torch.float16)  # the loop's Updater takes a GradScaler for it
    cfg = train_config(c, FP16_STEPS, compile_=False)
    tokens = random_tokens(mcfg.vocab_size, max(mcfg.seq_len + 2, 2_000_000), 2)
    row, res = measure(rt, params, "pretrain", f"pretrain fp16 {mcfg.preset}", GPT(mcfg, seed=0),
                       windows(tokens, mcfg.seq_len, cfg), lm_loss, run_dir, FP16_STEPS)
    scale = load_checkpoint(checkpoint_path(run_dir, res.step)).train_state["updater"]["scaler"]["scale"]
    m = res.metrics
    row.update(loss_scale=scale, amp_overflows=m["amp_overflows"], nonfinite_skips=m["nonfinite_skips"])
    row["note"] = (f"batch {c['batch_size']} x {mcfg.seq_len}, {row['note']}; loss scale {scale:g} at the end,"
                   f" {m['amp_overflows']} overflowed step(s) dropped and retried, {m['nonfinite_skips']} skipped")
    return row


def part_stages(s: Setup, tmp: Path) -> list[dict]:
    profile = profile_params(s.stages_profile, s.stages_overrides)
    params = copy.deepcopy(profile)
    for name in ("pretrain", "sft", "reward", "dpo"):
        params[name]["compile"] = False  # eager, and the estimate that goes with it
    runs = [("sft", stage_sft, params), ("reward", stage_reward, params), ("dpo", stage_dpo, params),
            ("fp16", fp16_pretrain, params)]
    if s.compile and profile["sft"]["compile"]:  # SFT also as the profile runs it (no compiling in the plumbing)
        runs.append(("sft-compiled", stage_sft, profile))
    rows = []
    for name, run, p in runs:
        t0 = time.perf_counter()
        try:
            rows.append(run(s, p, tmp / name))
        except Exception as e:  # noqa: BLE001 - one failing stage (out of memory) must not hide the others' rows
            rows.append({"part": "stages", "what": name, "ok": False, "seconds": time.perf_counter() - t0,
                         "note": error_note(e)})
    return rows


# ---------------------------------------------------------------------------
# 5. SIGTERM and resume on the device

def part_resume(s: Setup, tmp: Path) -> list[dict]:
    params = profile_params(*s.pretrain[0])
    mcfg = model_config(params)
    k = s.resume_k
    pre = dict(params["pretrain"], batch_size=min(8, params["pretrain"]["batch_size"]))
    cfg = train_config(pre, 2 * k, compile_=False)
    tokens = random_tokens(mcfg.vocab_size, max(mcfg.seq_len + 2, 2_000_000), 1)
    t0 = time.perf_counter()
    ref = run_train(GPT(mcfg, seed=0), cfg, s.rt, windows(tokens, mcfg.seq_len, cfg), tmp / "ref")
    calls = [0]

    def term_at_k(model, batch):
        out = lm_loss(model, batch)
        calls[0] += 1
        if calls[0] == k:  # during step k: the loop finishes it, writes ckpt-k and exits 128 + 15
            signal.raise_signal(signal.SIGTERM)
        return out

    code = None
    try:
        run_train(GPT(mcfg, seed=0), cfg, s.rt, windows(tokens, mcfg.seq_len, cfg), tmp / "run", loss_fn=term_at_k)
    except SystemExit as e:
        code = e.code
    resumed = run_train(GPT(mcfg, seed=0), cfg, s.rt, windows(tokens, mcfg.seq_len, cfg), tmp / "run")
    a = [r["loss"] for r in ref.train_history[k:]]
    b = [r["loss"] for r in resumed.train_history[k:]]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
    ok = (code == 128 + signal.SIGTERM and resumed.resumed_from == k
          and (a == b if s.exact_resume else rel <= 1e-3))
    return [{"part": "resume", "what": f"{mcfg.preset} {k} + {k} vs {2 * k} steps", "ok": ok,
             "seconds": time.perf_counter() - t0, "resume_max_rel_diff": rel, "resume_bitwise": a == b,
             "note": (f"exit {code}, resumed from {resumed.resumed_from}, max rel loss diff {rel:.2g},"
                      f" bitwise {a == b}")}]


PARTS = {"speedrun": part_speedrun, "dag": part_dag, "pretrain": part_pretrain, "rl": part_rl, "stages": part_stages,
         "resume": part_resume}
# expected on an H200, for --budget-s; the speedrun's is docs/gpu.md's estimate for an H100
COST_S = {"speedrun": 480, "dag": 240, "pretrain": 180, "rl": 60, "stages": 60, "resume": 40}


def error_note(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-plumbing", action="store_true", help="tiny sizes on the CPU: checks the script only")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="skip a part that would start after this many seconds (default 540 = 9 min)")
    ap.add_argument("--save-dag-plan", metavar="FILE", type=Path,
                    help="write the stages DVC lists for the DAG part to FILE and stop (needs DVC, not a GPU)")
    ap.add_argument("--dag-plan", metavar="FILE", type=Path,
                    help="the DAG part takes its stages from a --save-dag-plan FILE instead of from DVC")
    ap.add_argument("--save-speedrun-plan", metavar="FILE", type=Path,
                    help="the same for the speedrun part (its params differ: a plan of its own) and stop;"
                         " --gpus N: for a machine with N GPUs (common.nproc is in the plan's params)")
    ap.add_argument("--gpus", type=int, default=1, help="with --save-speedrun-plan: the GPUs of the machine")
    ap.add_argument("--speedrun-plan", metavar="FILE", type=Path,
                    help="the speedrun part takes its stages from a --save-speedrun-plan FILE")
    args = ap.parse_args(argv)
    if args.save_dag_plan or args.save_speedrun_plan:
        from llm.tools.rehearse import run
        dag, speedrun = ("smoke", "smoke") if args.cpu_plumbing else ("gpu-13m", "gpu-speedrun")
        device = "cpu" if args.cpu_plumbing else "cuda"
        try:
            if args.save_speedrun_plan:
                return run(speedrun, device=device, save_plan=args.save_speedrun_plan, real=True, nproc=args.gpus)[0]
            return run(dag, device=device, save_plan=args.save_dag_plan)[0]
        except RuntimeError as e:
            refuse(str(e))
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        refuse(f"--parts: unknown {bad}; expected some of {', '.join(PARTS)}")
    s = setup(args)
    s.dag_plan, s.speedrun_plan = args.dag_plan, args.speedrun_plan
    t_start = time.perf_counter()
    dev = torch.cuda.get_device_name(s.rt.device) if s.rt.device.type == "cuda" else "cpu (plumbing only)"
    say(f"{dev}, torch {torch.__version__}, {str(s.rt.dtype).removeprefix('torch.')}; parts {', '.join(parts)}")
    rows: list[dict] = []
    for part in parts:
        elapsed = time.perf_counter() - t_start
        if not args.cpu_plumbing and elapsed + COST_S[part] > args.budget_s:
            rows.append({"part": part, "what": "-", "ok": None, "seconds": 0.0,
                         "note": f"skipped: {elapsed:.0f} s spent, about {COST_S[part]} s more would pass --budget-s"})
            continue
        say(f"part {part} at {elapsed:.0f} s")
        with tempfile.TemporaryDirectory(prefix=f"gpu_check-{part}-") as d:
            n = len(rows)
            try:
                rows += PARTS[part](s, Path(d))
            except Exception as e:  # noqa: BLE001 - one broken part must not hide the others' figures
                rows.append({"part": part, "what": "-", "ok": False, "seconds": time.perf_counter() - t_start - elapsed,
                             "note": error_note(e)})
            for r in rows[n:]:  # as each part ends: a run cut short by its time limit still leaves these
                say(f"row {json.dumps(r)}")

    def gib(v):
        return "-" if v is None else f"{v:.2f}"
    cells = [["part", "what", "result", "seconds", "peak alloc GiB", "estimate GiB", "note"]]
    cells += [[r["part"], r["what"], {True: "ok", False: "FAILED", None: "skipped"}[r["ok"]], f"{r['seconds']:.0f}",
               gib(r.get("peak_gib")), gib(r.get("estimate_gib")), r["note"]] for r in rows]
    total = time.perf_counter() - t_start
    print("\n".join(format_table(cells)))
    print(f"device {dev}; torch {torch.__version__}; total {total:.0f} s; estimate = llm/nn/memory.py's, without the"
          f" 1 GiB CUDA context the allocator does not see")
    print(json.dumps({"bench": "gpu_check", "device": dev, "torch": torch.__version__, "total_s": total,
                      "plumbing": args.cpu_plumbing, "rows": rows}))
    return 1 if any(r["ok"] is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
