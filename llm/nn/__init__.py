"""The networks: the GPT, its losses and optimizer, the reward model, memory per GPU, model directories.

Modules: model, losses, optim, reward_model, memory, artifacts. (Levels: llm/__init__.py.)
"""
