"""The planner against published runs: predictions in each source's metric (runs.py) and the
hardware families' constants fitted on the runs marked ``fit`` (fit_runs.py).

    python -m shardwise.planner.validation     # the table (this package's runs.main)
    python -m shardwise.planner.fit_runs       # refit the families' constants
"""

from shardwise.planner.validate.fit_runs import (FAMILY_FITS, STACK_FITS, fit_families,
                                                 fit_stack)
from shardwise.planner.validate.runs import (PublishedRun, RunResult, hardware_of, load_runs,
                                             predict, run_all, to_markdown, workload_of)

__all__ = ["PublishedRun", "RunResult", "load_runs", "hardware_of", "workload_of", "predict",
           "run_all", "to_markdown", "fit_families", "fit_stack", "FAMILY_FITS",
           "STACK_FITS"]
