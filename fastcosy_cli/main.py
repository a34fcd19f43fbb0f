"""``fastcosy``: the operator's command line.

Subcommands (``fastcosy <cmd> --help`` for each):

* ``serve``            start the service locally from a serve config, or deploy it to a running cluster
* ``synth``            text -> WAV through the local pipeline or a running service (``--url``)
* ``make-tiny-model``  write the tiny random-weight model directory (official layout; not speech)
* ``build-trt``        offline TensorRT plan build for the flow estimator
* ``bench``            benchmarks and load generators (``fastcosy bench TOOL ...``; ``--help`` lists them)
* ``doctor``           check this node can serve, with the fix for each problem
* ``calibrate``        measure replica capacity and write the load band's setpoint into the configs
* ``config-reference`` write docs/configuration.md from the pydantic config models

Exit codes: 0 success; 1 the command found a problem (doctor failure, stale reference);
2 the command could not run (bad input, missing component, unreachable service).
"""
from __future__ import annotations

import argparse
import logging
import sys

from fastcosy_cli import calibrate, doctor, serve, synth, tools
from fastcosy_cli.common import CliError

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastcosy", description="FastCosyVoice Serve: CosyVoice2/3 TTS on Ray Serve")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    serve.add_parser(sub)
    synth.add_parser(sub)
    tools.add_make_tiny_model(sub)
    tools.add_build_trt(sub)
    tools.add_bench(sub)
    doctor.add_parser(sub)
    calibrate.add_parser(sub)
    tools.add_config_reference(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``fastcosy = fastcosy_cli.main:main``); returns the exit code."""
    parser = build_parser()
    # build-trt / bench hand everything they do not know to the module that implements them.
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "forward_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.verbose:  # one line per HTTP request would break the progress bar
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        sys.stderr.write(f"fastcosy {args.command}: {exc}\n")
        return exc.code
    except KeyboardInterrupt:
        return 130

