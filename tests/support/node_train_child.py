"""One rank of a training job on simulated nodes, for the node-loss tests (tests/test_node_loss.py).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/node_train_child.py BASE STEPS KIND PER_NODE [NODE_NAMES]

Rank r runs on node ``NODE_NAMES[r // PER_NODE]`` (default ``node<i>``), with private roots
``BASE/<node>/r0`` and ``BASE/<node>/r1`` and a backend that refuses other nodes' paths. KIND:
``replicated`` (every rank trains the same MLP on the same batches: replicated state) or
``fsdp`` (the MLP sharded with FSDP2 over all ranks: DTensor state). BASE ``none`` trains
without checkpoints (the reference). Otherwise the job resumes from the latest checkpoint the
nodes hold complete, then saves after every step. Rank 0 prints ``step N loss HEX`` after each
step (float.hex, so runs compare bit for bit) and ``resumed from step N``. With
``NODE_SIM_KILL=op:n`` the process SIGKILLs itself at its n-th file operation ``op`` (write,
fsync, rename, delete): the node is lost there.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import fsdp_mlp, small_mlp  # noqa: E402
from node_sim import checkpointer  # noqa: E402
from train_child import Data  # noqa: E402


def main() -> None:
    base, steps, kind, per_node = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    names = sys.argv[5].split(",") if len(sys.argv) > 5 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "fsdp":
        model, opt = fsdp_mlp(world)
    else:
        model = small_mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Data(width=48)
    start, ck = 0, None
    if base != "none":
        kill = os.environ.get("NODE_SIM_KILL")
        kill_at = (kill.split(":")[0], int(kill.split(":")[1])) if kill else None
        ck = checkpointer(base, rank, per_node, names, kill_at, mode="snapshot", keep=2, timeout_s=60)
        if ck.latest_step() is not None:
            if kind == "fsdp":  # a fresh optimizer has no state to fill: torch's helper creates it
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

                get_optimizer_state_dict(model, opt)
            state = ck.load("latest", into={"model": model, "optim": opt, "data": data})
            start = int(state["step"]) + 1
            if rank == 0:
                print(f"resumed from step {state['step']}", flush=True)
    for step in range(start, steps):
        x = data.next()
        loss = torch.nn.functional.mse_loss(model(x)[:, :37], x[:, :37].flip(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item().hex()}", flush=True)
        if ck is not None:
            ck.save(step, {"model": model, "optim": opt, "data": data, "step": step})
    if ck is not None:
        ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
