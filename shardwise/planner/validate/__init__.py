"""The planner against published runs: predictions in each source's metric (runs.py) and the
hardware families' constants fitted on the runs marked ``fit`` (fit_runs.py).

    python -m shardwise.planner.validation     # the table (runs.main)
    python -m shardwise.planner.fit_runs       # refit the families' constants
"""
