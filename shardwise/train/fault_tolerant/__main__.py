"""``python -m shardwise.train.fault_tolerant RUN_DIR [STEPS]``: the summary of a run folder
(:func:`shardwise.train.fault_tolerant.summary.main`)."""

import sys

from shardwise.train.fault_tolerant.summary import main

sys.exit(main())
