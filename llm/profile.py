"""Profiles: named sets of hyperparameters for a machine size.

    python -m llm.profile list              # the profiles and what each is for
    python -m llm.profile use smoke         # write params.yaml from env/profiles/smoke.yaml
    python -m llm.profile diff gpu-77m      # keys where that profile differs from params.yaml
    python -m llm.profile memory gpu-406m   # estimated training memory of that profile's pretraining

`env/profiles/cpu.yaml` is a complete params file (the default, 2 CPU cores, <= 30 min).
Every other profile starts with `extends: cpu` and lists only the keys it changes, so a
reader sees at a glance what makes `smoke` small or `gpu-77m` big:

    extends: cpu
    description: whole DAG in <= 3 min on 2 cores (CI)
    pretrain: {max_steps: 30}

`use` renders the profile, validates it with llm/config.py (every problem at once, nothing
written on error) and writes params.yaml atomically with a header naming the profile.
DVC then sees ordinary params changes, so `dvc repro` reruns what the switch touched.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from llm.config import ConfigError, load_params_text
from llm.fileio import atomic_write_text

PROFILES = Path("env/profiles")
META_KEYS = ("extends", "description")


def available(profiles: Path = PROFILES) -> list[str]:
    return sorted(p.stem for p in profiles.glob("*.yaml"))


def _read(name: str, profiles: Path) -> dict:
    f = profiles / f"{name}.yaml"
    if not f.is_file():
        raise ConfigError([f"{f}: no such profile; available: {', '.join(available(profiles))}"])
    data = yaml.safe_load(f.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ConfigError([f"{f}: expected a mapping"])
    return data


def _merge(base: dict, over: dict, where: str, path: str = "") -> dict:
    """Deep-merge `over` into a copy of `base`; a key unknown to the base is an error."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        key = f"{path}.{k}" if path else k
        if k not in out:
            raise ConfigError([f"{where}: {key}: not a key of the base profile"])
        if isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = _merge(out[k], v, where, key)
        else:
            out[k] = copy.deepcopy(v)
    return out


def render(name: str, profiles: Path = PROFILES, _seen: tuple[str, ...] = ()) -> tuple[dict, str]:
    """(the full params mapping, the description) of a profile."""
    if name in _seen:
        raise ConfigError([f"{profiles}/{name}.yaml: `extends` loops: {' -> '.join(_seen + (name,))}"])
    data = _read(name, profiles)
    desc = str(data.get("description", ""))
    body = {k: v for k, v in data.items() if k not in META_KEYS}
    parent = data.get("extends")
    if parent is None:
        return body, desc
    base, _ = render(str(parent), profiles, _seen + (name,))
    return _merge(base, body, f"{profiles}/{name}.yaml"), desc


def to_yaml(params: dict, name: str, desc: str) -> str:
    header = (f"# profile: {name}" + (f" ({desc})" if desc else "") + "\n"
              f"# Written by `python -m llm.profile use {name}` from env/profiles/. Edit the profile and\n"
              f"# re-run that command, or change single values with `dvc exp run -S section.key=value`.\n"
              f"# Floats are written with a dot and a signed exponent (3.0e-4), which YAML 1.1 (PyYAML)\n"
              f"# and 1.2 (DVC) both read as floats.\n")
    # Block style for mappings (one key per line, easy to diff and to edit), flow style for
    # lists of scalars, a blank line between sections. PyYAML writes 0.0003 as 0.0003 and 1e-05
    # as 1.0e-05: both are read alike by YAML 1.1 and 1.2.
    sections = [yaml.dump({k: v}, Dumper=_ParamsDumper, sort_keys=False, allow_unicode=True, width=100)
                for k, v in params.items()]
    return header + "\n".join(sections)


class _ParamsDumper(yaml.SafeDumper):
    def represent_list(self, data):
        flow = all(not isinstance(x, (dict, list)) for x in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    def represent_dict(self, data):
        return self.represent_mapping("tag:yaml.org,2002:map", data, flow_style=False)


_ParamsDumper.add_representer(list, _ParamsDumper.represent_list)
_ParamsDumper.add_representer(dict, _ParamsDumper.represent_dict)


def validate(name: str, profiles: Path = PROFILES) -> str:
    """The rendered params text of a profile, checked by the same rules as params.yaml."""
    params, desc = render(name, profiles)
    text = to_yaml(params, name, desc)
    load_params_text(text, f"{profiles}/{name}.yaml (rendered)")
    return text


def memory_estimate(params: dict) -> dict[str, float]:
    """Estimated peak training memory (GiB) of a profile's pretraining, per GPU.

    An estimate, not a measurement: fp32 master weights, gradients and two AdamW moments
    (16 bytes per parameter), activations of bf16 training with fused attention and no
    activation checkpointing (~34 bytes per token per layer per channel, Korthikanti et
    al. 2022, without the attention-score term that fused kernels never store), the logits
    (bf16 logits, their fp32 copy for the loss, and its gradient: ~10 bytes per token per
    vocabulary entry), and ~1 GiB for the CUDA context and allocator slack.
    """
    from llm.config import ModelConfig
    from llm.model import GPT

    pre = params["pretrain"]
    m = dict(pre["model"])
    m["vocab_size"] = m["vocab_size"] or params["tokenizer"]["vocab_size"]
    cfg = ModelConfig(**m)
    n = GPT(cfg, device="meta").n_params()
    tokens = pre["batch_size"] * cfg.seq_len
    gib = 1024 ** 3
    states = 16 * n / gib
    acts = 34 * tokens * cfg.n_layer * cfg.n_embd / gib
    if pre["activation_checkpointing"]:
        acts = acts / cfg.n_layer + 2 * tokens * cfg.n_layer * cfg.n_embd / gib  # one layer live + inputs
    logits = 10 * tokens * cfg.vocab_size / gib
    return {"n_params_m": n / 1e6, "weights_grads_adam_gib": states, "activations_gib": acts,
            "logits_gib": logits, "total_gib": states + acts + logits + 1.0}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: d}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="List, switch and compare hyperparameter profiles.",
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the profiles and their descriptions")
    u = sub.add_parser("use", help="write params.yaml from a profile")
    u.add_argument("name")
    u.add_argument("--params", default="params.yaml")
    d = sub.add_parser("diff", help="keys where a profile differs from params.yaml")
    d.add_argument("name")
    d.add_argument("--params", default="params.yaml")
    m = sub.add_parser("memory", help="estimated pretraining memory per GPU (not a measurement)")
    m.add_argument("name")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for name in available():
                print(f"{name:<10} {render(name)[1]}")
            return 0
        if args.cmd == "use":
            text = validate(args.name)
            atomic_write_text(args.params, text)
            print(f"{args.params}: now profile {args.name!r}; `dvc repro` reruns what changed"
                  f" (`dvc status` shows which stages)")
            return 0
        if args.cmd == "memory":
            params = render(args.name)[0]
            est = memory_estimate(params)
            pre = params["pretrain"]
            print(f"{args.name}: {est['n_params_m']:.1f}M parameters, batch {pre['batch_size']} x"
                  f" {pre['model']['seq_len']} tokens: ESTIMATED {est['total_gib']:.1f} GiB"
                  f" (weights+grads+AdamW {est['weights_grads_adam_gib']:.1f}, activations"
                  f" {est['activations_gib']:.1f}, logits {est['logits_gib']:.1f}, context ~1.0)")
            return 0
        new = _flat(render(args.name)[0])
        old = _flat(yaml.safe_load(Path(args.params).read_text(encoding="utf-8")))
        for k in sorted(set(new) | set(old)):
            if new.get(k) != old.get(k):
                print(f"{k}: {old.get(k)!r} -> {new.get(k)!r}")
        return 0
    except ConfigError as e:
        print(f"profile: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
