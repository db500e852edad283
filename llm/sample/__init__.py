"""What a model says: KV-cache generation, rollouts, rewards, the math prompts RL samples.

Modules: generate, rollout, rewards, prompts. (Levels: llm/__init__.py.)
"""
