"""``shardwise data vla``: write expert demonstrations of a BabyAI level to disk.

    shardwise data vla --level BabyAI-GoToLocal-v0 --episodes 1000 --out data/gotolocal-1k
    shardwise data vla --level BabyAI-PickupLoc-v0 --episodes 200 --out /tmp/pl --seed 5000

Exit codes: 0 success, 2 bad input or minigrid missing (one line naming the value).
"""

from __future__ import annotations

import argparse

from shardwise.data.vla.build import build_dataset
from shardwise.data.vla.demos import EVAL_SEED_BASE
from shardwise.data.vla.env import DEFAULT_TILE_SIZE

__all__ = ["add_parser", "run"]

_DESCRIPTION = f"""\
Generate demonstrations of a BabyAI level (minigrid's expert bot; needs `pip install
shardwise[vla]`) and write them as a sharded dataset (safetensors shards + index.json),
atomically. Episode i uses env seed SEED + i; training seeds stay below {EVAL_SEED_BASE},
where the evaluation seeds start."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``data`` subcommand (with its ``vla`` action) on ``sub``."""
    data = sub.add_parser("data", help="make training data on disk (VLA demonstrations)",
                          description="Make training data on disk.", allow_abbrev=False)
    kinds = data.add_subparsers(dest="data_command", metavar="KIND", required=True)
    p = kinds.add_parser("vla", help="expert demonstrations of a BabyAI level",
                         description=_DESCRIPTION, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", required=True, help="BabyAI level id, e.g. BabyAI-GoToLocal-v0")
    p.add_argument("--episodes", required=True, type=int, help="episodes to generate")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory (new)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first episode (default 0)")
    p.add_argument("--tile-size", type=int, default=DEFAULT_TILE_SIZE,
                   help=f"pixels per grid cell (default {DEFAULT_TILE_SIZE}: 56x56 frames)")
    p.add_argument("--shard-episodes", type=int, default=256,
                   help="episodes per shard file (default 256)")
    return data


def run(args: argparse.Namespace) -> int:
    """Carry out ``shardwise data vla``; returns the exit code.

    Raises:
        ValueError: bad input, or minigrid is missing (turned into exit code 2 by the CLI).
    """
    try:
        report = build_dataset(args.out, args.level, args.episodes, args.seed,
                               args.tile_size, args.shard_episodes)
    except ImportError as exc:
        raise ValueError(str(exc)) from exc
    print(f"wrote {report.path}: {report.episodes} episodes, {report.steps} steps, "
          f"{report.bytes} bytes, {report.seconds:.2f} s ({report.episodes_per_second:.0f} "
          f"episodes/s), expert success {report.expert_success:.2f}", flush=True)
    return 0
