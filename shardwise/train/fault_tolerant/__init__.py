"""Fault tolerance across replica groups (``parallel.fault_tolerant``, docs/failures.md).

* :mod:`shardwise.train.fault_tolerant.launch`: the one command: the quorum server, one
  elastic agent per group, the summary.
* :mod:`shardwise.train.fault_tolerant.replica`: one rank's setup: the group's model and
  data, torchft's manager, resume.
* :mod:`shardwise.train.fault_tolerant.loop`: one rank's steps: quorum, combine, commit
  ([Note: what a step is under fault tolerance]).
* :mod:`shardwise.train.fault_tolerant.combine`: the gradient across groups, the same bits
  for the same participants; :mod:`~shardwise.train.fault_tolerant.exchange` moves it.
* :mod:`shardwise.train.fault_tolerant.wide`: one process group over every rank of the
  quorum's groups; :mod:`~shardwise.train.fault_tolerant.pieces`: who holds what of each
  parameter, in any group's layout.
* :mod:`shardwise.train.fault_tolerant.heal`: a group behind copies a live group's state,
  in any two layouts; :mod:`~shardwise.train.fault_tolerant.digest`: one hash of a group's
  whole state.
* :mod:`shardwise.train.fault_tolerant.state`: the state a group heals, the group's
  journal, checkpoint saves.
* :mod:`shardwise.train.fault_tolerant.summary`: what a run committed, read back from the
  journals (``python -m shardwise.train.fault_tolerant RUN_DIR``).
"""

from shardwise.train.fault_tolerant.combine import combine_gradients, next_lineage
from shardwise.train.fault_tolerant.launch import run_fault_tolerant
from shardwise.train.fault_tolerant.loop import ReplicaSteps
from shardwise.train.fault_tolerant.digest import group_state_digest
from shardwise.train.fault_tolerant.replica import run_replica
from shardwise.train.fault_tolerant.summary import summarize

__all__ = ["run_fault_tolerant", "run_replica", "ReplicaSteps", "combine_gradients",
           "next_lineage", "group_state_digest", "summarize"]
