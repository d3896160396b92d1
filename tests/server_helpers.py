"""A real uvicorn server on a free loopback port, in a thread of the test process, and small helpers
for reading what it returns."""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch
import uvicorn
from safetensors.torch import load

from vlens import LLM
from vlens.server.app import create_app
from vlens.server.config import ServerConfig

# Small engine settings: the tests need a few hundred tokens per sequence, not the model's 8k.
ENGINE = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 96 << 20, "max_model_len": 512, "max_num_seqs": 64}


@contextmanager
def running_server(llm: LLM, config: ServerConfig) -> Iterator[str]:
    """Serve `llm` on 127.0.0.1 (a port the OS picked, bound before the server starts, so no race);
    yield the base URL; shut down and join on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(llm, config), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess(subprocess.Popen):
    """`vlens serve` with its output (uvicorn's access log: a line per request) in a temporary file. Not
    a pipe: nobody reads one while the test runs, so after ~1000 requests (64 KiB) the server's next log
    line blocks its event loop for good: no request, /metrics or signal is answered any more."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.log = tempfile.TemporaryFile()
        super().__init__(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        """Everything the server printed so far (pread: seeking would move the server's write offset too)."""
        fd = self.log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


@contextmanager
def vlens_serve(args: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[str, ServeProcess]]:
    """`vlens serve ARGS` as an operator runs it, in a subprocess on a free loopback port (with this
    process's environment, PYTHONPATH included): yields (base URL, process) once /health answers, and
    interrupts it on exit unless the test already did."""
    port = free_port()
    command = [sys.executable, "-c", "import sys; from vlens.cli import main; sys.exit(main(sys.argv[1:]))"]
    proc = ServeProcess([*command, "serve", *args, "--port", str(port)], env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.output()
        assert time.monotonic() < deadline, "vlens serve did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        proc.log.close()


def decode_activations(obj: dict, base_url: str, headers: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a response's vlens.activations, inline or fetched through its handle."""
    assert obj["format"] == "safetensors"
    if "data" in obj:
        data = base64.b64decode(obj["data"])
    else:
        r = httpx.get(base_url + obj["url"], headers=headers or {}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/octet-stream"
        data = r.content
    assert len(data) == obj["bytes"]
    return load(data)


def metric(base_url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(base_url + "/metrics", headers=headers or {}, timeout=30).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


IDLE_GAUGES = (
    "vlens_requests_running", "vlens_requests_waiting", "vlens_kv_cache_usage", "vlens_requests_admitted",
    "vlens_capture_bytes_reserved",
)  # fmt: skip


def wait_idle(base_url: str, headers: dict | None = None, timeout: float = 30) -> None:
    """Until the engine reports nothing running or waiting and no KV block in use, and the server holds
    no admitted request and no reserved capture bytes."""
    deadline = time.monotonic() + timeout
    while True:
        busy = {m: metric(base_url, m, headers) for m in IDLE_GAUGES}
        if not any(busy.values()):
            return
        assert time.monotonic() < deadline, f"server still busy: {busy}"
        time.sleep(0.05)
