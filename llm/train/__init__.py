"""The one training loop and the supervised step, checkpoints, curves, metrics, the end of a stage, checkpoint means.

Modules: loop, trainer, checkpoint, monitor, metrics, finish, average. (Levels: llm/__init__.py.)
"""
