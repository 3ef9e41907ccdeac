"""Run vegeta from Python (the benchmark) with the same flags the shell scripts use."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path
from urllib.parse import urlparse

from loadtests.report import summarize

ROOT = Path(__file__).resolve().parent.parent
VEGETA = Path(os.environ.get("VEGETA", ROOT / ".bin" / "vegeta"))


def assert_loopback(url: str) -> None:
    """Load tests target this machine only (loopback), never another host."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to load-test {url}: only loopback targets (127.0.0.0/8, ::1) are allowed")


def vegeta_version() -> str:
    out = subprocess.run([str(VEGETA), "-version"], capture_output=True, text=True, check=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Version")),
                "unknown")


def attack(targets: Path, mode: str, value: float, duration_s: float, out_dir: Path, label: str,
           queries_per_request: int = 1, timeout_s: float = 10.0) -> dict:
    """One bounded level: closed loop (`concurrency`) or open loop (`rate`) → a records level."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / f"{label}.bin"
    flags = [f"-duration={duration_s}s", f"-timeout={timeout_s}s", "-format=json",
             f"-targets={targets}", "-keepalive=true", "-http2=false"]
    if mode == "concurrency":
        flags += ["-rate=0", f"-workers={int(value)}", f"-max-workers={int(value)}"]
    else:
        flags += [f"-rate={value:g}/s", "-workers=16", "-max-workers=1024"]
    with results.open("wb") as sink:
        subprocess.run([str(VEGETA), "attack", *flags], stdout=sink, check=True)
    encoded = subprocess.run([str(VEGETA), "encode", "--to", "json", str(results)], capture_output=True,
                             text=True, check=True).stdout
    level = summarize(encoded.splitlines(), mode, value, duration_s, queries_per_request)
    level["label"] = label
    results.unlink()  # the record keeps the summary; raw results are large
    return level
