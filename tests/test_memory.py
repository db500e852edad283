"""llm/nn/memory.py: the exact parts of every stage's estimate equal tensors allocated at full size on the CPU,
built as the stages build them; the estimated parts follow their stated formulas; fit_problems names the key."""
from __future__ import annotations

import pytest
import torch

from llm.config import ModelConfig
from llm.nn.memory import GIB, PROMPT_TOKENS, fit_problems, kv_cache_bytes, largest_fitting, model_config, stage_memory
from llm.tools.profile import render
from tests.conftest import ROOT

PROFILES = ROOT / "env" / "profiles"
EXACT_PARTS = ("weights", "gradients", "optimizer", "kv_cache")


def _bytes(tensors) -> int:
    """Bytes of distinct storages (a tied matrix counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _available() -> int:
    from llm.tools.rehearse import available_memory
    return available_memory()


class Allocated:
    """Models of a profile allocated on the CPU the way the stages build them; bytes measured."""

    def __init__(self, params: dict):
        self.cfg = model_config(params)
        self.params = params
        self._cache: dict = {}

    def _gpt(self, heads):
        from llm.nn.model import GPT
        base = [h for h in heads if h in ("lm",)]
        gpt = GPT(self.cfg, heads=tuple(base))
        for h in heads:
            if h in ("value", "reward"):
                gpt.add_head(h, seed=1)
            elif h == "reward_logprob":
                gpt.add_head(h, marker=3)
        return gpt

    def weights(self, heads) -> int:
        if ("w", heads) not in self._cache:
            gpt = self._gpt(heads)
            self._cache[("w", heads)] = _bytes([*gpt.parameters(), *gpt.buffers()])
        return self._cache[("w", heads)]

    def trained(self, heads, trainable=None, reward_view=False) -> dict[str, int]:
        """weights, gradients and AdamW state after one step (llm.nn.optim.build_optimizer, fused on the CPU)."""
        key = ("t", heads, trainable, reward_view)
        if key not in self._cache:
            from llm.nn.optim import build_optimizer, set_trainable
            from llm.nn.reward_model import RewardModel
            gpt = self._gpt(heads)
            if trainable is not None:
                set_trainable(gpt, list(trainable))
            model = RewardModel(gpt) if reward_view else gpt
            section = self.params["pretrain"]
            opt = build_optimizer(model, _Cfg(section), "cpu")
            ps = [p for p in model.parameters() if p.requires_grad]
            for p in ps:
                p.grad = torch.zeros_like(p)
            opt.step()
            state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            self._cache[key] = {"weights": _bytes([*model.parameters(), *model.buffers()]),
                                "gradients": _bytes(p.grad for p in ps), "optimizer": _bytes(state)}
            del model, gpt, opt
        return self._cache[key]

    def kv(self, batch: int, max_len: int) -> int:
        from llm.nn.model import GPT
        from llm.sample.generate import KVCache
        c = KVCache.for_model(GPT(self.cfg, device="meta").to_empty(device="cpu"), batch, max_len)
        return _bytes([c.k, c.v, c.mask, c.n_real])


class _Cfg:
    """The optimizer knobs build_optimizer reads, from a params section."""

    def __init__(self, section: dict):
        self.lr, self.weight_decay = section["lr"], section["weight_decay"]
        self.beta1, self.beta2 = section["beta1"], section["beta2"]


def expected(params: dict, a: Allocated) -> dict[str, dict[str, dict[str, int]]]:
    """{stage: {phase: exact parts}} restated from the stage scripts, measured on allocated tensors."""
    T = a.cfg.seq_len
    rm_heads = ("lm", "reward", "reward_logprob") if params["reward"]["logprob_feature"] else ("lm", "reward")
    w_lm, w_rm = a.weights(("lm",)), a.weights(rm_heads)

    def gen(section):  # positions of a prompt and its answer
        return min(T, PROMPT_TOKENS + params[section]["max_new_tokens"])

    lm = a.trained(("lm",))
    r = params["reward"]
    probe = None if r["train_trunk"] else tuple(f"{h}_head.*" for h in rm_heads if h.startswith("reward"))
    rmt = a.trained(rm_heads, probe, reward_view=True)
    d = params["dpo"]
    pol = a.trained(("lm",), None if d["trainable"] == ["*"] else tuple(d["trainable"]))
    val = a.trained(("lm", "value"))
    p, g, e = params["ppo"], params["grpo"], params["eval"]
    ppo_held = val["weights"] + w_lm + (w_rm if p["reward_source"] != "verifier" else 0)
    grpo_held = w_lm * (2 if g["beta"] > 0 else 1)
    w3 = 2 * w_lm + w_rm
    return {
        "pretrain": {"train": lm},
        "sft": {"train": lm, "math eval": {"weights": 2 * w_lm,
                                           "kv_cache": a.kv(min(64, params["sft"]["eval_math_problems"]), gen("sft"))}},
        "reward": {"train": rmt, "held-out scoring": {"weights": 2 * rmt["weights"]}},
        "pairs": {"generate": {"weights": w_lm + w_rm, "kv_cache": a.kv(params["pairs"]["batch_size"], gen("pairs"))},
                  "RM scoring": {"weights": w_lm + w_rm}},
        "dpo": {"reference log-probs": {"weights": pol["weights"] + w_lm},
                "train": {**pol, "weights": pol["weights"] + w_lm},
                "KL to SFT": {"weights": 2 * pol["weights"] + w_lm,
                              "kv_cache": a.kv(2 * d["batch_size"], gen("dpo"))}},
        "ppo": {"rollout": {"weights": ppo_held, "optimizer": val["optimizer"],
                            "kv_cache": a.kv(p["rollout_prompts"], gen("ppo"))},
                "scoring": {"weights": ppo_held, "optimizer": val["optimizer"]},
                "update": {**val, "weights": ppo_held},
                "held-out eval": {"weights": ppo_held, "optimizer": val["optimizer"],
                                  "kv_cache": a.kv(min(64, p["eval_problems"]), gen("ppo"))}},
        "grpo": {"rollout": {"weights": grpo_held, "optimizer": lm["optimizer"],
                             # dynamic sampling rolls out oversample x prompts_per_step groups at once
                             "kv_cache": a.kv(g["prompts_per_step"] * g.get("oversample", 1) * g["group_size"],
                                              gen("grpo"))},
                 "scoring": {"weights": grpo_held, "optimizer": lm["optimizer"]},
                 "update": {**lm, "weights": grpo_held},
                 "held-out eval": {"weights": grpo_held, "optimizer": lm["optimizer"],
                                   "kv_cache": a.kv(min(64, g["eval_problems"]), gen("grpo"))}},
        "eval": {"perplexity": {"weights": w3},
                 "generate": {"weights": w3, "kv_cache": a.kv(e["batch_size"], gen("eval"))},
                 "RM scoring": {"weights": w3},
                 "KL to SFT": {"weights": w3, "kv_cache": a.kv(e["batch_size"], gen("eval"))}},
    }


_ALLOC: dict[str, tuple[dict, dict]] = {}


def _measured(name: str):
    if name not in _ALLOC:
        params = render(name, PROFILES)[0]
        _ALLOC.clear()  # one profile's models at a time
        torch.set_num_threads(1)
        _ALLOC[name] = (params, expected(params, Allocated(params)))
    return _ALLOC[name]


@pytest.mark.parametrize("name", ["gpu-13m", "gpu-77m", pytest.param("gpu-406m", marks=pytest.mark.slow)])
def test_exact_parts_equal_tensors_allocated_at_full_size(name):
    params = render(name, PROFILES)[0]
    if name == "gpu-406m":
        # one model with its gradients and AdamW at a time (the KV caches are allocated, never
        # written, so they take no resident memory)
        need = stage_memory(params)["pretrain"].phases[0].exact + 2 * GIB
        if _available() < need:
            pytest.skip(f"needs ~{need / GIB:.0f} GiB free to allocate {name}'s tensors, {_available() / GIB:.0f} here")
    params, want = _measured(name)
    got = stage_memory(params)
    assert set(got) == set(want)
    for stage, phases in want.items():
        est = {p.name: p for p in got[stage].phases}
        assert set(est) == set(phases), stage
        for phase, parts in phases.items():
            for part in EXACT_PARTS:
                have, measured = est[phase].parts.get(part, 0), parts.get(part, 0)
                assert abs(have - measured) <= 0.05 * measured, (stage, phase, part, have, measured)


def test_kv_cache_formula_is_the_allocated_cache():
    cfg = ModelConfig(vocab_size=300, seq_len=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=32)
    a = Allocated({"pretrain": {"model": vars(cfg)}, "tokenizer": {"vocab_size": 300}})
    assert kv_cache_bytes(cfg, 5, 40) == a.kv(5, 40)


def test_the_gpu_profiles_fit_their_cards():
    from llm.tools.profile import card_gib
    for name in ("gpu-13m", "gpu-77m", "gpu-406m"):
        assert card_gib(name, PROFILES)
        assert fit_problems(render(name, PROFILES)[0], card_gib(name, PROFILES)) == [], name


def test_a_batch_too_large_for_the_card_is_named_with_the_largest_that_fits():
    params = render("gpu-77m", PROFILES)[0]
    params["dpo"]["batch_size"] = 64
    problems = fit_problems(params, 40)
    assert len(problems) == 1 and problems[0].startswith("dpo: estimated")
    best = largest_fitting(params, "dpo", "dpo.batch_size", int(40 * 0.9 * GIB))
    assert 0 < best < 64 and f"lower dpo.batch_size: 64 -> at most {best}" in problems[0]
    params["dpo"]["batch_size"] = best
    assert fit_problems(params, 40) == []
    params["dpo"]["batch_size"] = best + 1
    assert fit_problems(params, 40) != []


def test_activations_and_logits_scale_with_the_batch_and_checkpointing_cuts_them():
    params = render("gpu-77m", PROFILES)[0]
    one = stage_memory(params)["pretrain"].phases[0].parts
    params["pretrain"]["batch_size"] *= 2
    two = stage_memory(params)["pretrain"].phases[0].parts
    n = 42_145_280 * 2  # the 16-bit weight copies do not grow with the batch
    assert two["activations"] - n == pytest.approx(2 * (one["activations"] - n), rel=1e-3)
    assert two["logits"] == 2 * one["logits"]
    assert two["weights"] == one["weights"] and two["optimizer"] == one["optimizer"]
    params["pretrain"]["activation_checkpointing"] = True
    assert stage_memory(params)["pretrain"].phases[0].parts["activations"] < two["activations"] / 3


def test_fp32_on_the_cpu_has_no_cuda_context_and_wider_activations():
    params = render("gpu-13m", PROFILES)[0]
    gpu = stage_memory(params)["pretrain"].phases[0].parts
    params["common"].update(device="cpu", dtype="fp32")
    cpu = stage_memory(params)["pretrain"].phases[0].parts
    assert gpu["context"] == GIB and cpu["context"] < GIB / 2
    assert cpu["weights"] == gpu["weights"]


def test_a_frozen_trunk_keeps_no_trunk_activations():
    params = render("gpu-77m", PROFILES)[0]
    full = stage_memory(params)["dpo"].phases[1].parts
    params["dpo"]["trainable"] = ["norm_f.weight"]
    norm = stage_memory(params)["dpo"].phases[1].parts
    assert norm["activations"] < full["activations"] / 10
    assert norm["gradients"] == 4 * params["pretrain"]["model"]["n_embd"]


def test_fsdp_shards_every_supervised_stage_and_rl_processes_roll_out_their_share():
    params = render("gpu-77m", PROFILES)[0]
    one = stage_memory(params)
    params["common"]["nproc"] = 4
    for name in ("pretrain", "sft", "reward", "dpo"):
        params[name]["distributed"] = "fsdp"
    four = stage_memory(params)
    for name, phase in (("pretrain", 0), ("sft", 0), ("reward", 0), ("dpo", 1)):
        a, b = one[name].phases[phase].parts, four[name].phases[phase].parts
        assert b["optimizer"] == pytest.approx(a["optimizer"] / 4, abs=4) and b["gradients"] < a["gradients"], name
    ref = one["pretrain"].phases[0].parts["weights"]  # dpo's frozen reference is a whole copy on every process
    assert four["dpo"].phases[1].parts["weights"] > ref
    for name in ("ppo", "grpo"):
        assert four[name].phases[0].parts["kv_cache"] == pytest.approx(one[name].phases[0].parts["kv_cache"] / 4,
                                                                      rel=0.01), name
