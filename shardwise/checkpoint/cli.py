"""``shardwise checkpoint export | import | inspect`` (plugged into shardwise.train.cli).

    shardwise checkpoint inspect runs/debug/checkpoints            # the latest; --verify
    shardwise checkpoint inspect runs/debug/checkpoints --tensors  # every tensor; --json
    shardwise checkpoint export runs/debug/checkpoints/step_00000150 out/hf
    shardwise checkpoint import out/hf runs/imported/step_00000000
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

__all__ = ["add_parser", "run", "parse_size"]


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000.

    Raises:
        ValueError: naming the text.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``checkpoint`` subcommand and its actions to ``sub``."""
    ckpt = sub.add_parser("checkpoint", help="inspect, export or import checkpoints",
                          description="Inspect, export or import checkpoints "
                                      "(docs/checkpoints.md).")
    actions = ckpt.add_subparsers(dest="checkpoint_action", metavar="ACTION", required=True)
    ins = actions.add_parser("inspect", help="step, layout, model, optimizer and files of a "
                             "checkpoint (--tensors: every tensor; --json: for scripts)")
    ins.add_argument("checkpoint", help="a checkpoint folder, or a folder of step_N checkpoints")
    ins.add_argument("--verify", action="store_true", help="also check every file's checksums")
    ins.add_argument("--tensors", action="store_true",
                     help="list every tensor (name, shape, dtype, size, chunks)")
    ins.add_argument("--json", action="store_true",
                     help="print one JSON object (every tensor included) for scripts")
    exp = actions.add_parser("export", help="write Hugging Face Llama safetensors + index")
    exp.add_argument("checkpoint", help="a checkpoint folder (step_N)")
    exp.add_argument("out", help="output folder")
    exp.add_argument("--max-shard-size", default="5GB", help="largest file (default 5GB)")
    imp = actions.add_parser("import", help="Hugging Face Llama safetensors -> a checkpoint "
                             "(or train with --checkpoint.import_safetensors PATH)")
    imp.add_argument("src", help="folder with model.safetensors.index.json, or a file")
    imp.add_argument("out", help="checkpoint folder to write (e.g. .../step_00000000)")


def _import(src: str, out: str) -> str:
    """HF weights -> a one-process checkpoint loadable at any layout."""
    import json

    from shardwise.checkpoint.dcp import save
    from shardwise.checkpoint.export import import_safetensors
    from shardwise.checkpoint.hf import config_from_hf
    from shardwise.models import build_model

    folder = Path(src) if Path(src).is_dir() else Path(src).parent
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"{cfg_file} is missing: import needs the Hugging Face config.json to "
                         f"know the model's shape")
    config = config_from_hf(json.loads(cfg_file.read_text()), str(cfg_file))
    model = build_model(config, device="meta")
    model.to_empty(device="cpu")  # every parameter is overwritten by the import
    names = import_safetensors(src, model)
    result = save(out, model, extra={"imported_from": str(src)}, step=0)
    return f"imported {len(names)} tensors from {src} into checkpoint {result.path}"


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed ``checkpoint`` command; print its result.

    Returns:
        0 on success (errors are raised: ``CheckpointError`` / ``ValueError`` -> exit 2).
    """
    if args.checkpoint_action == "inspect":
        from shardwise.checkpoint.info import describe, summarize

        if args.json:
            import json

            print(json.dumps(summarize(args.checkpoint, verify_files=args.verify), indent=1))
        else:
            print(describe(args.checkpoint, verify_files=args.verify, tensors=args.tensors))
    elif args.checkpoint_action == "export":
        from shardwise.checkpoint.export import export_safetensors

        index = export_safetensors(args.checkpoint, args.out,
                                   max_shard_bytes=parse_size(args.max_shard_size))
        print(f"exported {args.checkpoint} to {index.parent} ({index.name}, config.json)")
    else:
        print(_import(args.src, args.out))
    return 0
