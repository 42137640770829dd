"""Process-group initialisation from torchrun, SLURM or a single process.

shardwise never launches or transports anything itself: it reads what the launcher put in the
environment and hands it to ``torch.distributed.init_process_group``.

Launch examples::

    shardwise train                                   # one process, spawns --parallel.nproc ranks
    torchrun --nproc_per_node 4 -m shardwise.train.cli train
    srun --ntasks-per-node 8 shardwise train          # SLURM: rank/world from SLURM_* variables
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "init", "detect_launcher", "default_backend", "destroy",
           "quiet_flight_recorder", "flight_recorder_active"]

_FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def quiet_flight_recorder(backend: str, environ: dict[str, str] | None = None) -> bool:
    """Turn torch's flight recorder off for a Gloo process group about to be created.

    [Note: flight recorder on Gloo] torch 2.13 records every collective of a Gloo process
    group in a ring of 2,000 entries (its flight recorder, a debugging aid for hangs). Each
    record allocates a few hundred bytes of small objects on the host heap, and once the
    ring is full every new collective frees one record and allocates another, wherever the
    heap has room: in the holes left by the step's freed activations. Those small long-lived
    records keep the holes from merging, so resident memory grows every step, in proportion
    to the number of collectives (stage 3's per-unit gathers far more than DDP's few
    bucketed all-reduces; with the recorder off it stays flat: docs/engine.md,
    "Measurements behind the notes"). shardwise's own watchdog keeps the recent
    collectives of every group for its reports, so on Gloo the recorder is turned off unless
    the user set its size (``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE``).
    NCCL groups keep torch's default: their tensors live in GPU memory, and the recorder is
    NCCL's hang diagnosis. The setting is read when the process group is created.

    Args:
        backend: the backend of the group about to be created.
        environ: the environment to update (default ``os.environ``).

    Returns:
        Whether the recorder was turned off by this call.
    """
    env = os.environ if environ is None else environ
    if backend != "gloo" or any(k in env for k in _FR_VARS):
        return False
    env["TORCH_FR_BUFFER_SIZE"] = "0"
    return True


def flight_recorder_active(group=None) -> bool:
    """Whether the process group records its collectives (see [Note: flight recorder on
    Gloo]): a Gloo group created without a recorder size in the environment."""
    if not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return False
    sizes = [os.environ[k] for k in _FR_VARS if k in os.environ]
    return not sizes or sizes[0] != "0"


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
        quiet_flight_recorder(backend)  # [Note: flight recorder on Gloo]
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        if backend == "gloo":
            _destroy_at_exit()  # registered before the watchdog's stop: runs after it
    wd.start(config)
    return DistEnv(rank, world, local_rank, local_world, backend, device, launcher)


def destroy() -> None:
    """Stop the watchdog and tear the default process group down if one exists."""
    from shardwise.distributed import watchdog

    watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


_AT_EXIT: list[bool] = []


def _destroy_at_exit() -> None:
    """Tear a Gloo process group the script left alive down before the interpreter
    finalises (registered once).

    [Note: process group at exit] A script that ends without :func:`destroy` leaves the
    process group to be destructed while Python finalises; Gloo's worker threads may then
    still hold finished works whose tensors reach back into Python, and the process aborts
    ("terminate called without an active exception", exit status -6: seen in CI on a
    2-rank script that ended after its last all-reduce; pytorch/pytorch#190489 reproduces
    it, and #179291 proposed this very handler upstream). ``atexit`` runs while the
    interpreter is whole, after the watchdog's own handler ([Note: watchdog at exit]), so
    the group is destroyed there. Gloo's teardown is local to the process; NCCL's is left
    to the script, as tearing a communicator down at exit can wait on peers that are gone."""
    if _AT_EXIT:
        return
    _AT_EXIT.append(True)

    def at_exit() -> None:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            destroy()
    atexit.register(at_exit)
