"""Who started a process: the rank facts of each launcher's environment (parallel_latent/launching/cluster.py)."""

import pytest

from parallel_latent.launching.cluster import first_slurm_host, launcher_environment


def test_launcher_environments():
    torchrun = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
    assert launcher_environment(torchrun) == {
        "rank": 5,
        "world_size": 8,
        "local_rank": 1,
        "local_world_size": 4,
        "master_addr": "10.0.0.1",
        "master_port": "1234",
    }
    deepspeed_launcher = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_SIZE": "8"}
    assert launcher_environment(deepspeed_launcher)["local_world_size"] == 8
    slurm = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "777",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    env = launcher_environment(slurm)
    assert (env["rank"], env["world_size"], env["local_rank"], env["master_addr"]) == (3, 4, 1, "gpu07")
    assert env["local_world_size"] is None  # not said: nothing to check against
    assert launcher_environment({**slurm, "SLURM_NTASKS_PER_NODE": "2"})["local_world_size"] == 2
    uneven = {**slurm, "SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}
    assert launcher_environment(uneven)["local_world_size"] == 4
    mpi = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert (launcher_environment(mpi)["rank"], launcher_environment(mpi)["local_world_size"]) == (2, 2)
    assert launcher_environment({}) == {
        "rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "local_world_size": 1,
        "master_addr": None,
        "master_port": None,
    }


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("gpu[03-05,9],cpu1", "gpu03"), ("a-b[1,2]", "a-b1")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first
