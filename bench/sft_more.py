"""Control for the RL stages' math gains: SFT's own loss alone, for as many updates as PPO-ptx makes.

    python bench/sft_more.py [--sft models/sft] [--data data/clean_sft] --out DIR [--updates 600]
    python -m stages.eval ppo --model DIR ...   (dvc.yaml's eval@ppo command line, --metrics elsewhere)

Continues the SFT model on its own training conversations (--data/train.jsonl, rendered as SFT
renders them, loss on the assistant's tokens): --updates AdamW steps (betas 0.9 / 0.95, no weight
decay, gradient norm clipped at 0.5, constant --lr) on --batch conversations drawn uniformly with
--seed, and writes the model directory to --out. The defaults are what the `cpu` profile's PPO
with `ptx_coef: 1.0` makes of its supervised term: 150 steps x 2 epochs x 2 minibatches, 16
conversations each, at PPO's rate 5e-5. Read against SFT on the same items, its change is what
a little more supervised training gives, the control an RL stage's gain on the same skills has to
beat (docs/log.md). The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llm.nn.artifacts import load_model_dir, save_model_dir  # noqa: E402
from llm.train.trainer import supervised_lm_loss  # noqa: E402
from stages.ppo import sft_batches  # noqa: E402  (PPO-ptx's own draw of SFT's conversations)


def continue_sft(model, batches, *, updates: int, lr: float, seed: int, log=print) -> list[float]:
    """`updates` AdamW steps of the supervised loss on `batches(generator)` (stages.ppo.sft_batches,
    the draw PPO-ptx makes); returns every step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    model.train()
    for u in range(updates):
        loss_sum, n_tok = supervised_lm_loss(model, batches(g))
        loss = loss_sum / n_tok.clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if u % 100 == 0 or u == updates - 1:
            log(f"sft_more: update {u}: loss {sum(losses[-100:]) / len(losses[-100:]):.4f} (mean of the last 100)")
    model.eval()
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", type=Path, default=Path("models/sft"), help="the SFT model directory")
    ap.add_argument("--data", type=Path, default=Path("data/clean_sft"), help="SFT's conversations (train.jsonl)")
    ap.add_argument("--out", type=Path, required=True, help="the model directory to write")
    ap.add_argument("--updates", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    a = ap.parse_args(argv)
    path = a.data / "train.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; run `dvc repro clean_sft` (or pass --data)")
    torch.set_num_threads(a.threads)
    model, tok, meta = load_model_dir(a.sft, heads=("lm",))
    batches, _ = sft_batches(a.data, tok, seq_len=model.config.seq_len, batch_size=a.batch)
    t0 = time.perf_counter()
    losses = continue_sft(model, batches, updates=a.updates, lr=a.lr, seed=a.seed)
    seconds = time.perf_counter() - t0
    control = {"updates": a.updates, "batch": a.batch, "lr": a.lr, "seed": a.seed, "sft": str(a.sft)}
    save_model_dir(a.out, model, tok, dict(meta, stage="sft_more", control=control))
    print(json.dumps({**control, "out": str(a.out), "seconds": round(seconds, 1),
                      "loss_first": losses[0], "loss_last100": sum(losses[-100:]) / len(losses[-100:])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
