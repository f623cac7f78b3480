"""Can two processes on ONE GPU form an NCCL group and broadcast? (bench/device_session.sh)

Fractional Ray GPU shares (a rollout actor and a learner rank with ``num_gpus`` 0.4 each) put both
processes on the same device, and the collective weight sync (``learner.weight_sync``:
``collective``, what ``auto`` picks when both hold GPUs) opens an NCCL group between them.
This forms that group as ``weight_transfer.Channel`` does (a TCPStore, ``ProcessGroupNCCL``) and
broadcasts 64 MiB from rank 0, then prints what happened. Prints ``same-GPU NCCL: ok`` or the
error; exits 0 either way (the answer is the finding).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import traceback
from datetime import timedelta


def member(rank: int, port: int, q: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=30)
        pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        flat = torch.full((16 << 20,), float(rank == 0), device="cuda:0")
        bo = dist.BroadcastOptions()
        bo.rootRank = 0
        pg.broadcast([flat], bo).wait()
        torch.cuda.synchronize()
        q.put((rank, "ok", float(flat.min())))
    except Exception as err:  # noqa: BLE001 - the error is the finding
        q.put((rank, "error", f"{type(err).__name__}: {err}"[:600]))
        traceback.print_exc()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        try:
            results.append(q.get(timeout=45))
        except Exception:  # noqa: BLE001
            results.append((None, "timeout", "no answer in 45 s"))
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    for r in sorted(results, key=str):
        print("rank", *r)
    ok = all(r[1] == "ok" and r[2] == 1.0 for r in results)
    print("same-GPU NCCL:", "ok" if ok else "FAILED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
