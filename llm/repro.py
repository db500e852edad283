"""`python -m llm.repro`: runs main() of llm/tools/repro.py, where the code and its documentation are.

Only a name a user types (llm/__init__.py: why the commands forward).
"""
from llm.tools.repro import main

if __name__ == "__main__":
    raise SystemExit(main())
