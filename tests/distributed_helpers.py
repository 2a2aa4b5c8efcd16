"""Run a function on W processes joined by a gloo group on this machine, with a time limit:
a hang fails the test and the children are killed, never CI.

    results = run_group(worker, world=3, args=(...,), timeout=180)   # [rank 0's, rank 1's, ...]

`worker(rank, world, *args)` runs in a fork of a forkserver that imported torch and fusedattn
(TRITON_INTERPRET is the suite's from the start; the rest of the caller's environment is set
in the child) after torch.distributed is initialised; what it returns comes back pickled. An
exception in any rank fails with that rank's traceback.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import tempfile
import traceback

import torch


def _entry(worker, rank, world, init_file, args, queue, environ):
    try:
        os.environ.clear()  # the caller's environment now, not the server's at its start
        os.environ.update(environ)
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        try:
            result = worker(rank, world, *args)
        finally:
            dist.destroy_process_group()
        # bytes, not tensors: a tensor sent through a queue lives in shared memory that dies
        # with this process, possibly before the parent reads it
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _context():
    """A forkserver whose server imported torch and fusedattn once: each rank is a fork of it,
    not an interpreter that imports torch again (the five distributed test files on two
    workers: 137 s with spawned ranks, 57 s forked, 2026-12-02 on the 2-core CI machine). The
    server is a fresh single-threaded process, so its forks are safe where forking this
    (threaded) pytest process would not be."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fusedattn"])
    return ctx


def run_group(worker, world: int, args=(), timeout: float = 240.0):
    ctx = _context()
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="fusedattn-dist-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(worker, r, world, init_file, args, queue, environ),
                         daemon=True) for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    except Exception as exc:  # queue.Empty: a rank hung
        errors.append(f"timed out after {timeout:.0f}s waiting for the group ({exc!r})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
