"""GPU ranks that a test starts itself (torch.multiprocessing.spawn) as torchrun would: free rendezvous ports, and
each process's rank environment, which the trainer reads."""

import os
import socket


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on this host now: one rendezvous per run of the same processes."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def as_rank(rank: int, world_size: int, port: int) -> None:
    """This process as torchrun starts rank `rank` of `world_size` on one host, meeting the others on `port`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank))
