"""`python -m llm.seeds`: runs main() of llm/eval/seeds.py, where the code and its documentation are.

Only a name a user types (llm/__init__.py: why the commands forward).
"""
from llm.eval.seeds import main

if __name__ == "__main__":
    raise SystemExit(main())
