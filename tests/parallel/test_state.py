"""Process groups and the DeepSpeed mpu: layout of TP/DP groups, the device of each launcher's ranks, errors."""

import subprocess
import sys

import pytest
import torch.distributed as dist

from parallel_latent.launching.cluster import launcher_environment
from parallel_latent.parallel import ModelParallelUnit, initialize_model_parallel


def layout(tp: int) -> dict:
    state = initialize_model_parallel(tp)
    mpu = ModelParallelUnit()
    # The groups really connect the ranks they claim: a sum over each group.
    probe = __import__("torch").tensor([float(dist.get_rank())])
    tp_sum, dp_sum = probe.clone(), probe.clone()
    dist.all_reduce(tp_sum, group=mpu.get_tensor_model_parallel_group())
    dist.all_reduce(dp_sum, group=mpu.get_data_parallel_group())
    return {
        "tp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), state.tp_ranks),
        "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), mpu.get_data_parallel_group_ranks()),
        "src": mpu.get_tensor_model_parallel_src_rank(),
        "sums": (tp_sum.item(), dp_sum.item()),
        "pp": (mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()),
        "sp": hasattr(mpu, "initialize_sequence_parallel"),
    }


def test_tp2_dp2_layout(pool4):
    res = pool4.run(layout, 2)
    assert [r["tp"] for r in res] == [(0, 2, (0, 1)), (1, 2, (0, 1)), (0, 2, (2, 3)), (1, 2, (2, 3))]
    assert [r["dp"] for r in res] == [(0, 2, [0, 2]), (0, 2, [1, 3]), (1, 2, [0, 2]), (1, 2, [1, 3])]
    assert [r["src"] for r in res] == [0, 0, 2, 2]
    assert [r["sums"] for r in res] == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]
    assert all(r["pp"] == (1, 0) and not r["sp"] for r in res)


def test_tp4_and_tp1_layouts(pool4):
    assert [r["tp"][:2] for r in pool4.run(layout, 4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [r["dp"][:2] for r in pool4.run(layout, 1)] == [(0, 4), (1, 4), (2, 4), (3, 4)]


def release_then_layout(tp: int) -> tuple:
    """A layout at ``tp`` released, then TP=4 set up: whether torch.distributed still knows the first's TP
    group, and what the second's sums give."""
    from parallel_latent.parallel import release_model_parallel
    from parallel_latent.parallel.state import is_initialized

    first = initialize_model_parallel(tp)
    release_model_parallel()
    released = not is_initialized()
    try:
        dist.get_process_group_ranks(first.tp_group)
        old_group_known = True
    except (KeyError, RuntimeError, ValueError):
        old_group_known = False
    return released, old_group_known, layout(4)["sums"]


def test_a_released_layout_frees_its_groups_and_another_follows(pool4):
    """release_model_parallel: the TP, DP and control groups are destroyed (torch.distributed no longer
    knows them), the registry is empty, the default group stays and the next layout works."""
    results = pool4.run(release_then_layout, 2)
    assert [r[:2] for r in results] == [(True, False)] * 4
    assert [r[2] for r in results] == [(0.0 + 1 + 2 + 3, float(rank)) for rank in range(4)]  # TP=4 x DP=1


@pytest.mark.parametrize(
    ("launch", "env", "visible_gpus", "device"),
    [
        # torchrun / the deepspeed launcher / accelerate: one process per GPU, all GPUs visible.
        ("torchrun", {"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}, 8, 5),
        ("deepspeed", {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_SIZE": "8"}, 8, 3),
        # srun --gpus-per-task=1: SLURM masks each task to its own GPU, which it sees as device 0.
        ("srun, 1 GPU per task", {"SLURM_PROCID": "7", "SLURM_NTASKS": "16", "SLURM_LOCALID": "7"}, 1, 0),
        # srun with every GPU of the node visible to every task: the local id picks one.
        ("srun, 8 GPUs per task", {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, 8, 1),
        # A CUDA_VISIBLE_DEVICES mask of two GPUs under torchrun with two local ranks.
        ("mask of 2", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, 1),
    ],
)
def test_one_device_choice_per_launcher(launch, env, visible_gpus, device):
    from parallel_latent.parallel.state import select_device_index

    assert select_device_index(launcher_environment(env)["local_rank"], visible_gpus) == device, launch


def test_two_ranks_on_one_gpu_are_refused():
    from parallel_latent.parallel.state import select_device_index

    with pytest.raises(RuntimeError, match="local rank 9 has no GPU of its own: 8 are visible"):
        select_device_index(9, 8)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        select_device_index(0, 0)


def test_tensor_parallel_groups_stay_inside_a_node():
    from parallel_latent.config import Config, ConfigError, ModelConfig, ParallelConfig
    from parallel_latent.training.world import validate_world

    cfg = Config(model=ModelConfig(d_model=96, n_heads=12), parallel=ParallelConfig(tensor_parallel=12))
    with pytest.raises(ConfigError, match="tensor_parallel=12 does not divide the 8 processes per node"):
        validate_world(cfg, 48, "gpt2.yaml", processes_per_node=8)
    validate_world(cfg, 48, "gpt2.yaml", processes_per_node=12)  # nodes of 12: fine
    validate_world(cfg, 48, "gpt2.yaml")  # per-node count unknown: not checked
    cfg.parallel.allow_tp_across_nodes = True
    validate_world(cfg, 48, "gpt2.yaml", processes_per_node=8)


def test_world_size_one_without_launcher():
    # A fresh interpreter with no launcher variables: one rank, gloo, groups of size 1.
    code = (
        "import os\n"
        "for k in ('RANK','WORLD_SIZE','LOCAL_RANK','MASTER_ADDR','MASTER_PORT'): os.environ.pop(k, None)\n"
        "from parallel_latent.launching.rendezvous import join_job\n"
        "from parallel_latent.parallel import destroy_distributed, ModelParallelUnit\n"
        "s = join_job(1)\n"
        "m = ModelParallelUnit()\n"
        "print(s.world_size, s.tp_size, s.dp_size, s.backend, m.get_data_parallel_world_size())\n"
        "destroy_distributed()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1", "gloo", "1"]


def publish_devices(identities: list[str]) -> str | None:
    from parallel_latent.parallel.state import DeviceSharedError, check_one_process_per_device

    try:
        check_one_process_per_device(identities[dist.get_rank()], initialize_model_parallel(1).control_group)
    except DeviceSharedError as error:
        return str(error)
    return None


def test_two_ranks_on_one_gpu_stop_every_rank_with_one_line_naming_both(pool4):
    """Every rank publishes (host, GPU UUID) over gloo before the first NCCL collective; the UUIDs
    are given here (no GPU), the exchange is real."""
    assert pool4.run(publish_devices, ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]) == [None] * 4
    messages = pool4.run(publish_devices, ["GPU-a", "GPU-b", "GPU-c", "GPU-b"])
    assert len(set(messages)) == 1  # every rank stops, with the same line
    assert messages[0].startswith("ranks 1 and 3 both use GPU GPU-b on host ")
    assert "\n" not in messages[0]


@pytest.mark.parametrize(("nproc", "gpus", "refused"), [(1, 1, False), (2, 1, True), (8, 8, False), (9, 8, True)])
def test_local_processes_must_fit_the_visible_gpus(nproc, gpus, refused):
    from parallel_latent.parallel.state import check_processes_fit_devices

    if refused:
        with pytest.raises(ValueError, match=rf"--nproc {nproc} needs {nproc} GPUs but {gpus} (is|are) visible"):
            check_processes_fit_devices(nproc, gpus)
    else:
        check_processes_fit_devices(nproc, gpus)
