"""Trains ours and the built-in with torch `DistributedDataParallel`, 2 CPU processes.

Under the torch backend a Keras model is a `torch.nn.Module`, so each rank wraps it in
`DistributedDataParallel` (gloo, on 127.0.0.1 only) and trains it with a plain torch
loop (`torch.optim.SGD`, MSE), as Keras's torch multi-device example does: the same
starting weights and batches for ours and the built-in, each batch split in halves over
the ranks. Then this process trains ours on the whole batches alone, which the
all-reduced (averaged) gradients must reproduce. Prints one JSON object
(`distribution_parity.compare` plus each rank's own results);
`tests/test_distribution.py` runs it in a subprocess.

    python tests/distribution_check_torch.py

The ranks are `torch.multiprocessing.spawn` children, joined here; a rank that fails
ends the others, and the process group times out after `TIMEOUT` seconds.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"
os.environ["KERAS_TORCH_DEVICE"] = "cpu"  # gloo ranks on CPU, also where a GPU is visible

import datetime  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from distribution_parity import (  # noqa: E402
    BATCH,
    LAYERS,
    LEARNING_RATE,
    STEPS,
    build_model,
    compare,
    data,
    initial_weights,
    max_diff,
)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

WORLD_SIZE = 2
TIMEOUT = 120


def train(model, x, y, world_size=1):
    """A plain torch loop over the STEPS batches of `x`/`y` (this rank's part of each
    batch, already selected); returns each step's loss averaged over the ranks."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(STEPS):
        rows = slice(step * len(x) // STEPS, (step + 1) * len(x) // STEPS)
        outputs = model(torch.from_numpy(x[rows]))
        loss = torch.nn.functional.mse_loss(outputs, torch.from_numpy(y[rows]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(loss)  # a sum over the ranks' equal halves
        losses.append(float(loss) / world_size)
    return losses


def rank_main(rank, port, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )
    try:
        queue.put((rank, train_rank(rank)))
        # The wrapped models are gone; the group ends once both ranks are done.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_rank(rank):
    """`{name: (losses, final weights)}` of this rank, per layer."""
    x, y = data()
    # Rank r takes the r-th half of every batch.
    half = BATCH // WORLD_SIZE
    mine = np.concatenate(
        [np.arange(s * BATCH + rank * half, s * BATCH + (rank + 1) * half) for s in range(STEPS)]
    )
    start = initial_weights()
    results = {}
    for name, layer_class in LAYERS.items():
        model = build_model(layer_class)
        model.set_weights(start)
        losses = train(DistributedDataParallel(model), x[mine], y[mine], WORLD_SIZE)
        results[name] = (losses, [np.asarray(w) for w in model.get_weights()])
    return results


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main():
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks talk over loopback only
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(free_port(), queue), nprocs=WORLD_SIZE, join=True)
    per_rank = dict(queue.get() for _ in range(WORLD_SIZE))

    x, y = data()
    start = initial_weights()
    model = build_model(LAYERS["ours"])
    model.set_weights(start)
    runs = {name: per_rank[0][name] for name in LAYERS}
    runs["ours_one_device"] = (train(model, x, y), model.get_weights())
    report = {
        "backend": keras.backend.backend(),
        "world_size": WORLD_SIZE,
        "ranks": sorted(per_rank),
        # Rank 1 against rank 0: DDP keeps the replicas equal.
        "ranks_max_abs_diff": {
            name: max_diff(per_rank[0][name][1], per_rank[1][name][1]) for name in LAYERS
        },
        **compare(runs, start),
    }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
