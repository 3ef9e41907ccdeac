"""One-off experiments whose conclusions are recorded (docs/experiments.md). Not installed: run
from a checkout, `python -m lab.NAME --help`."""
