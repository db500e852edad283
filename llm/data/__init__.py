"""Data before any model: sources, generated tasks, passages to continue, the splits, cleaning, the tokenizer, batches, preference pairs, the chat template.

Modules: sources, generators, continuation, splits, clean, tokenizer, batching, preference, template. (Levels: llm/__init__.py.)
"""
