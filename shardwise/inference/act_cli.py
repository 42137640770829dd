"""``shardwise act``: a trained VLA policy acting in its BabyAI level, timed per action.

    shardwise act --checkpoint runs/vla
    shardwise act --checkpoint runs/vla --level BabyAI-GoToObj-v0 --episodes 64 --batch 8 \\
        --threads 2 --json act.json --strip act.png

Exit codes: 0 success, 2 bad input, a missing checkpoint or minigrid missing (one line
naming the value).
"""

from __future__ import annotations

import argparse
import json

from shardwise.data.vla import EVAL_SEED_BASE
from shardwise.inference.act import DEFAULT_LEVEL, act

__all__ = ["add_act_parser", "run_act"]

_DESCRIPTION = f"""\
Run a trained vision-language-action policy greedily in its BabyAI level on held-out seeds
(from {EVAL_SEED_BASE}: never trained on) and time each action: the policy's latency from
observation to action (p50 / p99 / max), the environment's step, and the control rate in
actions per second. Prints a table; --json writes the same figures."""


def add_act_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``act`` subcommand on ``sub``."""
    p = sub.add_parser("act", help="run a VLA policy in its environment, timed per action",
                       description=_DESCRIPTION, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a run directory (its newest checkpoint) or a checkpoint folder")
    p.add_argument("--level", default=None,
                   help=f"BabyAI level (default: the run's [vla] level, else {DEFAULT_LEVEL})")
    p.add_argument("--episodes", type=int, default=32, help="episodes (default 32)")
    p.add_argument("--seed", type=int, default=EVAL_SEED_BASE,
                   help=f"first env seed (default {EVAL_SEED_BASE}, the held-out seeds)")
    p.add_argument("--batch", type=int, default=1,
                   help="episodes stepped together, one forward per step (default 1)")
    p.add_argument("--frames", type=int, default=None,
                   help="frames per sample (default: the run's [vla] frames, else 1)")
    p.add_argument("--device", default="cpu", help="device of the model (default cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--strip", default=None, metavar="PNG", help="draw the first episode here")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    return p


def run_act(args: argparse.Namespace) -> int:
    """Carry out ``shardwise act``; returns the exit code.

    Raises:
        ValueError: bad input, a missing or unusable checkpoint, or minigrid missing (turned
            into exit code 2 by the CLI).
    """
    try:
        report = act(args.checkpoint, level=args.level, episodes=args.episodes,
                     batch=args.batch, seed=args.seed, frames=args.frames, device=args.device,
                     threads=args.threads, strip=args.strip)
    except ImportError as exc:
        raise ValueError(str(exc)) from exc
    source = f"step {report.step}" if report.step is not None else "step unknown"
    print(f"shardwise act: {report.checkpoint} ({source})", flush=True)
    print(report.table(), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=2)
            f.write("\n")
    if args.strip:
        print(f"  strip           {args.strip}", flush=True)
    return 0
