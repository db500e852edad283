"""A stage that does nothing but collectives, for the launcher's tests (tests/test_scale.py).

    python -m tests.tiny_stage --params params.yaml [--fail-rank R] [--kill-rank R] [--bug-rank R]

Every rank joins an all-reduce; then rank R fails with a stage error (--fail-rank), is killed
by SIGKILL (--kill-rank) or raises a bug (--bug-rank), while the others wait in a second
all-reduce that can only end when the launcher stops them. It reads the `report` section
(any section will do) and writes nothing.
"""
from __future__ import annotations

import os
import signal
import sys

from llm.runtime import setup_runtime
from llm.stage import stage_main


def main(argv: list[str] | None = None) -> int:
    def options(ap):
        for name in ("fail", "kill", "bug"):
            ap.add_argument(f"--{name}-rank", type=int, default=-1)

    def work(args, common, cfg, rt) -> str | None:
        import torch

        from llm.runtime import all_reduce
        t = all_reduce(torch.ones(1), rt)
        if rt.rank == args.fail_rank:
            raise ValueError(f"rank {rt.rank} could not read its share (a stage error, on purpose)")
        if rt.rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if rt.rank == args.bug_rank:
            raise RuntimeError("a bug, on purpose")
        all_reduce(t, rt)  # the others wait here for the rank that is gone
        return f"tiny: {int(t.item())} processes" if rt.is_main else None

    return stage_main("tiny", __doc__, argv, inputs={}, outputs={}, section="report", work=work,
                      setup=setup_runtime, torchrun=True, options=options, module="tests.tiny_stage")


if __name__ == "__main__":
    sys.exit(main())
