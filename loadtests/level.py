"""Summarize one vegeta level: `vegeta encode | python -m loadtests.level --mode M --value V ...`."""

from __future__ import annotations

import argparse
import json
import sys

from loadtests.report import summarize


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--mode", choices=["rate", "concurrency"], required=True)
    cli.add_argument("--value", type=float, required=True)
    cli.add_argument("--duration", type=float, required=True)
    cli.add_argument("--queries-per-request", type=int, default=1)
    args = cli.parse_args()
    level = summarize(sys.stdin, args.mode, args.value, args.duration, args.queries_per_request)
    json.dump(level, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
