"""What a person runs: terminal chat, the server, HF export, profiles, the rehearsal.

Modules: chat, serve, serve_guard, export, profile, rehearse. (Levels: llm/__init__.py.)
"""
