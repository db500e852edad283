"""A language model from nothing, in plain PyTorch: the library the stages (stages/) call.

Grouped by level, lowest first. A package imports llm/'s own modules and the packages listed
before it, never one after it, and no imports form a cycle (tests/test_layout.py holds both):
each package reads with what it stands on already read.

    llm/*.py: config, errors, fileio, runtime, threads, kernels, stage
        config, errors, atomic files, devices and processes, CPU threads and kernels, a stage's
        main()
    llm/data/: sources, generators, continuation, splits, clean, tokenizer, batching, preference,
               template
        data before any model: sources, generated tasks, passages to continue, the splits,
        cleaning, the tokenizer, batches, preference pairs, the chat template
    llm/nn/: model, losses, optim, reward_model, memory, artifacts
        the networks: the GPT, its losses and optimizer, the reward model, memory per GPU, model
        directories
    llm/sample/: generate, rollout, rewards, prompts, gold
        what a model says: KV-cache generation, rollouts, rewards, the math prompts RL samples,
        the gold judge of the continuation preference
    llm/train/: loop, trainer, checkpoint, monitor, metrics, finish, average
        the one training loop and the supervised step, checkpoints, curves, metrics, the end of
        a stage, checkpoint means
    llm/eval/: evaluate, tiers, paired, seeds, report, report_plots, report_render, readme
        judging models: skills with intervals, math by difficulty tier, paired comparisons,
        seeds, the report card, the README's tables
    llm/post/: rl, ppo, grpo, shares, heldout, pairs, dpo, verifier, rankers, continuation
        post-training: PPO, GRPO and their shares, held-out checks, the RL stages' glue, pairs
        from SFT's samples, DPO, the generative verifier, math rankers, the continuation
        preference and its proxy measured
    llm/tools/: chat, serve, serve_guard, export, profile, rehearse, repro
        what a person runs: terminal chat, the server, HF export, profiles, the rehearsal,
        `dvc repro` with independent stages side by side

The commands keep their short names: `python -m llm.<command>` runs llm/<command>.py, which
only forwards to main() of the module in its package (chat, serve, export, profile, rehearse, repro, seeds,
average, readme; llm.config is at the top already).
"""
