"""BlockSparseLinear on several GPUs: DistributedDataParallel and FSDP2, one process a GPU.

    torchrun --nproc_per_node=2 examples/distributed.py ddp    # checks against one GPU
    torchrun --nproc_per_node=2 examples/distributed.py fsdp   # trains a sharded model

``ddp``: 5 SGD steps of a 3-layer block-sparse MLP, each rank on its share of the batch, give the
weights that one GPU gets on the whole batch (fp32, to 1e-5). ``fsdp``: the same model with each
layer ``fully_shard``ed trains 20 AdamW steps; the loss falls. Prints ``ok`` on rank 0.
"""

import os
import sys

import torch
import torch.distributed as dist

from sparseblocks.torch import BlockSparseLinear


def model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(BlockSparseLinear(256, 512, density=0.25, device=device), torch.nn.ReLU(),
                               BlockSparseLinear(512, 512, density=0.25, seed=1, device=device), torch.nn.ReLU(),
                               BlockSparseLinear(512, 256, density=0.25, seed=2, device=device))


def data(device, steps, rows=64):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 256, generator=generator).to(device),
             torch.randn(rows, 256, generator=generator).to(device)) for _ in range(steps)]


def ddp(rank, world, device):
    steps = 5
    batches = data(device, steps)
    shard = lambda t: t.chunk(world)[rank]  # noqa: E731
    wrapped = torch.nn.parallel.DistributedDataParallel(model(device), device_ids=[device.index])
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for x, target in batches:
        torch.nn.functional.mse_loss(wrapped(shard(x)), shard(target)).backward()
        optimizer.step()
        optimizer.zero_grad()
    single = model(device)  # one GPU, the whole batch
    optimizer = torch.optim.SGD(single.parameters(), lr=0.1)
    for x, target in batches:
        torch.nn.functional.mse_loss(single(x), target).backward()
        optimizer.step()
        optimizer.zero_grad()
    worst = max((a - b).abs().max().item() for a, b in zip(wrapped.module.parameters(), single.parameters()))
    return worst <= 1e-5, f"largest weight difference from one GPU: {worst:.2e}"


def fsdp(rank, world, device):
    from torch.distributed.fsdp import fully_shard

    sharded = model(device)
    for layer in sharded:
        if isinstance(layer, BlockSparseLinear):
            fully_shard(layer)
    fully_shard(sharded)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    x, target = data(device, 1, rows=128)[0]
    x, target = x.chunk(world)[rank], target.chunk(world)[rank]
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(sharded(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses[-1] < 0.9 * losses[0], f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"


def main(mode):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    ok, message = {"ddp": ddp, "fsdp": fsdp}[mode](rank, world, device)
    flags = torch.tensor([float(ok)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{mode} on {world} GPUs: {message}: {'ok' if flags.item() else 'FAILED'}")
    dist.destroy_process_group()
    return 0 if flags.item() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "ddp"))
