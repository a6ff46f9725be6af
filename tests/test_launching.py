"""dschat_lib.launching, checked against DeepSpeed's own launcher functions where they exist."""

import base64
import json
import socket

import pytest
from deepspeed.launcher.runner import _parse_hostfile

from dschat_lib import launching

HOSTFILE = "# cluster\nworker-0 slots=4\n\nworker-1 slots=2\n"


def test_argument_parser_accepts_what_launchers_pass(monkeypatch):
    parser = launching.argument_parser()
    assert parser.parse_args(["--local_rank=3"]).local_rank == 3
    assert parser.parse_args(["--local-rank", "2"]).local_rank == 2          # torchrun's spelling
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert launching.argument_parser().parse_args([]).local_rank == 5


def test_config_argument_reads_files_and_base64(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert launching.load_config_argument(str(path)) == cfg
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    assert launching.load_config_argument(encoded) == cfg


@pytest.mark.parametrize("text, fragment", [
    ("w0 slots=2\nw0 slots=2\n", "listed again"),
    ("w0 slot=2\n", "is not 'HOST slots=N'"),
    ("w0 slots=0\n", "slots=0"),
    ("w0 slots=2 max_slots=4\n", "ignored by DeepSpeed"),
    ("# only a comment\n", "lists no hosts"),
])
def test_hostfile_problems_are_named(text, fragment):
    problems = launching.hostfile_problems(text)
    assert any(fragment in p for p in problems), problems


@pytest.mark.parametrize("text", [HOSTFILE, "w0 slots=2\nw0 slots=2\n", "w0 slot=2\n", "# nothing\n"])
def test_fatal_problems_agree_with_deepspeeds_parser(text):
    fatal = [p for p in launching.hostfile_problems(text) if "slots=0" not in p and "ignored" not in p]
    if fatal:
        with pytest.raises(ValueError):
            _parse_hostfile(text.splitlines())
    else:
        assert dict(_parse_hostfile(text.splitlines())) == launching.parse_hostfile(text)


def test_include_exclude_and_counts():
    assert launching.resolve_resources(HOSTFILE) == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}
    assert launching.resolve_resources(HOSTFILE, include="worker-1") == {"worker-1": [0, 1]}
    assert launching.resolve_resources(HOSTFILE, include="worker-0:1,3") == {"worker-0": [1, 3]}
    assert launching.resolve_resources(HOSTFILE, exclude="worker-0:0@worker-1") == {"worker-0": [1, 2, 3]}
    assert launching.resolve_resources(HOSTFILE, num_nodes=1, num_gpus=2) == {"worker-0": [0, 1]}
    with pytest.raises(ValueError):
        launching.resolve_resources(HOSTFILE, include="worker-9")
    with pytest.raises(ValueError):
        launching.resolve_resources(HOSTFILE, include="worker-0", num_gpus=1)


def test_rank_layout_counts_across_nodes():
    layout = launching.rank_layout({"a": [0, 1], "b": [2]})
    assert [(r["rank"], r["host"], r["local_rank"], r["slot"]) for r in layout] == \
        [(0, "a", 0, 0), (1, "a", 1, 1), (2, "b", 0, 2)]


def test_deepspeed_env_text():
    assert launching.deepspeed_env_text({"HF_HOME": "/x", "A_B": "1"}) == "HF_HOME=/x\nA_B=1\n"
    with pytest.raises(ValueError):
        launching.deepspeed_env_text({"BAD NAME": "1"})
    with pytest.raises(ValueError):
        launching.deepspeed_env_text({"OK": "two\nlines"})


def test_multinode_command_exports_like_the_launcher():
    shell = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/code", "HF_HOME": "/hf", "CUDA_VISIBLE_DEVICES": "0"}
    plan = launching.multinode_command(HOSTFILE, "train.py", ["--deepspeed"], environ=shell,
                                       deepspeed_env={"HF_HOME": "/scratch"}, accelerator_exports=["NCCL"])
    assert plan["world_size"] == 6
    assert plan["exports"] == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/code", "HF_HOME": "/scratch"}
    cmd = plan["command"]
    assert cmd[:2] == ["pdsh", "-S"] and cmd[cmd.index("-w") + 1] == "worker-0,worker-1"
    assert "--master_addr=worker-0" in cmd and cmd[-2:] == ["train.py", "--deepspeed"]
    # Without the CUDA accelerator's prefix NCCL variables stay behind.
    cpu_plan = launching.multinode_command(HOSTFILE, "train.py", environ=shell, accelerator_exports=[])
    assert "NCCL_DEBUG" not in cpu_plan["exports"] and "HF_HOME" not in cpu_plan["exports"]


def test_port_in_use():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    assert launching.port_in_use(port)
    sock.close()
    assert not launching.port_in_use(port)
