"""Post-training: PPO, GRPO and their shares, held-out checks, the RL stages' glue, pairs from SFT's samples, DPO, math rankers, the continuation preference measured.

Modules: rl, ppo, grpo, shares, heldout, pairs, dpo, rankers, continuation. (Levels: llm/__init__.py.)
"""
