"""`python -m llm.rehearse`: runs main() of llm/tools/rehearse.py, where the code and its documentation are.

Only a name a user types (llm/__init__.py: why the commands forward).
"""
from llm.tools.rehearse import main

if __name__ == "__main__":
    raise SystemExit(main())
