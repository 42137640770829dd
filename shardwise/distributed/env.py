"""Process-group initialisation from torchrun, SLURM or a single process.

shardwise never launches or transports anything itself: it reads what the launcher put in the
environment and hands it to ``torch.distributed.init_process_group``.

Launch examples::

    shardwise train                                   # one process, spawns --parallel.nproc ranks
    torchrun --nproc_per_node 4 -m shardwise.train.cli train
    srun --ntasks-per-node 8 shardwise train          # SLURM: rank/world from SLURM_* variables
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "init", "detect_launcher", "default_backend", "destroy"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        world_size: number of processes in the job.
        local_rank: rank on this host (selects the GPU).
        local_world_size: processes on this host.
        backend: c10d backend in use ("gloo" or "nccl").
        device: the device this rank computes on.
        launcher: "torchrun", "slurm" or "single".
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect_launcher(environ: dict[str, str] | None = None) -> str:
    """Name the launcher that started this process: "torchrun", "slurm" or "single"."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return "torchrun"
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "slurm"
    return "single"


def default_backend() -> str:
    """NCCL when CUDA is available, Gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _rank_info(launcher: str, env: dict[str, str]) -> tuple[int, int, int, int]:
    if launcher == "torchrun":
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world
    if launcher == "slurm":
        world = int(env["SLURM_NTASKS"])
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1)
        return int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), local_world
    return 0, 1, 0, 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _elastic_store(env: dict[str, str], timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun: the agent's store, with keys of their own for this restart attempt.

    [Note: restart attempts] torchrun's agent hosts one TCPStore for the whole job, and every
    attempt's workers connect to it (TORCHELASTIC_USE_AGENT_STORE). Keys are not cleared
    between attempts, so a restarted rank 0 can read the address a dead rank of the previous
    attempt published and wait in Gloo's connectFullMesh until the timeout (seen in 3 of 4
    restarts on torch 2.13). A prefix per attempt keeps the attempts apart.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        return None
    store = dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"shardwise/attempt_{attempt}", store)


def init(backend: str | None = None, timeout_s: float = 600.0,
         watchdog: str = "on") -> DistEnv:
    """Initialise the default process group from the environment (idempotent).

    Args:
        backend: "gloo", "nccl" or None for :func:`default_backend`.
        timeout_s: collective timeout in seconds (default 600). A collective that outlives it
            raises instead of hanging.
        watchdog: "on" (default), "debug" or "off": the collective watchdog
            (:mod:`shardwise.distributed.watchdog`), started with ``timeout_s`` when the
            world has more than one rank. A hang, a divergence or a dead rank then fails
            every rank with one report naming the rank, the collective and the stacks.

    Returns:
        The :class:`DistEnv` of this process.

    Raises:
        ValueError: for an unknown backend or watchdog mode, or SLURM without
            MASTER_ADDR/MASTER_PORT.
    """
    from shardwise.distributed import watchdog as wd

    config = wd.WatchdogConfig(timeout_s=timeout_s, mode=watchdog)
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend 'nccl' needs CUDA, which is not available on this machine; use 'gloo'"
        )
    env = dict(os.environ)
    launcher = detect_launcher(env)
    rank, world, local_rank, local_world = _rank_info(launcher, env)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if not dist.is_initialized():
        if launcher == "slurm" and not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
            raise ValueError(
                "SLURM launch needs MASTER_ADDR and MASTER_PORT exported in the batch script "
                "(see docs/launching.md), found neither"
            )
        if launcher == "single":
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _elastic_store(env, timeout) if launcher == "torchrun" else None
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    wd.start(config)
    return DistEnv(rank, world, local_rank, local_world, backend, device, launcher)


def destroy() -> None:
    """Stop the watchdog and tear the default process group down if one exists."""
    from shardwise.distributed import watchdog

    watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
