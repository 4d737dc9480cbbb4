"""GPU ranks that a test starts itself (torch.multiprocessing.spawn) as torchrun would: free rendezvous ports, and
each process's rank environment, which the trainer reads."""

import os
import random
import socket
from pathlib import Path


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on this host now, one rendezvous per run of the same processes: taken below
    the kernel's ephemeral range, from which every socket bound to port 0 draws (NCCL's, torchrun --standalone's, a
    neighbouring job's). A port the OS handed out here would be free now and could be taken by such a socket before
    the run that meets on it starts, minutes later (EADDRINUSE on a host running two jobs side by side)."""
    low = _ephemeral_low()
    # drawn at random, so that two tests choosing ports at the same time rarely choose the same
    ports = [port for port in random.sample(range(low // 2, low), 8 * count) if _bindable(port)][:count]
    if len(ports) < count:
        raise RuntimeError(f"fewer than {count} free ports between {low // 2} and {low} on this host")
    return ports


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), else of the IANA one."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        return 49152


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def as_rank(rank: int, world_size: int, port: int) -> None:
    """This process as torchrun starts rank `rank` of `world_size` on one host, meeting the others on `port`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank))
