"""``python -m dschat_lib.probe``: check that a launcher starts ranks that can talk to each other.

Each rank joins the process group, all-reduces its rank number and reports what it saw. Run
it under ``deepspeed --num_gpus N`` or ``torchrun --nproc_per_node N`` before a long job: if
the sum is wrong or a rank hangs, the launcher or network set-up is at fault, not the model.
"""

from __future__ import annotations

import os
import socket

import torch

from dschat_lib import runtime


def main() -> dict:
    import deepspeed

    runtime.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    total = torch.tensor([float(rank)], device=runtime.device())
    deepspeed.comm.all_reduce(total)
    result = {"rank": rank, "world_size": world, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
              "host": socket.gethostname(), "backend": torch.distributed.get_backend(),
              "rank_sum": total.item(), "expected_rank_sum": world * (world - 1) / 2}
    if runtime.RESULT_DIR_ENV in os.environ:
        runtime.write_rank_result(result)
    print(result, flush=True)
    runtime.teardown()
    return result


if __name__ == "__main__":
    main()
