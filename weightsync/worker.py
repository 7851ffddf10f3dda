"""The trainer side: `WeightSyncWorker` and its DTensor v2 implementation.

One worker per trainer rank, usually a Ray actor started in an engine's environment by the
launcher (`backends/*/worker.py` name the concrete classes). The driver calls every method on all
ranks at once, because gathering a DTensor is a collective; only rank 0 talks to engines.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from typing import Any

import torch

from weightsync.bucket import DEFAULT_BUCKET_BYTES
from weightsync.dtensor import DTensorV2Source, init_trainer_group, shard_model
from weightsync.endpoint import Endpoint, RayEndpoint
from weightsync.fingerprint import fingerprint
from weightsync.sender import DEFAULT_TIMEOUT_S, WeightSender
from weightsync.transports import SenderTransport
from weightsync.transports.shm import ShmSender
from weightsync.wire import as_plain, dtype_from_str, specs_to_dicts

logger = logging.getLogger(__name__)

TRANSPORTS = ("shm", "cuda_ipc", "gloo", "nccl")


class _RankLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']}] {msg}", kwargs


class WeightSyncWorker(ABC):
    """Keeps engines in step with one trainer rank's model. All methods: every rank, together.

    Order of calls, driven by the training loop:
      1. `refit_info()` once: what every sync will send (plain data, HF names).
      2. `connect(engines)` once per engine set: rank 0 checks refit info with each engine;
         nothing is written to an engine before every check passed.
      3. per training step: `sync(version)`: begin, buckets, end on every engine.
      4. `verify()` whenever wanted (or `sync(..., verify=True)`): fingerprints compared.
    """

    @abstractmethod
    def refit_info(self) -> list[dict]:
        """[{name, dtype, shape, nbytes}] in send order. Called once, on all ranks."""

    @abstractmethod
    def connect(self, engines: dict[str, Any]) -> dict[str, Any]:
        """Register engines {name: engine actor handle}; checks refit info. All ranks."""

    @abstractmethod
    def sync(self, version: str, *, verify: bool = False) -> dict[str, Any]:
        """Deliver the current weights to every connected engine; a plain-data report on rank
        0, {"rank": r} on the others. All ranks."""


class DTensorV2WeightSyncWorker(WeightSyncWorker):
    """A trainer rank holding an FSDP2 (DTensor) model built from a HF checkpoint directory.

    It also trains (`train_step`) and produces reference generations, which tests and the demo
    use; a training framework would instead wrap its own model in `DTensorV2Source` and
    `WeightSender`.
    """

    engine_env: str | None = None

    def __init__(self, *, rank: int, world_size: int, master_addr: str, master_port: int,
                 model_path: str, dtype: str = "float32", sync_dtype: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
                 lr: float = 1e-3, seed: int = 0, transport: str = "shm",
                 collective_host: str = "127.0.0.1", shard_direct: bool = True,
                 direct: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: expected one of {TRANSPORTS}")
        self.transport = transport
        self.collective_host = collective_host
        # Ranks write their own FSDP shards into the shared-memory buckets (no all-gather).
        self.shard_direct = shard_direct and transport == "shm" and world_size > 1
        # The one-copy path (weightsync/direct.py): after a first sync by buckets, engines on
        # this host that can, share their parameters and the ranks write into them.
        self.direct = direct and transport == "shm"
        self._shared: dict[str, dict[str, Any]] = {}  # rank 0: engine -> shared parameters
        self._no_share: dict[str, str] = {}  # rank 0: engine -> why it has no one-copy path
        self._sent: dict[str, str] = {}  # rank 0: engine -> segment the ranks were told of
        self._targets: dict[str, Any] = {}  # every rank: engine -> DirectTarget
        torch.manual_seed(seed)
        self.rank, self.world_size = rank, world_size
        self.log = _RankLog(logger, {"rank": rank})
        self.device = init_trainer_group(rank=rank, world_size=world_size,
                                         master_addr=master_addr, master_port=master_port)
        import datetime

        import torch.distributed as dist

        # The collectives of a sync (handles, barriers) run in their own group, bounded by
        # `timeout_s`: a rank that dies mid-sync fails the others within it, whatever timeout
        # the training collectives have.
        self._sync_group = dist.new_group(backend="gloo",
                                          timeout=datetime.timedelta(seconds=timeout_s))
        # Fault injection for the reliability suite: "<bucket index>:<seconds>" makes rank 0
        # pause before writing that bucket, so a test can kill a process mid-sync.
        pause = os.environ.get("WEIGHTSYNC_TEST_PAUSE_BEFORE_BUCKET", "")
        self._test_pause = tuple(map(float, pause.split(":"))) if pause else None
        # ... and "<piece index>:<seconds>": before writing that piece on the one-copy path.
        pause = os.environ.get("WEIGHTSYNC_TEST_PAUSE_BEFORE_PIECE", "")
        self._test_pause_piece = tuple(map(float, pause.split(":"))) if pause else None
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype_from_str(dtype))
        self.model_path = model_path
        self.model = shard_model(model, device=self.device)
        self.source = DTensorV2Source(self.model, dtype=sync_dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.sender: WeightSender | None = None
        self._version = 0

    # ---- weight sync -----------------------------------------------------------------------
    def refit_info(self) -> list[dict]:
        return specs_to_dicts(self.source.specs())

    def _make_transport(self, num_receivers: int) -> SenderTransport:
        if self.transport == "shm":
            return ShmSender(num_slots=2)
        if self.transport == "cuda_ipc":
            from weightsync.transports.cuda_ipc import CudaIpcSender

            return CudaIpcSender(num_slots=2)
        from weightsync.transports.collective import CollectiveSender

        return CollectiveSender(num_receivers=num_receivers, backend=self.transport,
                                host=self.collective_host, timeout_s=self.timeout_s)

    def _endpoint(self, name: str, engine: Any) -> Endpoint:
        return RayEndpoint(engine, name=name)

    def connect(self, engines: dict[str, Any], *,
                startup_timeout_s: float = 900.0) -> dict[str, Any]:
        """Also waits up to `startup_timeout_s` for engines that are still starting."""
        if self.rank != 0:
            return {"rank": self.rank}
        if self.sender is None:
            self.sender = WeightSender(self.source.specs(), transport=None,
                                       capacity_bytes=self.bucket_bytes, timeout_s=self.timeout_s)
        elif engines and self.transport in ("gloo", "nccl"):
            raise ValueError(f"transport {self.transport!r} forms one group for all engines: "
                             f"connect every engine in one connect() call")
        answers = {}
        for name, engine in engines.items():
            answer = self.sender.add_engine(self._endpoint(name, engine),
                                            timeout_s=startup_timeout_s)
            answers[name] = {"num_params": answer["num_params"],
                             "num_receivers": answer.get("num_receivers", 1)}
        if self.sender.transport is None and answers:
            self.sender.transport = self._make_transport(
                sum(a["num_receivers"] for a in answers.values()))
        return as_plain(answers)

    def sync(self, version: str | None = None, *, verify: bool = False,
             engines: list[str] | None = None) -> dict[str, Any]:
        self._version += 1
        version = version or f"v{self._version}"
        import torch.distributed as dist

        plan: list[Any] = [None]
        if self.rank == 0:
            plan[0] = self._plan(engines)
        dist.broadcast_object_list(plan, src=0, group=self._sync_group)
        if "error" in plan[0]:
            raise ValueError(plan[0]["error"])
        buckets = list(plan[0]["buckets"])
        direct_report = None
        if plan[0]["direct"]:
            direct_report, fallback = self._sync_direct(version, plan[0]["direct"],
                                                        verify=verify)
            buckets += fallback
        bucket_report = None
        if buckets:
            if self.shard_direct:
                bucket_report = self._sync_shards(version, verify=verify, engines=buckets)
            else:
                tensors = self.source.tensors()
                if self.rank != 0:
                    for _ in tensors:  # take part in every gather
                        pass
                else:
                    bucket_report = as_plain(self.sender.sync(
                        tensors, version=version, engines=buckets, verify=verify))
            if self.rank == 0:
                self._share(buckets, bucket_report)
        if self.rank != 0:
            return {"rank": self.rank}
        report = _merge(direct_report, bucket_report)
        self.log.info("sync %s: %.3f s, %.2f GB/s (%s)", version, report["sync_s"],
                      report["gbps"], report["path"])
        return as_plain(report)

    def _plan(self, engines: list[str] | None) -> dict[str, Any]:
        """Rank 0: which engines take the one-copy path this sync, which take buckets."""
        if self.sender is None or not self.sender.engines:
            return {"error": "sync before connect: call connect({name: engine}) first"}
        names = list(self.sender.engines) if engines is None else list(engines)
        unknown = [n for n in names if n not in self.sender.engines]
        if unknown:
            return {"error": f"unknown engine(s) {unknown}; registered: "
                             f"{list(self.sender.engines)}"}
        return {"direct": [n for n in names if n in self._shared],
                "buckets": [n for n in names if n not in self._shared]}

    def _share(self, names: list[str], report: dict[str, Any] | None) -> None:
        """Rank 0, after a sync by buckets: engines that can, share their parameters."""
        if not self.direct or report is None:
            return
        for name in names:
            if name in self._shared or name in self._no_share:
                continue
            start = time.perf_counter()
            try:
                answer = self.sender.engines[name].endpoint.call("share_params",
                                                                 timeout_s=self.timeout_s)
            except Exception as exc:  # an engine without the path, or one that failed
                answer = {"shared": None, "why": f"{type(exc).__name__}: {exc}", "retry": False}
            if answer.get("shared"):
                self._shared[name] = answer["shared"]
                report["engines"][name]["share_s"] = time.perf_counter() - start
                self.log.info("engine %r shares its parameters (%.2f s): the next syncs write "
                              "into them", name, time.perf_counter() - start)
            elif not answer.get("retry"):
                self._no_share[name] = answer.get("why") or "unknown"
                self.log.info("engine %r keeps taking buckets: %s", name, answer.get("why"))

    def _sync_direct(self, version: str, names: list[str], *,
                     verify: bool) -> tuple[dict[str, Any] | None, list[str]]:
        """The one-copy path: every rank writes its own shards into the engines' shared
        parameters. Returns rank 0's report and the engines to sync by buckets instead."""
        import torch.distributed as dist

        group = self._sync_group
        if self.rank != 0:
            msg: list[Any] = [None]
            dist.broadcast_object_list(msg, src=0, group=group)
            self._write_direct(msg[0], verify=verify)
            return None, msg[0]["fallback"]

        def write(direct: list[str], fallback: list[str]) -> dict[str, Any] | None:
            new = {n: self._shared[n] for n in direct
                   if self._sent.get(n) != self._shared[n]["segment"]}
            msg = {"direct": direct, "fallback": fallback, "new": new}
            dist.broadcast_object_list([msg], src=0, group=group)
            for n in new:
                self._sent[n] = new[n]["segment"]
            for n in fallback:  # its parameters moved: buckets now, then share again
                self._shared.pop(n, None)
            return self._write_direct(msg, verify=verify)

        report, fallback = self.sender.sync_direct(write, version=version, engines=names,
                                                   verify=verify)
        if report is not None:
            report["phases_s"]["rank_write"] = self._rank_write_s
        return report, fallback

    def _write_direct(self, msg: dict[str, Any], *, verify: bool) -> dict[str, Any] | None:
        """Every rank: write this rank's shards into the engines `msg` names (reading each
        back when verifying); gather to rank 0 how many pieces were written and which tensors'
        bytes read back differently."""
        import torch.distributed as dist

        from weightsync.direct import DirectTarget
        from weightsync.dtensor import ShardPieces

        for name, shared in msg["new"].items():
            old = self._targets.pop(name, None)
            if old is not None:
                old.close()
            self._targets[name] = DirectTarget(shared)
        targets = [self._targets[n] for n in msg["direct"]]
        pieces, mismatched = 0, set()
        start = time.perf_counter()
        pause = self._test_pause_piece if self.rank == 0 else None
        if targets:
            for index, (name, data, offset) in enumerate(ShardPieces(self.source,
                                                                      rank=self.rank)):
                if pause and index == int(pause[0]):
                    self.log.warning("test pause: %.0f s before piece %d", pause[1], index)
                    time.sleep(pause[1])
                if data is None:
                    continue
                raw = data.reshape(-1).view(torch.uint8)
                for target in targets:
                    if not target.write(name, offset, raw, check=verify):
                        mismatched.add(name)
                pieces += 1
        mine = (pieces, sorted(mismatched), time.perf_counter() - start)
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self._sync_group)
        if gathered is None:
            return None
        self._rank_write_s = [seconds for _, _, seconds in gathered]
        return {"pieces": sum(n for n, _, _ in gathered),
                "mismatched": sorted({m for _, bad, _ in gathered for m in bad})}

    def _sync_shards(self, version: str, *, verify: bool,
                     engines: list[str] | None) -> dict[str, Any]:
        """Every rank copies its own shard of each tensor into the shared bucket at its offset.

        Per bucket: rank 0 broadcasts the slot's handle once the engines are done with it (the
        other ranks wait for it: the slot is free), all ranks write, a barrier, then rank 0 hands
        the bucket to the engines."""
        import torch.distributed as dist

        from weightsync.bucket import plan_buckets
        from weightsync.dtensor import ShardPieces
        from weightsync.transports.shm import ShmReceiver

        pieces = iter(ShardPieces(self.source, rank=self.rank))
        group = self._sync_group

        def write(plan: Any, buffer: torch.Tensor) -> None:
            for meta in plan.tensors:
                name, data, offset = next(pieces)
                assert name == meta.name, f"shard stream gave {name!r}, plan has {meta.name!r}"
                if data is not None:
                    start = meta.offset + offset
                    buffer[start:start + data.nbytes].copy_(data.reshape(-1).view(torch.uint8))

        if self.rank == 0:
            def write_bucket(plan: Any, slot: int, buffer: torch.Tensor) -> None:
                if self._test_pause and plan.index == int(self._test_pause[0]):
                    self.log.warning("test pause: %.0f s before bucket %d", self._test_pause[1],
                                     plan.index)
                    time.sleep(self._test_pause[1])
                dist.broadcast_object_list([self.sender.transport.handle(slot)], src=0,
                                           group=group)
                write(plan, buffer)
                dist.barrier(group=group)

            report = self.sender.sync(None, version=version, engines=engines, verify=verify,
                                      write_bucket=write_bucket)
            return as_plain(report)
        if not hasattr(self, "_shard_maps"):
            self._shard_maps = ShmReceiver(max_open=4)
        for plan in plan_buckets(self.source.specs(), capacity_bytes=self.bucket_bytes):
            handle: list[Any] = [None]
            dist.broadcast_object_list(handle, src=0, group=group)
            write(plan, self._shard_maps.receive(handle[0], plan.nbytes))
            dist.barrier(group=group)
        return {"rank": self.rank}

    # ---- training, for tests and the demo ------------------------------------------------------
    def train_step(self, token_ids: list[list[int]]) -> float:
        """One optimizer step of next-token loss on `token_ids` (same batch on every rank)."""
        self.model.train()
        batch = torch.tensor(token_ids, device=self.device)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        return float(loss.detach())

    def full_state(self) -> dict[str, torch.Tensor]:
        return dict(self.source.tensors())

    def tensor_fingerprints(self) -> dict[str, list[int]]:
        """{HF name: fingerprint} of what a sync sends (all ranks; meaningful on rank 0)."""
        return {name: list(fingerprint(t)) for name, t in self.source.tensors()}

    def reference_generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> Any:
        """Greedy continuations from an unsharded float32 copy of the current weights.

        Returns {"tokens": [[ids]], "logprobs": [[float]]} on rank 0, None elsewhere."""
        from transformers import AutoConfig, AutoModelForCausalLM

        state = self.full_state()
        if self.rank != 0:
            return None
        config = AutoConfig.from_pretrained(self.model_path)
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        reference.load_state_dict({k: v.float().cpu() for k, v in state.items()}, strict=False,
                                  assign=True)
        reference.tie_weights()
        reference.eval()
        tokens, logprobs = [], []
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = reference.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                         output_scores=True, return_dict_in_generate=True,
                                         pad_token_id=config.pad_token_id)
                new = out.sequences[0, len(prompt):].tolist()
                tokens.append(new)
                logprobs.append([float(torch.log_softmax(s[0].float(), -1)[t])
                                 for s, t in zip(out.scores, new)])
        return {"tokens": tokens, "logprobs": logprobs}

    def set_weights_from(self, other_seed: int) -> None:
        """Overwrite the model with another seed's random weights (tests: a big change)."""
        with torch.no_grad():
            gen = torch.Generator().manual_seed(other_seed)
            for param in self.model.parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(torch.randn(local.shape, generator=gen) * 0.05)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def process_stats(self) -> dict[str, int]:
        from weightsync.procstats import process_tree_stats

        return process_tree_stats()

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "torch": str(torch.__version__)}


def _merge(direct: dict[str, Any] | None, buckets: dict[str, Any] | None) -> dict[str, Any]:
    """One report for a sync whose engines took different paths."""
    if direct is None or buckets is None:
        report = direct or buckets
        assert report is not None
        return report
    report = {**buckets, "path": "mixed", "engines": {**direct["engines"], **buckets["engines"]},
              "sync_s": direct["sync_s"] + buckets["sync_s"]}
    report["gbps"] = report["nbytes"] / report["sync_s"] / 1e9
    if "verify" in direct or "verify" in buckets:
        report["verify"] = {**direct.get("verify", {}), **buckets.get("verify", {})}
        report["verify"]["verify_s"] = (direct.get("verify", {}).get("verify_s", 0.0)
                                        + buckets.get("verify", {}).get("verify_s", 0.0))
    return report
