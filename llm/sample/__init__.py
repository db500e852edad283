"""What a model says: KV-cache generation, rollouts, rewards, the math prompts RL samples, the gold judge.

Modules: generate, rollout, rewards, prompts, gold. (Levels: llm/__init__.py.)
"""
