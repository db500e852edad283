"""`python -m llm.export`: runs main() of llm/tools/export.py, where the code and its documentation are.

Only a name a user types (llm/__init__.py: why the commands forward).
"""
from llm.tools.export import main

if __name__ == "__main__":
    raise SystemExit(main())
