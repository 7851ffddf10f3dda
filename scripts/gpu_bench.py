"""GPU transports on one host: correctness and throughput beside the hardware's own rates.

Runs where CUDA exists (torch alone; no engine needed):
  python scripts/gpu_bench.py ipc   --sizes-gb 1,4,16   # CUDA IPC between two processes, one GPU
  python scripts/gpu_bench.py nccl  --sizes-gb 1,4,16   # collective transport over NCCL, two GPUs
Each run drives the real WeightSender (refit check, begin, buckets, end, fingerprint verification)
into a ModuleWeightReceiver in another process, which copies every bucket into preallocated
parameters the way an engine's loader does. In the same run it measures the reference: a
device-to-device copy of the same bytes (ipc) or a bare broadcast of one tensor of the same size
over the same NCCL group (nccl). Prints one JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp

TENSOR_BYTES = 256 << 20


def _model(num_tensors: int, numel: int, device: str) -> torch.nn.Module:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(num_tensors):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16, device=device),
                                          requires_grad=False)
        model.layers.append(layer)
    return model


def _receiver_main(kind: str, device: int, num_tensors: int, numel: int, requests, replies):
    torch.cuda.set_device(device)
    from weightsync.receiver import ModuleWeightReceiver

    receiver = ModuleWeightReceiver(_model(num_tensors, numel, f"cuda:{device}"), name=kind)
    while (item := requests.get()) is not None:
        method, args = item
        try:
            if method == "bare_broadcast":
                from weightsync.transports.collective import _broadcast

                transport = receiver.receiver._transport("collective")
                group = next(iter(transport._groups.values()))
                big = torch.empty(args[0], dtype=torch.uint8, device=f"cuda:{device}")
                _broadcast(group, big, __import__("datetime").timedelta(seconds=120))
                torch.cuda.synchronize()
                replies.put(("ok", None))
                continue
            result = getattr(receiver, method)(*args)
            if method == "load_bucket":
                torch.cuda.synchronize()
            replies.put(("ok", result))
        except Exception as exc:  # reported to the sender
            replies.put(("error", f"{type(exc).__name__}: {exc}"))
    receiver.receiver.close()


class _QueueEndpoint:
    """An Endpoint over multiprocessing queues (calls answered in order)."""

    def __init__(self, requests, replies, name):
        self.requests, self.replies, self.name = requests, replies, name

    def submit(self, method, *args):
        self.requests.put((method, args))
        return method

    def wait(self, ticket, *, timeout_s):
        status, value = self.replies.get(timeout=timeout_s)
        if status == "error":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def call(self, method, *args, timeout_s):
        return self.wait(self.submit(method, *args), timeout_s=timeout_s)


def run(kind: str, size_gb: float, repeats: int, bucket_bytes: int) -> dict:
    from weightsync.dtensor import DTensorV2Source
    from weightsync.sender import WeightSender

    sender_device, receiver_device = (0, 0) if kind == "ipc" else (0, 1)
    torch.cuda.set_device(sender_device)
    numel = TENSOR_BYTES // 2
    num_tensors = max(1, int(size_gb * (1 << 30)) // TENSOR_BYTES)
    nbytes = num_tensors * TENSOR_BYTES
    source_model = _model(num_tensors, numel, f"cuda:{sender_device}")
    with torch.no_grad():
        for i, layer in enumerate(source_model.layers):
            layer.weight.normal_(generator=torch.Generator(device="cuda").manual_seed(i))
    source = DTensorV2Source(source_model)
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver_main,
                        args=(kind, receiver_device, num_tensors, numel, requests, replies))
    child.start()
    if kind == "ipc":
        from weightsync.transports.cuda_ipc import CudaIpcSender

        transport = CudaIpcSender(num_slots=2)
    else:
        from weightsync.transports.collective import CollectiveSender

        transport = CollectiveSender(num_receivers=1, backend="nccl", timeout_s=300)
    sender = WeightSender(source.specs(), transport=transport, capacity_bytes=bucket_bytes,
                          timeout_s=300)
    endpoint = _QueueEndpoint(requests, replies, f"{kind}-receiver")
    sender.add_engine(endpoint)
    sender.sync(source.tensors(), version="warmup")
    times = []
    for i in range(repeats):
        torch.cuda.synchronize()
        report = sender.sync(source.tensors(), version=f"v{i}")
        times.append(report["sync_s"])
    verified = sender.sync(source.tensors(), version="verify",
                           verify=True)["verify"][endpoint.name]["verified"]
    result = {"kind": kind, "size_gb": nbytes / (1 << 30), "nbytes": nbytes,
              "bucket_mb": bucket_bytes >> 20, "sync_s": min(times),
              "sync_gbps": nbytes / min(times) / 1e9, "verified": verified}
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
        result["reference"] = "device copy"
        result["reference_gbps"] = nbytes / min(copies) / 1e9
        del src, dst
    else:
        from weightsync.transports.collective import _broadcast

        big = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        rates = []
        for _ in range(repeats + 1):
            requests.put(("bare_broadcast", (nbytes,)))
            torch.cuda.synchronize()
            start = time.perf_counter()
            _broadcast(transport.group, big, transport.timeout)
            torch.cuda.synchronize()
            status, _ = replies.get(timeout=300)
            rates.append(nbytes / (time.perf_counter() - start) / 1e9)
        result["reference"] = "bare NCCL broadcast"
        result["reference_gbps"] = max(rates[1:])
        del big
    result["ratio"] = result["sync_gbps"] / result["reference_gbps"]
    requests.put(None)
    child.join(timeout=120)
    sender.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["ipc", "nccl"])
    parser.add_argument("--sizes-gb", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=1024)
    args = parser.parse_args()
    for size in args.sizes_gb.split(","):
        print(json.dumps(run(args.kind, float(size), args.repeats, args.bucket_mb << 20)),
              flush=True)


if __name__ == "__main__":
    main()
