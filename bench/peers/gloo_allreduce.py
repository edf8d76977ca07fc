"""PyTorch torch.distributed.all_reduce over Gloo on float sums, timed as spmdx bench comm
times its own (average after a warm-up, in place), for bench/comm_peers.sh.
Prints "BYTES busbw_GBps". Usage: python gloo_allreduce.py NPROC BYTES [ITERS]"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, n, nbytes, iters, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    for _ in range(3):
        dist.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    seconds = (time.perf_counter() - t0) / iters
    if rank == 0:
        queue.put(nbytes / seconds / 1e9 * 2 * (n - 1) / n)
    dist.destroy_process_group()


def main():
    n, nbytes = int(sys.argv[1]), int(sys.argv[2])
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(n, nbytes, iters, port, queue), nprocs=n, join=True)
    print(f"{nbytes} {queue.get():.3f}")


if __name__ == "__main__":
    main()
