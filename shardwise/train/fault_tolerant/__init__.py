"""Fault tolerance across replica groups (``parallel.fault_tolerant``, docs/failures.md).

* :mod:`.launch`: the one command: quorum server, one elastic agent per group, the summary.
* :mod:`.replica`: one rank's setup: the group's model and data, torchft's manager, resume.
* :mod:`.loop`: one rank's steps: quorum, combine, commit ([Note: what a step is under
  fault tolerance]).
* :mod:`.combine`: the gradient across groups, the same bits for the same participants.
* :mod:`.state`: what a rejoining group heals, the group's journal, checkpoint saves.
* :mod:`.summary`: what a run committed, read back from the journals.
"""

from shardwise.train.fault_tolerant.combine import combine_gradients, next_lineage
from shardwise.train.fault_tolerant.launch import run_fault_tolerant
from shardwise.train.fault_tolerant.loop import ReplicaSteps
from shardwise.train.fault_tolerant.replica import run_replica, state_digest
from shardwise.train.fault_tolerant.summary import summarize

__all__ = ["run_fault_tolerant", "run_replica", "ReplicaSteps", "combine_gradients",
           "next_lineage", "state_digest", "summarize"]
