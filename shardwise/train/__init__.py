"""shardwise.train: configuration, the trainer and the ``shardwise`` command.

    config/       dataclasses, TOML + --section.key overrides (__init__.py), the parallel,
                  precision, comm, offload and moe sections (sections.py), value checks
                  (checks.py), nested dataclasses <-> TOML / command line (io.py)
    preflight.py  every check on user input, before any rank trains; data preparation
    resume_checks.py  what a resume must fit (the checkpoint, the steps, the batch)
    rundir.py     which folder a run writes to (never over an earlier run), log.overwrite
    lr_schedule.py  warmup + cosine learning rate, its horizon on resume (keep / extend)
    trainer.py    build_* functions and the training loop (the three parallelism call sites)
    metrics.py    progress bar or lines, metrics.jsonl (one history across resumes), loss
                  plot, TensorBoard, summary
    launch.py     local ranks via torch's elastic launcher, or in-process under torchrun / SLURM
    cli.py        ``shardwise train | doctor | checkpoint``
"""

from shardwise.train.config import Config, load_config

__all__ = ["Config", "load_config"]
