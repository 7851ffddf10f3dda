"""GPU transports on one host: correctness and throughput beside the hardware's own rates.

Runs where CUDA exists (torch alone; no engine needed):
  python scripts/gpu_bench.py ipc   --sizes-gb 1,4,16   # CUDA IPC between two processes, one GPU
  python scripts/gpu_bench.py nccl  --sizes-gb 1,4,16   # collective transport over NCCL, two GPUs
  python scripts/gpu_bench.py tp-ipc --sizes-gb 1,4     # two tensor-parallel workers (GPU 0, 1)
Each run drives the real WeightSender (refit check, begin, buckets, end, fingerprint verification)
into a ModuleWeightReceiver in another process, which copies every tensor into preallocated
parameters the way an engine's loader does (CUDA IPC: straight from the trainer's tensors, or
from bucket buffers with --no-zero-copy); a sync ends when the receiver's GPU work is done. The
sender reaches the receiver over a multiprocessing pipe (~30 us a call). In the same run it
measures the reference: a device-to-device copy of the same bytes (ipc) or a bare broadcast of
one tensor of the same size over the same NCCL group (nccl). Prints one JSON line per size and
bucket size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import torch

TENSOR_BYTES = 256 << 20


def _model(num_tensors: int, numel: int, device: str) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(num_tensors):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(
            torch.zeros(numel, dtype=torch.bfloat16, device=device), requires_grad=False
        )
        model.layers.append(layer)
    return model


def _sliced_model(
    num_tensors: int, rows: int, cols: int, rank: int, size: int, device: str
) -> torch.nn.Module:
    """Tensor-parallel worker `rank` of `size`: even layers keep rows (column-parallel), odd
    ones columns (row-parallel), each parameter's loader narrowing the full tensor, as vLLM's
    and SGLang's loaders do."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(num_tensors):
        dim = i % 2
        shape = [rows, cols]
        shape[dim] //= size
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(
            torch.zeros(shape, dtype=torch.bfloat16, device=device), requires_grad=False
        )

        def loader(param, tensor, dim=dim):
            n = param.shape[dim]
            param.data.copy_(tensor.narrow(dim, rank * n, n))

        layer.weight.weight_loader = loader
        model.layers.append(layer)
    return model


def _receiver_main(
    device: int, num_tensors: int, numel: int, conn, tp: tuple[int, int, int, int] | None = None
) -> None:
    """`tp`: (rank, size, rows, cols): a sliced worker of 2-D tensors of rows x cols."""
    torch.cuda.set_device(device)
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.wire.errors import error_to_wire

    if tp is None:
        receiver = ModuleWeightReceiver(
            _model(num_tensors, numel, f"cuda:{device}"), name="receiver"
        )
    else:
        rank, size, rows, cols = tp
        receiver = ModuleWeightReceiver(
            _sliced_model(num_tensors, rows, cols, rank, size, f"cuda:{device}"),
            name=f"worker{rank}",
            sliced=True,
        )
    while (item := conn.recv()) is not None:
        method, args = item
        try:
            if method == "bare_broadcast":
                from weightsync.transports.collective import _broadcast

                transport = receiver.receiver.buckets.transport("nccl")
                group = next(iter(transport._groups.values()))
                big = torch.empty(args[0], dtype=torch.uint8, device=f"cuda:{device}")
                _broadcast(group, big, __import__("datetime").timedelta(seconds=120))
                torch.cuda.synchronize()
                conn.send(("ok", None))
                continue
            result = getattr(receiver, method)(*args)
            if method == "end":  # the update is done once its copies are
                torch.cuda.synchronize()
            conn.send(("ok", result))
        except Exception as exc:  # reported to the sender as plain data
            conn.send(("error", error_to_wire(exc)))
    receiver.receiver.close()


class PipeEndpoint:
    """An Endpoint over a multiprocessing pipe (~30 us a round trip). Calls are answered in
    order; a ticket is the call's number, so waiting for a later call (an abort while loads
    are in flight) sets the earlier answers aside."""

    def __init__(self, conn, name):
        self.conn, self.name = conn, name
        self._sent = self._received = 0
        self._answers: dict[int, tuple] = {}

    def submit(self, method, *args):
        self.conn.send((method, args))
        self._sent += 1
        return self._sent

    def wait(self, ticket, *, timeout_s):
        deadline = time.perf_counter() + timeout_s
        while ticket not in self._answers:
            if not self.conn.poll(max(0.0, deadline - time.perf_counter())):
                raise RuntimeError(f"{self.name}: no answer to call {ticket} in {timeout_s} s")
            self._received += 1
            self._answers[self._received] = self.conn.recv()
        status, value = self._answers.pop(ticket)
        if status == "error":
            from weightsync.wire.errors import error_from_wire

            raise error_from_wire(value, peer=self.name)
        return value

    def call(self, method, *args, timeout_s):
        return self.wait(self.submit(method, *args), timeout_s=timeout_s)


def start_receiver(device: int, num_tensors: int, numel: int, *, tp=None, name="receiver"):
    """A ModuleWeightReceiver with `num_tensors` bf16 parameters of `numel` (with `tp`, a sliced
    worker's) in a spawned process on GPU `device`; returns (endpoint, process)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver_main, args=(device, num_tensors, numel, there, tp))
    child.start()
    return PipeEndpoint(here, name), child


def stop_receiver(endpoint, child) -> None:
    endpoint.conn.send(None)
    child.join(timeout=120)


def source_model(num_tensors: int, numel: int, device: int) -> torch.nn.Module:
    model = _model(num_tensors, numel, f"cuda:{device}")
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.weight.normal_(generator=torch.Generator(device="cuda").manual_seed(i))
    return model


def run(
    kind: str, size_gb: float, repeats: int, bucket_bytes: int | list[int], zero_copy: bool = True
) -> dict | list[dict]:
    """One result per bucket size (a dict when `bucket_bytes` is one int)."""
    from weightsync.trainer.sender import WeightSender
    from weightsync.trainer.source import DTensorV2Source

    buckets = [bucket_bytes] if isinstance(bucket_bytes, int) else list(bucket_bytes)
    sender_device, receiver_device = (0, 0) if kind == "ipc" else (0, 1)
    torch.cuda.set_device(sender_device)
    numel = TENSOR_BYTES // 2
    num_tensors = max(1, int(size_gb * (1 << 30)) // TENSOR_BYTES)
    nbytes = num_tensors * TENSOR_BYTES
    source = DTensorV2Source(source_model(num_tensors, numel, sender_device))
    endpoint, child = start_receiver(receiver_device, num_tensors, numel)
    if kind == "ipc":
        from weightsync.transports.cuda_ipc import CudaIpcSender

        transport = CudaIpcSender(num_slots=2, zero_copy=zero_copy)
    else:
        from weightsync.transports.collective import CollectiveSender

        transport = CollectiveSender(num_receivers=1, backend="nccl", timeout_s=300)
    results = []
    for bucket in buckets:
        sender = WeightSender(
            source.specs(), transport=transport, capacity_bytes=bucket, timeout_s=300
        )
        sender.add_engine(endpoint)
        sender.sync(source.tensors(), version="warmup")
        times, load_s = [], []
        for i in range(repeats):
            torch.cuda.synchronize()
            report = sender.sync(source.tensors(), version=f"v{i}")
            times.append(report.sync_s)
            load_s.append(report.engines[endpoint.name].load_s)
        verified = (
            sender.sync(source.tensors(), version="verify", verify=True)
            .verify[endpoint.name]
            .verified
        )
        results.append(
            {
                "kind": kind,
                "size_gb": nbytes / (1 << 30),
                "nbytes": nbytes,
                "bucket_mb": bucket >> 20,
                "zero_copy": zero_copy if kind == "ipc" else None,
                "sync_s": min(times),
                "sync_gbps": nbytes / min(times) / 1e9,
                "load_s": load_s[times.index(min(times))],
                "num_buckets": len(sender.plans),
                "verified": verified,
            }
        )
    if kind == "ipc":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        copies = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - start)
        reference = ("device copy", nbytes / min(copies) / 1e9)
        del src, dst
    else:
        from weightsync.transports.collective import _broadcast

        big = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        rates = []
        for _ in range(repeats + 1):
            ticket = endpoint.submit("bare_broadcast", nbytes)
            torch.cuda.synchronize()
            start = time.perf_counter()
            _broadcast(transport.group, big, transport.timeout)
            torch.cuda.synchronize()
            endpoint.wait(ticket, timeout_s=300)
            rates.append(nbytes / (time.perf_counter() - start) / 1e9)
        reference = ("bare NCCL broadcast", max(rates[1:]))
        del big
    for result in results:
        result["reference"], result["reference_gbps"] = reference
        result["ratio"] = result["sync_gbps"] / result["reference_gbps"]
    stop_receiver(endpoint, child)
    transport.close()
    return results[0] if isinstance(bucket_bytes, int) else results


def timed_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Seconds of the fastest of `repeats` device copies `dst.copy_(src)` (after one warm-up)."""
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def run_tp(size_gb: float, repeats: int, bucket_bytes: int) -> dict:
    """One trainer (GPU 0) into two tensor-parallel workers (GPU 0 and GPU 1) over CUDA IPC:
    each maps the trainer's buckets and keeps its slice (half the rows of even layers, half
    the columns of odd ones). Verified per worker through the placements each learned. The
    references: a bare copy of one worker's slice bytes GPU 0 -> GPU 0 and GPU 0 -> GPU 1.
    (NCCL would need three GPUs: one per rank of the trainer-and-workers group.)"""
    from weightsync.trainer.sender import WeightSender
    from weightsync.trainer.source import DTensorV2Source
    from weightsync.transports.cuda_ipc import CudaIpcSender
    from weightsync.wire.fingerprint import fingerprint
    from weightsync.wire.placement import WorkerPrints

    torch.cuda.set_device(0)
    rows, cols = 8192, 4096  # 64 MiB of bf16 each
    num_tensors = max(2, int(size_gb * (1 << 30)) // (rows * cols * 2))
    nbytes = num_tensors * rows * cols * 2
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(num_tensors):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(
            torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda"), requires_grad=False
        )
        layer.weight.data.normal_(generator=torch.Generator(device="cuda").manual_seed(i))
        model.layers.append(layer)
    source = DTensorV2Source(model)
    workers = [
        start_receiver(device, num_tensors, 0, tp=(rank, 2, rows, cols), name=f"tp{rank}")
        for rank, device in enumerate((0, 1))
    ]
    transport = CudaIpcSender(num_slots=2, zero_copy=True)
    sender = WeightSender(
        source.specs(), transport=transport, capacity_bytes=bucket_bytes, timeout_s=600
    )
    for endpoint, _ in workers:
        sender.add_engine(endpoint)
    start = time.perf_counter()
    sender.sync(source.tensors(), version="warmup")  # each worker learns its placements
    first_s = time.perf_counter() - start
    times = []
    for i in range(repeats):
        torch.cuda.synchronize()
        times.append(sender.sync(source.tensors(), version=f"v{i}").sync_s)
    names = [endpoint.name for endpoint, _ in workers]
    start = time.perf_counter()
    expected = {n: WorkerPrints(sender.engines[n].placements) for n in names}
    sent = {}
    for name, tensor in source.tensors():
        sent[name] = fingerprint(tensor)
        for prints in expected.values():
            prints.add(name, tensor)
    checked = sender.verify(
        sent, engines=names, worker_sent={n: p.result() for n, p in expected.items()}
    )
    verify_s = time.perf_counter() - start
    half = nbytes // 2
    src = torch.empty(half, dtype=torch.uint8, device="cuda:0")
    local_s = timed_copy(torch.empty_like(src), src, repeats)
    peer_s = timed_copy(torch.empty(half, dtype=torch.uint8, device="cuda:1"), src, repeats)
    for endpoint, child in workers:
        stop_receiver(endpoint, child)
    transport.close()
    sync_s = min(times)
    return {
        "kind": "tp-ipc",
        "workers": 2,
        "size_gb": nbytes / (1 << 30),
        "nbytes": nbytes,
        "bytes_per_worker_slice": half,
        "bucket_mb": bucket_bytes >> 20,
        "num_tensors": num_tensors,
        "first_sync_s": first_s,
        "sync_s": sync_s,
        "copy_slice_gpu0_s": local_s,
        "copy_slice_gpu0_to_gpu1_s": peer_s,
        # the workers copy at once, each on its own GPU: the slower copy is the floor
        "ratio_to_slower_copy": max(local_s, peer_s) / sync_s,
        "ratio_to_both_copies_in_turn": (local_s + peer_s) / sync_s,
        "verified": all(checked[n].verified for n in names),
        "num_checked": {n: checked[n].num_checked for n in names},
        "verify_s": verify_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["ipc", "nccl", "tp-ipc"])
    parser.add_argument("--sizes-gb", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", default="1024", help="one or more, comma-separated")
    parser.add_argument(
        "--no-zero-copy",
        action="store_true",
        help="ipc: copy every tensor into bucket buffers (the old path)",
    )
    args = parser.parse_args()
    buckets = [int(b) << 20 for b in args.bucket_mb.split(",")]
    if args.kind == "tp-ipc":
        for size in args.sizes_gb.split(","):
            print(json.dumps(run_tp(float(size), args.repeats, buckets[0])), flush=True)
        return
    for size in args.sizes_gb.split(","):
        for result in run(
            args.kind, float(size), args.repeats, buckets, zero_copy=not args.no_zero_copy
        ):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
