"""The node entrypoint's mapping from what an engine gives a node to `accelerate launch` flags.

SLURM's mapping runs for real inside `srun` on the test cluster (tests/tasks/launch/test_slurm.py);
here: torchrun's `PET_*` variables (Kubeflow Trainer), flags, and every clear error.
"""

import pytest

from models.node_launch import (
    NodeLaunchError,
    NodeRole,
    accelerate_argv,
    from_flags,
    from_slurm,
    from_torchrun,
    main,
)

TOPO = "configs/accelerate"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_torchrun_variables_become_accelerate_flags():
    env = {
        "PET_NNODES": "4",
        "PET_NODE_RANK": "3",
        "PET_MASTER_ADDR": "trainjob-node-0-0.svc",
        "PET_MASTER_PORT": "29400",
        "PET_NPROC_PER_NODE": "8",
    }
    role = from_torchrun(env)
    assert role == NodeRole(4, 3, "trainjob-node-0-0.svc", 29400, 8)
    argv = accelerate_argv(role, ["--config_file", f"{TOPO}/single.yaml", "-m", "models.train"])
    assert _flag(argv, "--num_machines") == "4" and _flag(argv, "--machine_rank") == "3"
    assert _flag(argv, "--num_processes") == "32", "accelerate's count is over all machines"
    # accelerate's own port default would override PET_MASTER_PORT: the flag is explicit.
    assert _flag(argv, "--main_process_port") == "29400"
    assert _flag(argv, "--main_process_ip") == "trainjob-node-0-0.svc"
    assert _flag(argv, "--rdzv_backend") == "static" and "--same_network" in argv
    assert "--multi_gpu" in argv, "a one-process topology becomes DDP across the job"
    assert argv[-4:] == ["--config_file", f"{TOPO}/single.yaml", "-m", "models.train"]


def test_a_topology_with_its_own_distributed_type_keeps_it():
    role = NodeRole(2, 0, "10.0.0.1", 29500, 4)
    argv = accelerate_argv(role, ["--config_file", f"{TOPO}/fsdp.yaml", "-m", "x"])
    assert "--multi_gpu" not in argv, "FSDP comes from the topology file"
    one = accelerate_argv(
        NodeRole(1, 0, "127.0.0.1", 29500, 1), ["--config_file", f"{TOPO}/single.yaml", "-m", "x"]
    )
    assert "--multi_gpu" not in one and "--rdzv_backend" not in one, "one process: plain launch"


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"PET_NODE_RANK": "0", "PET_MASTER_ADDR": "h"}, "PET_NNODES"),
        ({"PET_NNODES": "2", "PET_MASTER_ADDR": "h"}, "PET_NODE_RANK"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "0"}, "PET_MASTER_ADDR"),
        ({"PET_NNODES": "two", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "h"}, "PET_NNODES"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "h"}, "node rank 2"),
        (
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "0",
                "PET_MASTER_ADDR": "h",
                "PET_NPROC_PER_NODE": "gpu",
            },
            "PET_NPROC_PER_NODE",
        ),
    ],
)
def test_a_missing_or_contradictory_torchrun_variable_is_named(env, names):
    with pytest.raises(NodeLaunchError, match=names):
        from_torchrun(env)


def test_slurm_errors_name_the_variable():
    with pytest.raises(NodeLaunchError, match="SLURM_NODEID"):
        from_slurm({"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, 29500, 1)
    with pytest.raises(NodeLaunchError, match="SLURM_NNODES"):
        from_slurm({"SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1"}, 29500, 1)
    with pytest.raises(NodeLaunchError, match="one task per node"):
        from_slurm(
            {
                "SLURM_NNODES": "2",
                "SLURM_NODEID": "0",
                "SLURM_NTASKS": "4",
                "SLURM_JOB_NODELIST": "n[1-2]",
            },
            29500,
            1,
        )
    with pytest.raises(NodeLaunchError, match="SLURM_JOB_NODELIST"):
        from_slurm({"SLURM_NNODES": "2", "SLURM_NODEID": "1"}, 29500, 1)


def test_flags_and_the_command_line_errors(capsys):
    role = from_flags(2, 1, "10.1.2.3", 29511, 2)
    assert role.num_processes == 4
    with pytest.raises(NodeLaunchError, match="--main-process-ip"):
        from_flags(2, 1, None, 29500, 1)
    assert main(["--source", "flags", "--num-machines", "2", "--", "-m", "x"]) == 2
    assert "--num-machines and --machine-rank are required" in capsys.readouterr().err
    assert (
        main(
            [
                "--source",
                "flags",
                "--num-machines",
                "2",
                "--machine-rank",
                "5",
                "--main-process-ip",
                "h",
                "--",
                "-m",
                "x",
            ]
        )
        == 2
    )
    assert "node rank 5 is outside 0...1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="put `--` before"):
        main(["--source", "flags"])
