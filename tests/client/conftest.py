"""A real sampler (`adaptive-rollout serve` subprocess) for the live client tests, and a
TCP proxy that can cut every connection through it (a dropped network, server side)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
from support import Server

#: Shorter answers and a smaller buffer than the service tests: credit tests see
#: backpressure sooner.
BASE_CONFIG = {"max_tokens": 6, "max_active_prompts": 16, "max_buffered_groups": 16}


@pytest.fixture(scope="module")
def sampler(make_module_server: Callable[..., Server]) -> Server:
    """Fast fixed-rule groups in frames of 2. The engine runs on a server thread: where it
    runs is invisible over HTTP, and the engine process has its own tests (and serves the
    service API tests' shared sampler), so these skip its second model load."""
    return make_module_server(
        {"rule": "fixed", "group_size": 2, "n_max": 4, "wave_size": 2, "batch_groups": 2},
        base=BASE_CONFIG,
    )


class CuttableProxy:
    """Forwards 127.0.0.1:port to a target; `cut()` resets every open connection."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def cut(self) -> int:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the pumps; both peers see the connection end
            with contextlib.suppress(OSError):
                s.close()
        return len(conns) // 2

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()


@pytest.fixture
def proxy(sampler: Server) -> Iterator[CuttableProxy]:
    host, port = sampler.url.removeprefix("http://").rsplit(":", 1)
    p = CuttableProxy(host, int(port))
    yield p
    p.close()
