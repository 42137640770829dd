"""Fault tolerance across replica groups (``parallel.fault_tolerant``, docs/failures.md).

* :mod:`.launch`: the one command: quorum server, one elastic agent per group, the summary.
* :mod:`.replica`: one rank's loop: quorum, combine, commit, healing, the group's journal.
* :mod:`.combine`: the gradient across groups, the same bits for the same participants.
"""
