"""The vLLM engine actor: a real vLLM engine (V1) that generates and receives weights.

The receiving side runs inside vLLM's workers (backends/vllm/extension.py), reached through
collective_rpc with plain data; the bytes travel through the core's transport. Two deliveries:
`mode="engine"` wraps an in-process `vllm.LLM`; `mode="http"` starts vLLM's OpenAI-compatible
server on 127.0.0.1 with the extension and reaches it through its `/collective_rpc` endpoint
(served only with VLLM_SERVER_DEV_MODE=1). vLLM's API key guards only its /v1-style routes; the
server also runs `guard.KeyOnEveryRoute`, which demands the key on every route but /health, and
gets the key through its environment, not its command line. `url=` attaches to a server the
framework started itself with the same extension and guard (`attach_command` says how); the
actor then drives it exactly as one it started, and leaves it running.
On a CPU machine vLLM needs `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache); the actor sets 1.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from typing import Any

from weightsync.backends.vllm.guard import KEY_VARIABLE, SWITCH_PATH, all_undone
from weightsync.driver.preflight import (
    cpu_binding,
    cuda_device_present,
    read_config,
    refuse_unsupported_vllm,
)
from weightsync.engine.gate import close_gate, open_gate
from weightsync.engine.one_copy.sharing import combine_worker_shares
from weightsync.engine.pause_clock import PauseClock
from weightsync.engine.refit import combine_refit_answers
from weightsync.engine.sampling import (
    Sample,
    SamplingOptions,
    as_decoded,
    generate_answer,
    probe_decoding,
)
from weightsync.engine.server import LocalServer, RemoteServer, cli_flags
from weightsync.engine.session import EngineSession, NothingSwitched
from weightsync.wire.probe import Decoded
from weightsync.wire.protocol import (
    EndReport,
    LoadReport,
    SettleReport,
    ShareAnswer,
    StageReport,
)
from weightsync.wire.specs import as_plain, unwrap_all

logger = logging.getLogger(__name__)

EXTENSION = "weightsync.backends.vllm.extension.WeightsyncWorkerExtension"
GUARD = "weightsync.backends.vllm.guard.KeyOnEveryRoute"


def _checkpoint_dtype(model_path: str) -> str:
    """The dtype the checkpoint's config.json names ("dtype"; "torch_dtype" before transformers
    5), else float32. Not vLLM's "auto": that runs a float32 checkpoint in bfloat16, which a
    float32 trainer's syncs would be refused by."""
    config = read_config(model_path) or {}
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _vllm_sampling(options: SamplingOptions) -> dict[str, Any]:
    """`options` as vLLM's SamplingParams fields, which its completions request also takes."""
    return {
        "max_tokens": options.max_new_tokens,
        "min_tokens": options.min_new_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "min_p": options.min_p,
        "repetition_penalty": options.repetition_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "n": options.n,
        "seed": options.seed,
        "ignore_eos": options.ignore_eos,
        "stop": list(options.stop),
        "stop_token_ids": list(options.stop_token_ids),
        # The sampled token's log-probability comes with any count; 1 is the least asked for.
        "logprobs": max(1, options.top_logprobs),
    }


def _most_likely(step: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens of one position's {token id: Logprob}, most likely first
    (vLLM adds the sampled token, at its own rank)."""
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank <= k)
    return [(int(t), float(logprob)) for _, t, logprob in ranked]


def _token_id(token: str) -> int:
    """A token of a completions answer made with return_tokens_as_token_ids: "token_id:42"."""
    return int(token.split(":")[-1])


class _InProcess:
    def __init__(self, model_path: str, args: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(model=model_path, worker_extension_cls=EXTENSION, **args)
        self.owned = True
        self.tp_size = int(args.get("tensor_parallel_size", 1))

    @classmethod
    def of(cls, llm: Any) -> _InProcess:
        """The client of a `vllm.LLM` its owner made (with weightsync's extension); refuses
        one made without it, naming the argument to add."""
        config = llm.llm_engine.vllm_config
        extension = config.parallel_config.worker_extension_cls
        if extension != EXTENSION:
            raise ValueError(
                f"vllm.LLM runs worker extension {extension!r}, not weightsync's: make it with "
                f"LLM(..., worker_extension_cls={EXTENSION!r})"
            )
        self = cls.__new__(cls)
        self.llm, self.owned = llm, False
        self.tp_size = int(config.parallel_config.tensor_parallel_size)
        return self

    def rpc(self, method: str, args: tuple) -> list[dict]:
        return self.llm.collective_rpc(method, args=args)

    def reset_prefix_cache(self) -> bool:
        # A KV connector's cache too (CPU offloading, LMCache): it holds KV of the old weights.
        return _retried(lambda: bool(self.llm.reset_prefix_cache(reset_connector=True)))

    def switch(self, version: str, revert: bool = False) -> tuple[list[dict], dict[str, Any]]:
        """A staged update's end (`_Http.switch`), or with `revert` the previous weights put
        back; nothing to hold: this actor is the engine's only client, one call at a time.
        (each worker's raw answer, its `PauseClock` report)"""
        clock = PauseClock()
        if not self.reset_prefix_cache():
            raise NothingSwitched("the prefix cache could not be reset; nothing was switched")
        clock.mark("cache")
        results = self.rpc("weightsync_revert" if revert else "weightsync_commit", ())
        clock.mark("switch")
        switched = [bool(r.get("ok")) for r in results]
        undone = None
        if all(switched):  # else the update fails (`_switch`)
            self.set_version(version)
        elif not revert:  # each worker back on the weights it served, where it can be
            undone = all_undone(self.rpc("weightsync_undo_switch", (switched,)))
        clock.mark("version")
        return results, {"undone": undone, **clock.report()}

    def set_version(self, version: str) -> None:
        if hasattr(self.llm, "update_weight_version"):
            self.llm.update_weight_version(version)

    def generate(
        self, prompts: list[list[int]], options: SamplingOptions, probe: bool = False
    ) -> list[Sample]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(**_vllm_sampling(options))
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        samples = []
        for out in outs:
            for sample in sorted(out.outputs, key=lambda o: o.index):
                ids = list(sample.token_ids)
                steps = sample.logprobs or []
                samples.append(
                    Sample(
                        tokens=ids,
                        logprobs=[float(step[t].logprob) for step, t in zip(steps, ids)],
                        finish_reason=str(sample.finish_reason),
                        top_logprobs=[_most_likely(step, options.top_logprobs) for step in steps]
                        if options.top_logprobs
                        else None,
                    )
                )
        return samples

    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """Per prompt, vLLM's log-probability of each token after the first given the ones
        before it (prompt log-probs: one forward over the prompt, every worker taking part)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        scores = []
        for prompt, out in zip(prompts, outs):
            steps = out.prompt_logprobs or []
            scores.append([float(step[t].logprob) for step, t in zip(steps[1:], prompt[1:])])
        return scores

    def shutdown(self) -> None:
        if self.owned:  # an engine its owner made stays theirs
            del self.llm


def _retried(reset: Any, attempts: int = 5) -> bool:
    """`reset()` until it answers True, `attempts` times at most: vLLM refuses to reset its prefix
    cache while blocks are still held (a request finishing), and says to retry."""
    for attempt in range(attempts):
        if reset():
            return True
        if attempt + 1 < attempts:
            time.sleep(0.2)
    return False


def reset_prefix_cache(request: Any) -> bool:
    """vLLM's server's `/reset_prefix_cache` (`request(method, path)` -> (status, JSON)), a KV
    connector's cache included (`reset_external`; vLLM counts none configured as reset): whether
    it was reset. The route answers 200 either way, with {"success": ...}."""

    def once() -> bool:
        status, out = request("POST", "/reset_prefix_cache?reset_external=true")
        return status == 200 and isinstance(out, dict) and bool(out.get("success"))

    return _retried(once)


def attach_flags() -> list[str]:
    """What a framework's own `vllm serve MODEL ...` needs for weightsync to attach to it, beside
    `VLLM_SERVER_DEV_MODE=1` and `VLLM_API_KEY=<key>` in the server's environment."""
    return ["--worker-extension-cls", EXTENSION, "--middleware", GUARD]


class _Http:
    _token = ""  # the open update's: the one request the closed gate lets pass (`pause`)

    @classmethod
    def attach(cls, url: str, *, api_key: str | None) -> _Http:
        """The client of a server its owner started; refuses one weightsync cannot drive
        safely, naming what to add to its command line."""
        self = cls.__new__(cls)
        server = RemoteServer(url, name="vllm", api_key=api_key)
        self.server = server  # type: ignore[assignment]
        self.base, self._request = self.server.base, self.server.request
        fix = (
            f"start it with VLLM_SERVER_DEV_MODE=1 and VLLM_API_KEY=<key> in its environment and "
            f"`{' '.join(attach_flags())}` on its command line"
        )
        # Not /server_info: it shells out for `pip list`, and fails (500) where the server's
        # venv has no pip and no uv on its PATH.
        info = server.info("/get_world_size?include_dp=false", key_name="its VLLM_API_KEY", fix=fix)
        status, out = self._request(
            "POST", "/collective_rpc", {"method": "weightsync_extension"}, timeout=120
        )
        extensions = out.get("results") if status == 200 and isinstance(out, dict) else None
        if not extensions or any(e != EXTENSION for e in extensions):
            raise ValueError(
                f"vllm server at {url} runs no weightsync worker extension (/collective_rpc "
                f"weightsync_extension answered {status}: {str(out)[:300]}): {fix}"
            )
        status, models = self._request("GET", "/v1/models")
        if status != 200:
            raise RuntimeError(f"vllm server at {url}: /v1/models answered {status}: {models}")
        self.model = str(models["data"][0]["id"])  # the name it serves, --served-model-name's
        self.tp_size = int(info["world_size"])
        return self

    def __init__(self, model_path: str, args: dict[str, Any], *, api_key: str) -> None:
        self.model = model_path
        self.tp_size = int(args.get("tensor_parallel_size", 1))
        # Scale-out serves /inference/v1/generate, whose answers carry the weight version of
        # every token (the version `set_version` gave, changed only while generation is paused).
        args = {"enable_scale_out": True, **args}
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_path,
            "--worker-extension-cls",
            EXTENSION,
            "--middleware",
            GUARD,
            *cli_flags(args),
        ]
        self.server = LocalServer(
            cmd,
            name="vllm",
            api_key=api_key,
            env={"VLLM_SERVER_DEV_MODE": "1", KEY_VARIABLE: api_key},
        )
        self.base = self.server.base
        self._request = self.server.request

    def rpc(self, method: str, args: tuple) -> list[dict]:
        status, out = self._request(
            "POST", "/collective_rpc", {"method": method, "args": list(args)}
        )
        if status != 200:
            raise RuntimeError(f"vllm server /collective_rpc {method} answered {status}: {out}")
        return out["results"]

    def reset_prefix_cache(self) -> bool:
        return reset_prefix_cache(self._request)

    def set_version(self, version: str) -> None:
        self._request("POST", "/update_weight_version", {"new_version": version})

    def switch(self, version: str, revert: bool = False) -> tuple[list[dict], dict[str, Any]]:
        """A staged update's end, or with `revert` the previous weights put back, in one
        request to the server (backends/vllm/guard.py `switch`): (each worker's raw answer,
        how long the server held its scheduler: its `PauseClock` report)."""
        body = {"version": version, "revert": True} if revert else {"version": version}
        status, out = self._request("POST", SWITCH_PATH, body)
        if (
            isinstance(out, dict)
            and "results" not in out
            and "nothing was switched" in str(out.get("error"))
        ):
            raise NothingSwitched(f"vllm server {SWITCH_PATH}: {out['error']}")
        if status != 200 or not isinstance(out, dict) or "results" not in out:
            raise RuntimeError(f"vllm server {SWITCH_PATH} answered {status}: {out}")
        return out["results"], {k: out.get(k) for k in ("pause_s", "pause_parts", "undone")}

    def pause(self) -> None:
        # weightsync's gate holds new requests and waits for those in flight to finish on the
        # old weights (each response is computed with one version); only a request carrying
        # this update's token passes until `resume`: the probe's (`score`).
        self._token = close_gate(self._request, "vllm")

    def resume(self, refuse: str | None = None) -> None:
        """Generation goes on; `refuse` (why the engine does not serve): the server answers its
        clients 503 with it until the next resume."""
        open_gate(self._request, "vllm", refuse=refuse)

    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """`_InProcess.score` through the server, past its closed gate (`pause`'s token)."""
        status, out = self._request(
            "POST",
            "/v1/completions",
            {
                "model": self.model,
                "prompt": prompts,
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            },
            headers={"X-Weightsync-Probe": self._token},
        )
        if status != 200 or not isinstance(out, dict):
            raise RuntimeError(f"vllm server /v1/completions (the probe) answered {status}: {out}")
        scores = []
        for prompt, choice in zip(prompts, sorted(out["choices"], key=lambda c: c["index"])):
            steps = choice.get("prompt_logprobs") or []
            scores.append(
                [float(step[str(t)]["logprob"]) for step, t in zip(steps[1:], prompt[1:])]
            )
        return scores

    def generate(
        self, prompts: list[list[int]], options: SamplingOptions, probe: bool = False
    ) -> list[Sample]:
        """`_InProcess.generate` through the server; with `probe`, past its closed gate (the
        probe's decode steps)."""
        status, out = self._request(
            "POST",
            "/v1/completions",
            {
                "model": self.model,
                "prompt": prompts,
                **_vllm_sampling(options),
                "return_tokens_as_token_ids": True,
            },
            headers={"X-Weightsync-Probe": self._token} if probe else None,
        )
        if status != 200:
            raise RuntimeError(f"vllm server /v1/completions answered {status}: {out}")
        samples = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            logprobs = choice["logprobs"]
            top = None
            if options.top_logprobs:
                # {"token_id:N": logprob} per position; the sampled token may be one more.
                top = [
                    sorted(
                        ((_token_id(t), float(lp)) for t, lp in step.items()),
                        key=lambda pair: -pair[1],
                    )[: options.top_logprobs]
                    for step in logprobs["top_logprobs"]
                ]
            samples.append(
                Sample(
                    tokens=[_token_id(t) for t in logprobs["tokens"]],
                    logprobs=[float(x) for x in logprobs["token_logprobs"]],
                    finish_reason=str(choice["finish_reason"]),
                    top_logprobs=top,
                )
            )
        return samples

    def shutdown(self) -> None:
        self.server.shutdown()


class VllmEngineActor(EngineSession):
    """A Ray actor (env "vllm"/"vllm-cpu") holding one vLLM engine. Order: see WeightReceiver.

    Or a plain object inside a framework's own actor, wrapping the `vllm.LLM` the framework
    made with weightsync's extension (`llm=`; the framework's actor forwards the trainer's calls
    to it: `RayEndpoint(handle, name=..., dispatch=...)`); it leaves that engine running.

    `dtype` defaults to the checkpoint's (`_checkpoint_dtype`), `max_model_len` to vLLM's
    reading of the model's config (max_position_embeddings); `engine_args` go to vLLM as they
    are and win over both."""

    engine_name = "vllm"

    def __init__(
        self,
        model_path: str | None = None,
        *,
        url: str | None = None,
        llm: Any = None,
        mode: str = "engine",
        dtype: str | None = None,
        max_model_len: int | None = None,
        api_key: str | None = None,
        tensor_parallel_size: int = 1,
        engine_args: dict[str, Any] | None = None,
        idle_timeout_s: float = 60.0,
        keep_previous: bool = False,
    ) -> None:
        if mode not in ("engine", "http"):
            raise ValueError(f"mode={mode!r}: expected 'engine' or 'http'")
        super().__init__(idle_timeout_s=idle_timeout_s)
        self.keep_previous = keep_previous
        self._api_key: str | None = None
        if llm is not None:
            # A framework's own in-process engine: this object lives in the framework's actor,
            # which hands it the trainer's calls (`RayEndpoint(..., dispatch=...)`).
            if url is not None or model_path is not None or engine_args or mode != "engine":
                raise ValueError(
                    "llm= wraps an engine its owner made, whose own arguments decide its model "
                    "and shape; leave out model_path, url, mode and engine_args"
                )
            self.client: _InProcess | _Http = _InProcess.of(llm)
            self.mode, self.tp_size = "engine", self.client.tp_size
            return
        if url is not None:
            shaping = {
                "model_path": model_path,
                "dtype": dtype,
                "max_model_len": max_model_len,
                "engine_args": engine_args,
            }
            given = [k for k, v in shaping.items() if v is not None]
            if given or tensor_parallel_size != 1:
                raise ValueError(
                    f"url={url!r} attaches to a running server, whose own command line decides "
                    f"its model and shape; leave out {', '.join(given) or 'tensor_parallel_size'}"
                )
            self.mode, self._api_key = "http", api_key
            self.client = _Http.attach(url, api_key=api_key)
            self.tp_size = self.client.tp_size
            return
        if model_path is None:
            raise ValueError("VllmEngineActor needs model_path (an engine to start) or url=")
        refuse_unsupported_vllm(
            model_path, tensor_parallel_size=tensor_parallel_size, engine_args=engine_args
        )
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        args: dict[str, Any] = {
            "dtype": dtype or _checkpoint_dtype(model_path),
            # Compiling the model (vLLM's default) would add minutes to each start on a CPU.
            "enforce_eager": True,
            **(engine_args or {}),
        }
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if tensor_parallel_size > 1:
            args["tensor_parallel_size"] = tensor_parallel_size
            args.setdefault("distributed_executor_backend", "mp")
            if not cuda_device_present():
                # vLLM on CPU binds each worker's threads to cores it is told of.
                os.environ.setdefault(
                    "VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tensor_parallel_size)
                )
        self.tp_size = tensor_parallel_size
        self.mode = mode
        # keep_previous: copy what each update overwrites, so a failed update is rolled back and
        # the engine goes on serving its previous weights (a copy of the model, during updates).
        if mode == "engine":
            self.client = _InProcess(model_path, args)
        else:
            # An HTTP server always demands a key: the caller's, or a random one this actor
            # keeps (`server_api_key`) and sends with its own requests.
            self._api_key = api_key or secrets.token_urlsafe(24)
            self.client = _Http(model_path, args, api_key=self._api_key)

    def _rpc_all(self, method: str, *args: Any) -> list[Any]:
        """Every worker's result, in worker (= TP rank) order, as collective_rpc answers."""
        return unwrap_all(self.client.rpc(method, args))

    def _rpc(self, method: str, *args: Any) -> Any:
        return self._rpc_all(method, *args)[0]

    # ---- WeightReceiver --------------------------------------------------------------------
    def check_refit(self, specs: list[dict], accept: dict[str, str] | None = None) -> dict:
        """Every worker checks (`accept`: backends/vllm/unkept.py); `num_receivers`: the worker
        processes a sync reaches (each joins a collective transport's group)."""
        results = self._rpc_all("weightsync_check", specs, *((accept,) if accept else ()))
        return combine_refit_answers(results, who="worker", tp_size=self.tp_size)

    def _engine_begin(self, one_copy: bool | list[str]) -> str | None:
        self._switching = False
        whys = [
            r["why"]
            for r in self._rpc_all(
                "weightsync_begin", one_copy, self.keep_previous, self._into_copy
            )
            if r["why"]
        ]
        return "; ".join(whys) if whys else None

    def staged_support(self) -> str | None:
        """In-process always; a server only where weightsync's middleware serves the switch
        (an attached server started without it answers 404 there)."""
        if isinstance(self.client, _Http):
            status, _ = self.client._request("POST", SWITCH_PATH, {})
            if status == 404:
                return (
                    f"vllm server at {self.client.base} has no {SWITCH_PATH} route: start it "
                    f"with `{' '.join(attach_flags())}` of this weightsync version"
                )
        return None

    def set_keep_previous(self, on: bool) -> None:
        """Turn keeping (and restoring) the previous weights on or off for later updates."""
        if self._open is not None:
            raise RuntimeError(f"vllm: cannot change keep_previous during update {self._open!r}")
        self.keep_previous = bool(on)

    def _engine_load(self, descriptor: dict) -> LoadReport:
        return LoadReport.from_dict(self._rpc("weightsync_load", descriptor))

    def _engine_p2p_open(
        self, plan: dict, first_worker: int, host: str, port: int, backend: str, timeout_s: float
    ) -> str | None:
        whys = [
            r["why"]
            for r in self._rpc_all(
                "weightsync_p2p_open", plan, first_worker, host, port, backend, timeout_s
            )
            if r["why"]
        ]
        return "; ".join(whys) if whys else None

    def _engine_p2p_receive(self) -> LoadReport:
        reports = [LoadReport.from_dict(r) for r in self._rpc_all("weightsync_p2p_receive")]
        return LoadReport(
            num_tensors=sum(r.num_tensors for r in reports),
            nbytes=sum(r.nbytes for r in reports),
            seconds=max(r.seconds for r in reports),
        )

    def _engine_end(self, version: str) -> EndReport:
        if self._into_copy:
            return self._switch(version)
        # Still paused, before the update is committed: no answer after it may reuse KV cache
        # computed under the previous weights, and a reset that fails fails the update (the
        # sender aborts it: rolled back with keep_previous).
        if not self.client.reset_prefix_cache():
            raise RuntimeError(
                f"vllm: the prefix cache could not be reset for update {version!r} (blocks still "
                f"held after 5 tries); the update fails rather than serve cache of old weights"
            )
        results = self._rpc_all("weightsync_end")
        self.client.set_version(version)
        # Where each worker's loader puts each tensor (slices at TP > 1), for verification.
        placements = [r["placements"] for r in results]
        return EndReport(
            weight_version=version,
            cache_flushed=True,
            param_of=results[0]["param_of"],
            placements=as_plain(placements),
        )

    def _switch(self, version: str) -> EndReport:
        """A staged update's end: generation held where it is, the prefix cache reset (the
        requests in flight pre-empted: each goes on from its tokens so far, computed again on
        the new weights), every worker's parameters switched to the staged copy, the version
        tag set (the tokens after the pause carry it), generation released."""
        self._switching = True  # from now on the served weights may have changed
        try:
            raw, timing = self.client.switch(version)
        except NothingSwitched as exc:
            self._switching = False
            raise RuntimeError(f"vllm: staged update {version!r}: {exc}") from exc
        except RuntimeError as exc:
            raise RuntimeError(f"vllm: staged update {version!r}: {exc}") from exc
        if timing.get("undone"):  # a worker failed; those that switched were switched back
            self._switching = False  # every worker serves the previous weights: it serves on
            try:
                unwrap_all(raw)
            except Exception as exc:
                failed = [i for i, r in enumerate(raw) if not r.get("ok")]
                raise RuntimeError(
                    f"vllm: staged update {version!r}: the switch failed on engine worker(s) "
                    f"{failed} of {len(raw)}; the workers that switched were switched back "
                    f"(keep_previous), so every worker serves the previous weights: "
                    f"{str(exc).splitlines()[0][:300]}"
                ) from exc
        results = unwrap_all(raw)  # a worker that failed to switch fails the update
        return EndReport(
            weight_version=version,
            cache_flushed=True,
            param_of=results[0]["param_of"],
            placements=as_plain([r["placements"] for r in results]),
            switched_at=max(r["switched_at"] for r in results),
            pause_s=float(timing["pause_s"]),
            pause_parts=timing["pause_parts"],
        )

    def _engine_swaps(self) -> bool:
        return self.keep_previous  # its workers' switch swaps (`weightsync_begin`)

    def _engine_revert(self, version: str) -> EndReport:
        try:
            raw, timing = self.client.switch(version, revert=True)
        except NothingSwitched as exc:
            raise NothingSwitched(f"vllm: revert to {version!r}: {exc}") from exc
        if raw and all(not r.get("ok") and r.get("type") == "SwitchUndone" for r in raw):
            # every worker's swap back failed partway and was undone: the engine serves the
            # weights it served before, whole; the revert may be asked again
            raise NothingSwitched(
                f"vllm: revert to {version!r}: it failed partway on every worker and was "
                f"undone, so the engine serves its current weights whole: "
                f"{str(raw[0].get('error', '')).splitlines()[0][:300]}"
            )
        results = unwrap_all(raw)  # a worker that failed to switch back fails the revert
        return EndReport(
            weight_version=version,
            cache_flushed=True,
            switched_at=max(r["switched_at"] for r in results),
            pause_s=float(timing["pause_s"]),
            pause_parts=timing["pause_parts"],
        )

    def _engine_release_staged(self) -> int:
        return sum(int(r["released"]) for r in self._rpc_all("weightsync_release_staged"))

    def probe_support(self, decode: bool = False) -> str | None:
        return None  # in-process, or a server past weightsync's gate (`_Http.score`)

    def _engine_probe(self, tokens: list[list[int]]) -> list[list[float]]:
        # The staged weights as the model computes with them (experts packed, layers reading
        # their parameters), the previous ones still kept for a rollback; a staged update's
        # switch did that already (the probe comes after it: `EngineSession._probe_switched`).
        if not self._into_copy:
            self._rpc_all("weightsync_finish")
        return self.client.score(tokens)

    def _engine_probe_decode(self, tokens: list[list[int]], steps: int) -> list[Decoded]:
        return as_decoded(self.client.generate(tokens, probe_decoding(steps), probe=True))

    def _engine_abort(self, reason: str) -> bool:
        if self._into_copy:  # the served weights were not written before the switch
            try:
                self._rpc_all("weightsync_discard")
            except Exception as exc:  # the engine itself may be what failed
                logger.warning("vllm: dropping staged update %r failed: %s", self._open, exc)
            # A switch that failed, or whose answer was lost, may have left workers on two
            # versions: refuse to serve until a sync completes.
            return self._switching
        # Loading is in place: weights are mixed once a bucket was loaded, unless every worker
        # put back what it had kept.
        restored = False
        if self.keep_previous and self._loaded:
            try:
                restored = all(r["restored"] >= 0 for r in self._rpc_all("weightsync_rollback"))
            except Exception as exc:  # the engine itself may be what failed
                logger.warning("vllm: rolling back update %r failed: %s", self._open, exc)
        if self._loaded:
            # A probe may have cached KV of the aborted weights (a restored engine serves on).
            try:
                reset = self.client.reset_prefix_cache()
            except Exception as exc:  # the engine itself may be what failed
                logger.warning("vllm: resetting the prefix cache after an abort failed: %s", exc)
                reset = False
            if not reset:
                restored = False  # it refuses to serve rather than serve stale cache
        return self._loaded > 0 and not restored

    def fingerprints(self) -> dict[str, list[int]]:
        """Worker 0's parameters (all of them at TP=1); `worker_fingerprints` for each."""
        return as_plain(self._rpc("weightsync_fingerprints"))

    def worker_fingerprints(self) -> list[dict[str, list[int]]]:
        """Each worker's parameters, in TP-rank order: at TP > 1 each holds its slices."""
        return as_plain(self._rpc_all("weightsync_fingerprints"))

    def _engine_stage(self) -> StageReport:
        """Each worker's fingerprints and placements inside the open update, and the tensor
        -> parameter map vLLM's loader showed while loading."""
        results = as_plain(self._rpc_all("weightsync_stage"))
        return StageReport(
            fingerprints=[r["fingerprints"] for r in results],
            placements=[r["placements"] for r in results],
            param_of=results[0]["param_of"],
        )

    def _engine_prepare(self) -> None:
        self._rpc_all("weightsync_prepare")  # each worker plans its switch's copies

    def _engine_share(self) -> dict:
        """At TP > 1, {"shared": [each worker's shared parameters]} or none of them."""
        answers = [ShareAnswer.from_dict(a) for a in self._rpc_all("weightsync_share")]
        return as_plain(combine_worker_shares(answers).to_dict())

    def _pause(self) -> bool:
        if not isinstance(self.client, _Http):
            return False  # in-process, this actor is the only client and refuses during updates
        self.client.pause()
        return True

    def _resume(self) -> None:
        if isinstance(self.client, _Http):  # only a server pauses (`_pause`)
            # An update aborted with the weights partly written: the server's own clients are
            # refused too, until a sync completes.
            self.client.resume(refuse=self._broken)

    def _refuse(self, reason: str | None) -> None:
        if isinstance(self.client, _Http):
            self.client.resume(refuse=reason)  # the gate is open: it refuses from now on

    def settle(self, timeout_s: float = 120.0) -> dict:
        """On CPU the packed GEMMs are rebuilt in the background after an update."""
        result = self._rpc("weightsync_repacked", timeout_s)
        if result["error"]:
            raise RuntimeError(f"vllm: re-packing GEMM weights failed: {result['error']}")
        return SettleReport(background_s=result["repack_s"]).to_dict()

    # ---- serving -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], **sampling: Any) -> dict[str, Any]:
        """{"tokens", "logprobs", "finish_reasons", "weight_version"} (and "top_logprobs" when
        asked): `n` samples per prompt, grouped by prompt (keywords and answer:
        `weightsync.engine.sampling`). Log-probabilities are vLLM's default (raw logits: before
        temperature and top-p)."""
        options = SamplingOptions(**sampling)
        if isinstance(self.client, _Http):  # the server runs updates between its steps
            self.check_serving()
            samples = self.client.generate(prompts, options)
        else:  # in-process: one engine call at a time, weightsync's or this
            with self.serving():
                samples = self.client.generate(prompts, options)
        return generate_answer(samples, weight_version=self._version, options=options)

    def native_reload(self, checkpoint_dir: str) -> float:
        """Seconds for vLLM's own reload_weights from a checkpoint directory."""
        if not isinstance(self.client, _InProcess):
            raise ValueError(
                f"vllm: native_reload needs the in-process engine (mode='engine'), not "
                f"mode={self.mode!r}"
            )
        start = time.perf_counter()
        self.client.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
        seconds = time.perf_counter() - start
        self._rpc_all("weightsync_discard")  # a staged copy no longer equals the served weights
        return seconds

    def process_stats(self) -> dict[str, int]:
        """File descriptors and memory of this actor and the engine processes it started."""
        from weightsync.driver.procstats import process_tree_stats

        return process_tree_stats()

    def server_api_key(self) -> str | None:
        """The key the HTTP server demands (None in-process), for clients of the server."""
        return self._api_key

    def server_url(self) -> str | None:
        return getattr(self.client, "base", None)

    def shutdown(self) -> None:
        self.client.shutdown()
