"""`shardserve`'s own logging: httpx's line per request (INFO: `shardserve serve` polled its health
and printed `INFO httpx: HTTP Request: GET …/v1/health` into the user's terminal) shows with -v
only, and the project's own INFO lines still show. The command runs in a process of its own (its
root logger is configured once, by `main`), its subcommand replaced by one that makes the request
through httpx as deployments.run does, to a real local HTTP server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import logging, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import httpx
from serving import cli

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

def serve(args):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    httpx.get(f"http://127.0.0.1:{server.server_address[1]}/v1/health")
    server.shutdown()
    logging.getLogger("serving.local_server").info("the project's own line")

cli._serve = serve
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_serve_prints_its_own_info_lines_and_httpx_s_only_with_v(verbose: bool) -> None:
    argv = [*(["-v"] if verbose else []), "serve", "an-index"]
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "INFO serving.local_server: the project's own line" in done.stderr
    assert ("HTTP Request: GET http://127.0.0.1:" in done.stderr) == verbose
