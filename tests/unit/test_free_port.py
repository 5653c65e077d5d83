"""`trainer_client.launch.free_port`: the ports handed to child processes."""

from __future__ import annotations

import socket

from trainer_client.launch import free_port


def test_free_port_never_hands_out_a_port_twice_and_each_can_be_bound() -> None:
    # Ports taken one at a time by binding port 0 repeat: the kernel hands a port it just
    # got back out again (about 6 repeats in 500 picks on a 28k-port range). Two children
    # told the same port collide (a Ray head refuses to start).
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
