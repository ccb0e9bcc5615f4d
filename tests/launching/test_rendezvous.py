"""How the ranks of an attempt meet (parallel_latent/launching/rendezvous.py), with real TCPStores in
this process, the ranks as threads: under torchrun's shared agent store an earlier attempt's name of
its store (a dead one, or one holding another nonce) is never taken; every rank checks in; a rank
that does not come is named within the bound."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from parallel_latent.errors import BadInput
from parallel_latent.launching.rendezvous import AGENT_STORE_ENV, ATTEMPT_KEY, StartupTimeout, job_store
from tests.helpers.distributed import free_port

LONG = datetime.timedelta(seconds=60)


def meet(env_of, ranks, timeout_s: float = 20.0) -> dict:
    """``job_store`` on a thread per rank; {rank: its store, or the error it raised}."""
    found: dict = {}

    def rank_thread(rank: int) -> None:
        try:
            found[rank] = job_store(env_of(rank), timeout_s, LONG)
        except Exception as error:  # collected, asserted by the caller
            found[rank] = error

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s + 30)
    return found


def environment(port: int, world_size: int):
    return lambda rank: {"rank": rank, "world_size": world_size, "master_addr": "127.0.0.1", "master_port": str(port)}


def test_without_an_agent_rank_0_hosts_the_store_and_every_rank_checks_in():
    found = meet(environment(free_port(), 3), range(3))
    assert all(isinstance(store, dist.Store) for store in found.values()), found
    found[1].set("from rank 1", "x")  # one store for all
    assert found[2].get("from rank 1") == b"x"


def test_under_an_agent_an_earlier_attempts_store_is_never_taken(monkeypatch):
    monkeypatch.setenv(AGENT_STORE_ENV, "True")
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=LONG)
    # An earlier attempt's names: a store that is gone, then a live one that holds another nonce.
    agent.set(ATTEMPT_KEY, f"{free_port()} 0123456789abcdef")
    found = meet(environment(port, 2), [1], timeout_s=3)
    assert isinstance(found[1], StartupTimeout), found
    stale = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=LONG)
    stale.set("nonce", "an earlier one")
    agent.set(ATTEMPT_KEY, f"{stale.port} 0123456789abcdef")
    assert isinstance(meet(environment(port, 2), [1], timeout_s=3)[1], StartupTimeout)
    # This attempt: rank 0 opens its own store; the other rank finds it, not the stale ones.
    found = meet(environment(port, 2), [0, 1])
    assert all(isinstance(store, dist.Store) for store in found.values()), found
    found[0].set("attempt", "this one")
    assert found[1].get("attempt") == b"this one"
    assert not stale.check(["parallel_latent/attempt"])


def test_a_rank_that_does_not_come_is_named_within_the_bound():
    found = meet(environment(free_port(), 4), [0, 1, 3], timeout_s=2)
    assert str(found[0]) == "start-up: rank 2 of 4 did not join the job within 2 s"
    for rank in (1, 3):
        assert isinstance(found[rank], StartupTimeout)


@pytest.mark.parametrize("agent", [False, True], ids=["own store", "agent store"])
def test_without_rank_0_the_others_end_within_the_bound(agent, monkeypatch):
    if agent:
        monkeypatch.setenv(AGENT_STORE_ENV, "True")
        port = free_port()
        keep = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=LONG)
    else:
        port, keep = free_port(), None
    found = meet(environment(port, 2), [1], timeout_s=2)
    assert isinstance(found[1], StartupTimeout), found
    del keep


def test_rank_0_on_a_port_another_process_holds_ends_with_one_line():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        found = meet(environment(port, 2), [0], timeout_s=2)
    assert isinstance(found[0], BadInput), found
    assert str(found[0]) == (
        f"start-up: rank 0 cannot host the job's store at 127.0.0.1:{port}: the port is in use "
        "(MASTER_PORT: give the job a free one)"
    )
