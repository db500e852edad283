"""Data before any model: sources, generated tasks, the splits, cleaning, the tokenizer, batches, preference pairs, the chat template.

Modules: sources, generators, splits, clean, tokenizer, batching, preference, template. (Levels: llm/__init__.py.)
"""
