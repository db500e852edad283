"""`python -m llm.average`: runs main() of llm/train/average.py, where the code and its documentation are.

Only a name a user types (llm/__init__.py: why the commands forward).
"""
from llm.train.average import main

if __name__ == "__main__":
    raise SystemExit(main())
