"""The ``centralstore`` command (also ``python -m centralstore``).

``centralstore demo`` trains a small CNN with ``CentralStorageStrategy`` and shows that it
trains exactly like one device; ``centralstore devices`` lists what torch can see and what the
strategy would choose by default; ``centralstore --version``. A mistake on the command line
ends with one line on stderr and exit status 2, never a traceback.

``torchrun --nproc-per-node N -m centralstore demo`` runs the demo in N worker processes with
``MultiWorkerCentralStorageStrategy``; the chief (worker 0) alone prints and writes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from . import __version__, _devices, demo
from .strategies.central_storage import CentralStorageStrategy

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: the mistake and where help is.

    argparse's default prints the whole usage first, which buries the one line that matters.
    """

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # one line, whatever the message held
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum`` (the benchmark scripts' counts too).

    >>> at_least(1)("3")
    3
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _device(text: str) -> str:
    """An argparse type: one device name, checked now against the devices torch can see.

    >>> _device("CPU:1")
    'cpu:1'
    """
    try:
        return _devices.canonical(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _device_list(text: str) -> list[str]:
    """An argparse type: comma-separated device names.

    >>> _device_list("CPU:0, cpu:1")
    ['cpu:0', 'cpu:1']
    """
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated device names such as 'cpu:0,cpu:1', got {text!r}"
        )
    return [_device(name) for name in names]


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``demo``, ``devices`` and ``--version``."""
    parser = _Parser(
        prog="centralstore",
        description="TensorFlow's tf.distribute CentralStorageStrategy for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"centralstore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_command = commands.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's digits with CentralStorageStrategy",
        description=(
            "Train a small CNN on scikit-learn's handwritten digits with "
            "CentralStorageStrategy (every visible GPU, else two logical CPU devices), then "
            "the same run as a plain one-device PyTorch loop (whole global batches, then the "
            "replicas' slices one after the other), compare the weights, and report each "
            "loop's steady-state samples per second (the first epoch, warm-up, left out)."
        ),
    )
    demo_command.add_argument(
        "--compute-devices",
        type=_device_list,
        metavar="DEVICES",
        help="comma-separated compute devices, e.g. cpu:0,cpu:1 or GPU:0,GPU:1 "
        "(default: every visible GPU, else cpu:0,cpu:1)",
    )
    demo_command.add_argument(
        "--parameter-device",
        type=_device,
        metavar="DEVICE",
        help="where the variables live (default: the only GPU when one computes, else cpu:0)",
    )
    demo_command.add_argument(
        "--epochs",
        type=at_least(1),
        default=12,
        metavar="N",
        help="passes over the training set (default: 12)",
    )
    demo_command.add_argument(
        "--batch-size",
        type=at_least(1),
        default=64,
        metavar="N",
        help="the global batch size, split over the replicas (default: 64)",
    )
    demo_command.add_argument(
        "--seed",
        type=at_least(0),
        default=0,
        metavar="N",
        help="seeds the data split, the shuffling and the initial weights (default: 0)",
    )
    demo_command.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        default=Path("demo-out"),
        help="directory for curves.png and summary.json (default: demo-out)",
    )
    demo_command.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="save checkpoints into DIR (every 10 steps and every epoch); run again with the "
        "same DIR to resume an interrupted demo where it stopped (default: no checkpoints)",
    )
    demo_command.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the one-device run and the weight comparison",
    )
    demo_command.set_defaults(handler=_demo, parser=demo_command)
    devices = commands.add_parser(
        "devices",
        help="list the visible devices and what CentralStorageStrategy() would choose",
        description="List the devices torch can see, their canonical names, and the "
        "default placement of CentralStorageStrategy().",
    )
    devices.set_defaults(handler=_devices_command, parser=devices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except KeyboardInterrupt:
        print("centralstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return status


def _devices_command(args: argparse.Namespace) -> int:
    print(devices_report())
    return 0


def demo_settings(args: argparse.Namespace) -> demo.Settings:
    """The demo's settings from its command-line flags."""
    return demo.Settings(
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        out=args.out,
        compare=args.compare,
        checkpoint_dir=args.checkpoint_dir,
    )


def _demo(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    directories = [("--out", args.out), ("--checkpoint-dir", args.checkpoint_dir)]
    directories = [(flag, path) for flag, path in directories if path is not None]
    for flag, directory in directories:
        if directory.exists() and not directory.is_dir():
            parser.error(f"argument {flag}: {str(directory)!r} exists and is not a directory")
    try:
        strategy = demo.make_strategy(args.compute_devices, args.parameter_device)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    for flag, directory in directories:
        try:  # now, rather than after training; by the one worker that writes there
            if strategy.extended.should_checkpoint:
                directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"argument {flag}: cannot create {str(directory)!r}: {error.strerror}")
    demo.run(strategy, demo_settings(args))
    if torch.distributed.is_initialized():  # a torchrun worker
        _exit_worker()
    return 0


def _exit_worker() -> NoReturn:
    """End a torchrun worker whose job is done, with status 0 and without the interpreter's
    teardown.

    With torch 2.13, a process that has used gloo and imported torch._dynamo (every optimizer
    step does) sometimes aborts in that teardown with "terminate called without an active
    exception", even after destroy_process_group, and torchrun then reports a failed worker
    (https://github.com/pytorch/pytorch/issues/190489). Everything is printed and written by
    now.
    """
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def devices_report() -> str:
    """What torch can see, each device's canonical name and other accepted spellings, and the
    placement ``CentralStorageStrategy()`` chooses by default."""
    rows = [("cpu:0", "the host CPU", "CPU:0, cpu, /cpu:0, /device:CPU:0")]
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        memory = f"{properties.total_memory / 2**30:.0f} GiB"
        rows.append(
            (f"cuda:{index}", f"{properties.name}, {memory}", f"GPU:{index}, /device:GPU:{index}")
        )
    if torch.backends.mps.is_available():
        rows.append(("mps", "the Apple GPU (Metal)", "MPS"))
    width = max(len(row[1]) for row in rows)
    lines = ["visible devices: canonical name, description, other accepted spellings"]
    lines += [f"  {name:<8} {what:<{width}}  {also}" for name, what, also in rows]
    lines.append(
        "  logical CPU devices cpu:1, cpu:2, ... name the host CPU again: several replicas "
        "without a GPU"
    )
    if torch.cuda.device_count() == 0:
        lines.append("  no GPU is visible to torch")
    default = CentralStorageStrategy()
    lines += [
        "CentralStorageStrategy() by default:",
        f"  compute devices : {', '.join(default.compute_devices)}",
        f"  parameter device: {default.parameter_device}",
        f"  replicas in sync: {default.num_replicas_in_sync}",
    ]
    if torch.cuda.device_count() == 0:
        lines.append("  (centralstore demo uses cpu:0,cpu:1 instead, to show two replicas in sync)")
    elif default.parameter_device.startswith("cpu"):
        lines += [
            "  the optimizer updates the variables on the host, once a step: build it with",
            "  fused=True, or call cs.keep_host_memory() first (README: How do I use GPUs?)",
        ]
    return "\n".join(lines)
