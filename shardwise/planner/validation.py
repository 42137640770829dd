"""``python -m shardwise.planner.validation``: the planner's table against published runs,
at the path the docs and bench/numbers_record.py call; the code is
:mod:`shardwise.planner.validate`.
"""

from shardwise.planner.validate.runs import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
