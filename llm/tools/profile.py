"""Profiles: named sets of hyperparameters for a machine size.

    python -m llm.profile list              # the profiles and what each is for
    python -m llm.profile use smoke         # write params.yaml from env/profiles/smoke.yaml
    python -m llm.profile diff gpu-77m      # keys where that profile differs from params.yaml
    python -m llm.profile memory gpu-406m   # memory per GPU of every stage, and whether it fits the card
    python -m llm.profile data gpu-77m      # pretraining's tokens against the distinct tokens of its text

`env/profiles/cpu.yaml` is a complete params file (the default: 2 CPU cores, about two hours).
Every other profile starts with `extends: cpu` and lists only the keys it changes, so a
reader sees at a glance what makes `smoke` small or `gpu-77m` big:

    extends: cpu
    description: whole DAG in <= 3 min on 2 cores (CI)
    pretrain: {max_steps: 30}

`use` renders the profile, validates it with llm/config.py (every problem at once, nothing
written on error) and writes params.yaml atomically with a header naming the profile.
DVC then sees ordinary params changes, so `dvc repro` reruns what the switch touched.

A GPU profile names its card's memory, `card_gib: 24` (like `description`, not inherited);
`use` then also refuses a profile whose stages would not fit that card with 10% to spare
(llm/nn/memory.py's estimate per stage), naming the key to lower and the largest value that fits.
`memory` prints that estimate; `python -m llm.rehearse NAME` (llm/tools/rehearse.py, which builds on
this module) runs the profile's DAG on the CPU.

`use` and `data` also weigh pretraining's data need: the tokens it trains on (pretrain.max_steps x
batch_size x grad_accum x seq_len) against the distinct tokens its text holds (`data_need`),
and warn, without refusing, when pretraining would read the same text more than REPEAT_WARN
times. The text is counted in bytes (Shakespeare's works and a sample of the generated math
documents measured here, a local source's file size, a hub source's size as the profile declares
it) and turned into tokens at BYTES_PER_TOKEN. A profile declares the text its hub sources yield
(after their `limit`; from the data card), like `card_gib` a key of its own file, not inherited:

    source_bytes: {HuggingFaceFW/fineweb-edu: 7000000000}

A hub source without one cannot be weighed: the check says so and does not guess.
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llm.config import ConfigError, load_params_text
from llm.fileio import atomic_write_text

PROFILES = Path("env/profiles")
META_KEYS = ("extends", "description", "card_gib", "source_bytes")


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
    # Block style for mappings and lists, one value per line, as DVC writes them: `dvc exp run -S`
    # rewrites the whole file through its own YAML writer (ruamel), which turns a flow list
    # `[1, 2]` into block lines, so a file written any other way shows every list as changed in
    # `git diff params.yaml` after an experiment (tests/test_profiles.py runs DVC's writer). Empty
    # lists stay `[]`, as DVC writes them. A blank line between sections. PyYAML writes 0.0003
    # as 0.0003 and 1e-05 as 1.0e-05: both are read alike by YAML 1.1 and 1.2.
    sections = [yaml.dump({k: v}, Dumper=_ParamsDumper, sort_keys=False, allow_unicode=True, width=100)
                for k, v in params.items()]
    return header + "\n".join(sections)


class _ParamsDumper(yaml.SafeDumper):
    def represent_list(self, data):
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=not data)

    def represent_dict(self, data):
        return self.represent_mapping("tag:yaml.org,2002:map", data, flow_style=False)


_ParamsDumper.add_representer(list, _ParamsDumper.represent_list)
_ParamsDumper.add_representer(dict, _ParamsDumper.represent_dict)


def card_gib(name: str, profiles: Path = PROFILES) -> float | None:
    """The memory of the card a profile is sized for (its own `card_gib`), or None."""
    v = _read(name, profiles).get("card_gib")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
        raise ConfigError([f"{profiles}/{name}.yaml: card_gib: expected a number of GiB > 0, got {v!r}"])
    return v


def validate(name: str, profiles: Path = PROFILES) -> str:
    """The rendered params text of a profile, checked by the same rules as params.yaml, and
    (with `card_gib`) every stage estimated to fit that card."""
    params, desc = render(name, profiles)
    text = to_yaml(params, name, desc)
    load_params_text(text, f"{profiles}/{name}.yaml (rendered)")
    card = card_gib(name, profiles)
    if card is not None:
        from llm.nn.memory import fit_problems
        problems = fit_problems(params, card)
        if problems:
            raise ConfigError([f"{profiles}/{name}.yaml: {p}" for p in problems])
    return text


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
    dn = sub.add_parser("data", help="pretraining's tokens against the distinct tokens of its text")
    dn.add_argument("name")
    m = sub.add_parser("memory", help="memory per GPU of every stage (exact parts + estimates), and the fit")
    m.add_argument("name", nargs="?", help="a profile; or give --params")
    m.add_argument("--params", help="a params file instead of a profile (e.g. after `dvc exp run -S`)")
    m.add_argument("--card-gib", type=float, help="check against a card of this many GiB (default: the"
                   " profile's card_gib)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for name in available():
                print(f"{name:<10} {render(name)[1]}")
            return 0
        if args.cmd == "use":
            text = validate(args.name)
            for w in data_need(render(args.name)[0], source_bytes(args.name)).warnings(f"{PROFILES}/{args.name}.yaml"):
                print(f"profile: warning: {w}", file=sys.stderr)
            atomic_write_text(args.params, text)
            print(f"{args.params}: now profile {args.name!r}; `dvc repro` reruns what changed"
                  f" (`dvc status` shows which stages)")
            return 0
        if args.cmd == "memory":
            return _memory(args)
        if args.cmd == "data":
            need = data_need(render(args.name)[0], source_bytes(args.name))
            print("\n".join(need.report(args.name)))
            for w in need.warnings(f"{PROFILES}/{args.name}.yaml"):
                print(f"profile: warning: {w}", file=sys.stderr)
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


# ---------------------------------------------------------------------------
# Data need: how often pretraining would read its text.

# Passes over the same text past which new text is worth much more than another pass: up to
# about four epochs cost a language model little against unique data, well beyond that the
# returns fall off fast (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models").
REPEAT_WARN = 4.0
# Bytes of text per token: the cpu profile's 4096-entry tokenizer on its own pretraining text
# (docs/log.md). A larger vocabulary packs more bytes into a token, so for those profiles this
# overstates the tokens of their text and understates how often it is repeated.
BYTES_PER_TOKEN = 3.19
MATH_SAMPLE = 500  # generated math documents measured for their mean size


@dataclass
class DataNeed:
    """Pretraining's tokens against the distinct tokens of its text."""
    trained: int                               # tokens pretraining trains on
    per_step: int                              # of them, in one optimizer step
    parts: list[tuple[str, int | None]]        # (params key, bytes of text; None = unknown)

    @property
    def distinct(self) -> float:
        """Distinct tokens of the text whose size is known."""
        return sum(b for _, b in self.parts if b) / BYTES_PER_TOKEN

    @property
    def unknown(self) -> list[str]:
        return [k for k, b in self.parts if b is None]

    @property
    def repeats(self) -> float | None:
        """How many times pretraining reads its text; None when a part's size is unknown."""
        return None if self.unknown or not self.distinct else self.trained / self.distinct

    def warnings(self, where: str) -> list[str]:
        if self.unknown:
            return [f"{where}: the size of {', '.join(self.unknown)} is unknown, so pretraining's data need"
                    f" ({self.trained:,} tokens) is not checked; declare the bytes of text each hub source"
                    f" yields in the profile's `source_bytes` (from its data card)"]
        r = self.repeats
        if r is None or r <= REPEAT_WARN:
            return []
        steps = int(self.distinct * REPEAT_WARN / self.per_step)
        return [f"{where}: pretraining reads its text about {r:.0f} times ({self.trained:,} tokens ="
                f" pretrain.max_steps x batch_size x grad_accum x model.seq_len, against about"
                f" {self.distinct:,.0f} distinct tokens in {', '.join(k for k, b in self.parts if b)}); more"
                f" than {REPEAT_WARN:g} passes buy little: add text (prepare.pretrain_sources) or lower"
                f" pretrain.max_steps to about {max(steps, 1):,}"]

    def report(self, name: str) -> list[str]:
        lines = [f"{name}: pretraining trains on {self.trained:,} tokens; its text, at {BYTES_PER_TOKEN} bytes"
                 f" a token:"]
        lines += [f"  {k:<40} {'unknown' if b is None else f'{b:,} bytes, about {b / BYTES_PER_TOKEN:,.0f} tokens'}"
                  for k, b in self.parts]
        r = self.repeats
        lines.append(f"  passes over the text: {'not known' if r is None else f'{r:.1f}'}"
                     f" (a warning above {REPEAT_WARN:g})")
        return lines


def _math_doc_bytes(prep: dict) -> float:
    """Mean bytes of one generated math document, as llm/data/splits.py writes it, over a fixed sample."""
    import random

    from llm.data.generators import math_problem
    rng, levels, total = random.Random(0), prep["math_levels"], 0
    for i in range(MATH_SAMPLE):
        p = math_problem(rng, levels[i % len(levels)], "zh" if rng.random() < prep["math_zh_fraction"] else "en")
        total += len(f"Question: {p.question}\nAnswer: {p.solution}".encode())
    return total / MATH_SAMPLE


def _source_bytes(src: dict, declared: dict) -> int | None:
    if src.get("hub"):
        return declared.get(src["hub"])
    if Path(src["path"]).is_file():
        return Path(src["path"]).stat().st_size  # on disk: JSON's quoting counts too (an overstatement)
    return None


def source_bytes(name: str, profiles: Path = PROFILES) -> dict[str, int]:
    """The bytes of text a profile declares for its hub sources (its own `source_bytes`), by hub name."""
    v = _read(name, profiles).get("source_bytes") or {}
    if not isinstance(v, dict) or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in v.values()):
        raise ConfigError([f"{profiles}/{name}.yaml: source_bytes: expected {{hub name: bytes > 0}}, got {v!r}"])
    return v


def data_need(params: dict, declared: dict[str, int] | None = None) -> DataNeed:
    """Pretraining's data need of a rendered profile; `declared`: bytes of its hub sources by name
    (see the module docstring)."""
    pre, prep = params["pretrain"], params["prepare"]
    per_step = pre["batch_size"] * pre["grad_accum"] * pre["model"]["seq_len"]
    parts: list[tuple[str, int | None]] = []
    if prep["shakespeare"]:
        from llm.data.sources import shakespeare_works
        from llm.fileio import DataError
        try:
            works = shakespeare_works()
            sizes = sorted(len(t.encode()) for _, t in works)
            # the held-out works are drawn at random: leaving out the smallest bounds the rest from above
            parts.append(("prepare.shakespeare", sum(sizes[prep["shakespeare_val_works"]:])))
        except DataError:
            parts.append(("prepare.shakespeare", None))
    if prep["math_pretrain_docs"]:
        parts.append(("prepare.math_pretrain_docs", int(prep["math_pretrain_docs"] * _math_doc_bytes(prep))))
    for i, src in enumerate(prep["pretrain_sources"]):
        parts.append((f"prepare.pretrain_sources[{i}] ({src.get('path') or 'hub:' + src.get('hub', '')})",
                      _source_bytes(src, declared or {})))
    return DataNeed(trained=pre["max_steps"] * per_step, per_step=per_step, parts=parts)


def _memory(args: argparse.Namespace) -> int:
    from llm.config import load_params, to_dict
    from llm.nn.memory import fit_problems, report

    if (args.name is None) == (args.params is None):
        raise ConfigError(["memory: give a profile name or --params FILE, not both"])
    if args.params:
        params, label, card = to_dict(load_params(args.params)), args.params, args.card_gib
    else:
        params, label = render(args.name)[0], args.name
        card = args.card_gib or card_gib(args.name)
    print("\n".join(report(params, label, card)))
    return 1 if card and fit_problems(params, card) else 0


if __name__ == "__main__":
    raise SystemExit(main())
