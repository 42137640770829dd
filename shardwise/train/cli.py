"""The ``shardwise`` command.

    shardwise train                                     # defaults = configs/debug.toml, 2 ranks
    shardwise train --config configs/debug.toml --train.steps 30 --log.dir runs/try
    shardwise train --nproc 4 --parallel.stage 2
    torchrun --nproc_per_node 2 -m shardwise.train.cli train --train.steps 30
    shardwise train --help                              # every field, its meaning and default
    shardwise data vla --level BabyAI-GoToLocal-v0 --episodes 1000 --out data/gotolocal-1k

Exit codes: 0 success, 2 bad input (one line naming the value, before any rank trains),
1 a rank failed (named), 130 interrupted, 141 stdout closed early (``... | head``: the output
stops quietly, as for any Unix tool killed by SIGPIPE). Further subcommands (``checkpoint ...``,
``doctor``) plug in as more ``add_parser`` calls in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from shardwise.checkpoint.cli import add_parser as add_checkpoint_parser
from shardwise.checkpoint.cli import run as run_checkpoint
from shardwise.data.vla.cli import add_parser as add_data_parser
from shardwise.data.vla.cli import run as run_data
from shardwise.inference.act_cli import add_act_parser, run_act
from shardwise.train.generate_cli import add_generate_parser, run_generate
from shardwise.parallel.pipeline.cli import add_parser as add_schedule_parser
from shardwise.parallel.pipeline.cli import run as run_schedule
from shardwise.planner.cli import add_parser as add_plan_parser
from shardwise.planner.cli import run as run_plan
from shardwise.train.config import io as config_io
from shardwise.train.config import Config, all_keys

__all__ = ["build_parser", "main"]

_TRAIN_DESCRIPTION = """\
Train a model. Values come from the defaults (identical to configs/debug.toml), then the
--config TOML file, then --section.key overrides (later wins). Bools accept true/false,
lists are comma-separated (--optim.betas 0.9,0.95), optional values accept none.

Launching: alone, this process starts --parallel.nproc local ranks (PyTorch's elastic
launcher); under torchrun or SLURM srun it runs as one rank of that job.
See docs/configuration.md and docs/launching.md."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps help text at spaces only: a default such as "BabyAI-GoToLocal-v0" stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train", help="train a model (default: the debug model on 2 local CPU ranks)",
        description=_TRAIN_DESCRIPTION, allow_abbrev=False,
        usage="shardwise train [-h] [--config FILE] [--nproc N] [--SECTION.KEY VALUE ...]",
        formatter_class=_HelpFormatter)
    _add_config_options(train)


_DOCTOR_DESCRIPTION = """\
Check that the ranks of a job agree before training: every rank reports its host, device,
backend, torch / shardwise / Python versions and the hash of its config, then all ranks run a
test all-reduce (its sum checked, its bandwidth measured). A rank that differs is named with
the value; exit code 2. Takes the same options as train (the config is what is compared);
launched the same way (local ranks, torchrun or SLURM). See docs/failures.md."""


def _add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    doctor = sub.add_parser(
        "doctor", help="check that all ranks agree (versions, device, config) and can talk",
        description=_DOCTOR_DESCRIPTION, allow_abbrev=False,
        usage="shardwise doctor [-h] [--config FILE] [--nproc N] [--SECTION.KEY VALUE ...]",
        formatter_class=_HelpFormatter)
    _add_config_options(doctor)


class _StoreSpelling(argparse.Action):
    """Store the value and remember which spelling gave it, so that an alias and its key
    given with different values are refused (:func:`_check_aliases`) instead of the later
    one silently winning."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        setattr(namespace, self.dest, values)
        spellings = namespace.__dict__.setdefault("_spellings", {})
        spellings.setdefault(self.dest, {})[option_string] = values


def _check_aliases(args: argparse.Namespace) -> None:
    """Refuse ``--nproc 3 --parallel.nproc 2``: an alias and its key that disagree.

    Raises:
        ValueError: naming both spellings and their values.
    """
    hints = {f"{s}.{k}": hint for s, k, hint, *_ in config_io.iter_fields(Config())}
    for dest, given in getattr(args, "_spellings", {}).items():
        if len(given) < 2:
            continue
        parsed = {flag: config_io.parse_value(dest, value, hints[dest], from_cli=True)
                  for flag, value in given.items()}
        if len(set(parsed.values())) > 1:
            both = " and ".join(f"{flag} {value}" for flag, value in given.items())
            raise ValueError(f"{both} disagree: they set the same key {dest}; expected one of "
                             "them, or the same value")


def _add_config_options(train: argparse.ArgumentParser) -> None:
    """--config, --nproc and one --section.key option per config field."""
    train.add_argument("--config", metavar="FILE", default=None,
                       help="TOML file with [section] tables (e.g. configs/debug.toml)")
    train.add_argument("--nproc", dest="parallel.nproc", metavar="N", default=argparse.SUPPRESS,
                       action=_StoreSpelling, help="alias of --parallel.nproc")
    train.add_argument("--faults", metavar="SPEC", default=None,
                       help="inject faults (kill, stop, exit, hang, ...) at chosen steps and "
                            "phases, e.g. 'kill:group=1:step=40;stop:group=0:step=90:seconds=5' "
                            "(the SHARDWISE_FAULT grammar: shardwise/train/faults.py)")
    train.add_argument("--checkpoint.async", dest="checkpoint.async_save", metavar="BOOL",
                       nargs="?", const="true", default=argparse.SUPPRESS,
                       action=_StoreSpelling, help="alias of --checkpoint.async_save")
    section_docs = config_io.field_docs(Config)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, key, hint, default, doc in config_io.iter_fields(Config()):
        if section not in groups:
            groups[section] = train.add_argument_group(
                f"[{section}]", section_docs.get(section, "").replace("%", "%%"))
        shown = "unset" if default is None else config_io.to_toml_value(default)
        extra = {"nargs": "?", "const": "true"} if hint is bool else {}
        groups[section].add_argument(
            f"--{section}.{key}", dest=f"{section}.{key}", default=argparse.SUPPRESS,
            action=_StoreSpelling,
            metavar=config_io.type_name(hint).removesuffix(" or none").upper().replace(" ", "_"),
            help=f"{doc} (default: {shown})".replace("%", "%%"), **extra)


def build_parser() -> argparse.ArgumentParser:
    """The ``shardwise`` argument parser: one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="shardwise", allow_abbrev=False,
        description="shardwise: PyTorch-native distributed training (ZeRO-1/2/3).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train_parser(sub)
    _add_doctor_parser(sub)
    add_checkpoint_parser(sub)
    add_schedule_parser(sub)
    add_plan_parser(sub)
    add_data_parser(sub)
    add_act_parser(sub)
    add_generate_parser(sub)
    return parser


def _attach_values(argv: list[str]) -> list[str]:
    """Write ``--key VALUE`` as ``--key=VALUE`` so values like ``-1e-3`` are not taken for flags."""
    takes_value = {f"--{s}.{k}" for s, k, hint, *_ in config_io.iter_fields(Config())
                   if hint is not bool} | {"--config", "--nproc", "--faults"}
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _unknown_argument(extra: list[str]) -> ValueError:
    flag = next((a for a in extra if a.startswith("-")), None)
    if flag is None:
        return ValueError(f"unexpected argument {extra[0]!r}; options look like --train.steps 30")
    name = flag.split("=", 1)[0]
    return ValueError(config_io.unknown_key_message(name.lstrip("-"), all_keys(),
                                                    "the command line", flag="--"))


def _is_rank_zero() -> bool:
    """Whether this process should print errors (rank 0 of a launched job, or no job)."""
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return os.environ[var] == "0"
    return True


def _report_collective_error(exc) -> None:
    """The watchdog's report, printed once per job (by the rank that composed it)."""
    if exc.reporter:
        print(f"shardwise: error: {exc}", file=sys.stderr, flush=True)
    else:
        first = str(exc).splitlines()[0]
        print(f"shardwise: error: rank {exc.rank} stopped ({first}); the full report is "
              "printed by another rank", file=sys.stderr, flush=True)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun's summary names the cause too
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from shardwise.train.config import load_config
    from shardwise.train.doctor import format_reports
    from shardwise.train.launch import run_doctor

    overrides = {k: v for k, v in vars(args).items() if "." in k}
    outcome = run_doctor(load_config(args.config, overrides))
    if outcome is not None:
        print(format_reports(outcome), flush=True)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from shardwise.train.config import load_config
    from shardwise.train.launch import run_training

    overrides = {k: v for k, v in vars(args).items() if "." in k}
    cfg = load_config(args.config, overrides)
    if getattr(args, "faults", None):
        from shardwise.train.faults import ENV_VAR, parse_faults

        faults = parse_faults(args.faults)  # a malformed spec exits 2 before any rank starts
        if not cfg.parallel.fault_tolerant and any("rejoin" in f.options for f in faults):
            raise ValueError("--faults: rejoin= needs --parallel.fault_tolerant true (a "
                             "replica group that restarts while the others train)")
        os.environ[ENV_VAR] = args.faults  # inherited by every rank this process launches
    run_training(cfg)
    return 0


def _closed_stdout() -> int:
    """stdout's reader went away (``shardwise ... | head -1``): stop quietly, like a Unix
    tool killed by SIGPIPE, without a traceback or Python's "Exception ignored" at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush goes nowhere
    return 141  # 128 + SIGPIPE, what a shell reports for a command ended by a closed pipe


def _run(argv: list[str]) -> int:
    """Parse and carry out one command; map errors to exit codes (see :func:`main`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from shardwise.distributed.watchdog import CollectiveError
    from shardwise.train.fault_tolerant.launch import FaultToleranceError
    from shardwise.train.launch import RankFailure

    try:
        args, extra = build_parser().parse_known_args(_attach_values(argv))
        if extra:
            raise _unknown_argument(extra)
        if args.command == "checkpoint":
            return run_checkpoint(args)
        if args.command == "schedule":
            return run_schedule(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "data":
            return run_data(args)
        if args.command == "act":
            return run_act(args)
        if args.command == "generate":
            return run_generate(args)
        _check_aliases(args)
        if args.command == "doctor":
            return _cmd_doctor(args)
        return _cmd_train(args)
    except ValueError as exc:
        if _is_rank_zero():
            print(f"shardwise: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except RankFailure as exc:
        if "BrokenPipeError" in str(exc):  # rank 0 printed into a closed stdout
            return _closed_stdout()
        print(f"shardwise: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except FaultToleranceError as exc:  # the groups' outcome, already summarised above
        print(f"shardwise: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except CollectiveError as exc:  # this process is one rank of a torchrun / SLURM job
        _report_collective_error(exc)
        return 1
    except (KeyboardInterrupt, SignalException):
        print("shardwise: interrupted", file=sys.stderr, flush=True)
        return 130


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """shardwise's own warnings as one line, like its errors (Python's format, with the
    source line, for everyone else's)."""
    if f"{os.sep}shardwise{os.sep}" in str(filename):
        return f"shardwise: warning: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


_PYTHON_FORMAT = warnings.formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardwise`` console script.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The process exit code (0 ok, 1 a rank failed, 2 bad input, 130 interrupted, 141 the
        reader of stdout went away).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.formatwarning = _format_warning  # the command's process only, not on import
    try:
        try:
            code = _run(argv)
        except SystemExit:  # --help and usage errors: flush here, where a closed pipe is caught
            sys.stdout.flush()
            raise
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _closed_stdout()


if __name__ == "__main__":
    sys.exit(main())
