"""``python -m shardwise.planner.fit_runs``: refit the hardware families' constants on the
published runs, at the path the docs call; the code is
:mod:`shardwise.planner.validate.fit_runs`.
"""

from shardwise.planner.validate.fit_runs import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
