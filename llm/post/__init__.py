"""Post-training: PPO, GRPO and their shares, held-out checks, the RL stages' glue, pairs from SFT's samples, DPO.

Modules: rl, ppo, grpo, shares, heldout, pairs, dpo. (Levels: llm/__init__.py.)
"""
