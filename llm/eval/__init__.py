"""Judging models: skills with intervals, paired comparisons, seeds, the report card, the README's tables.

Modules: evaluate, paired, seeds, report, report_plots, report_render, readme. (Levels: llm/__init__.py.)
"""
