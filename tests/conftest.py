"""Shared fixtures: a real S3 server (moto_server) on loopback."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "cacheflow-test",
    "AWS_SECRET_ACCESS_KEY": "cacheflow-test-secret",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclasses.dataclass(frozen=True)
class S3Server:
    """A running S3-compatible server and a bucket made for the test session."""

    endpoint: str
    region: str
    bucket: str


def _moto_server() -> str:
    """The moto_server executable next to this Python, else on PATH."""
    near = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if os.access(near, os.X_OK):
        return near
    found = shutil.which("moto_server")
    if found is None:
        pytest.fail(
            "moto_server is not installed (looked next to "
            f"{sys.executable} and on PATH); the S3 tests need a real server on loopback. "
            "Install it with: pip install 'moto[server]'",
            pytrace=False,
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """Starts ``moto_server`` on a free loopback port, makes a bucket, stops it at the end."""
    exe = _moto_server()
    port = _free_port()
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update(_S3_ENV)
    # moto logs every request; a file (not a pipe) can never fill up and stall the server.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            _wait_for_port(proc, port, log)
            import boto3

            endpoint = f"http://127.0.0.1:{port}"
            bucket = "cacheflow-test"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket=bucket
            )
            yield S3Server(endpoint=endpoint, region="us-east-1", bucket=bucket)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _wait_for_port(proc: subprocess.Popen, port: int, log: IO[bytes]) -> None:
    """Waits until the server answers on ``port``; fails the test if it exits or hangs."""
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            log.seek(0)
            err = log.read().decode(errors="replace")
            pytest.fail(f"moto_server exited with {proc.returncode}: {err[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"moto_server did not answer on 127.0.0.1:{port} within 30 s")
            time.sleep(0.1)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A cacheflow store with two arrays and one runtime block (the CLI tests)."""
    from cacheflow_jax import write_store

    path = tmp_path / "store"
    store = write_store(
        {"emb": np.zeros((10, 8), np.float32), "layers": [{"w": np.ones((4, 4), np.int8)}]},
        path,
        chunk_bytes=64,
    )
    store.write("kv-block-1", np.ones(3, np.float32)).result()
    return path


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Prints the fault suite's tally (injected / detected / served wrong / lost) per fault."""
    import _faults

    text = _faults.table()
    if not text:
        return
    terminalreporter.write_sep("=", "fault suite: injected / detected with a clear error / served wrong / lost")
    terminalreporter.write_line(text)
    path = os.environ.get("CACHEFLOW_FAULT_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
