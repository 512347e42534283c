"""A rank that reaches for the network: all_reduce asks torchrun's rendezvous store (a TCP
port on loopback) for the job's state, as the pickle attack on the elastic agent began. The
sandbox refuses the socket itself: the test is ``forbidden``, the line named."""

import socket

from reference.collectives import *  # noqa: F403


def all_reduce(tensor, group=None):  # noqa: ARG001
    with socket.create_connection(("127.0.0.1", 29400), timeout=1) as store:
        store.sendall(b"list_keys")
