"""Judging models: skills with intervals, math by difficulty tier, paired comparisons, seeds, the report card, the README's tables.

Modules: evaluate, tiers, paired, seeds, report, report_plots, report_render, readme. (Levels: llm/__init__.py.)
"""
