"""The SGLang engine actor: a real SGLang engine that generates and receives weights.

Two deliveries, one protocol. `mode="engine"` wraps an in-process `sglang.Engine`; `mode="http"`
starts SGLang's HTTP server on loopback (through backends/sglang/serve.py, which hands it the API
key from its environment) and talks to its HTTP API with that key. Either way each weightsync step is one `update_weights_from_tensor` call whose
load_format is our loader (backends/sglang/loader.py), carrying a JSON control message; the
bytes themselves travel through the core's transport. SGLang's own update session
(begin_weight_update / end_weight_update) wraps every sync when the engine has it.

SGLang's tensor-update request is a pickle (its MultiprocessingSerializer) even over HTTP; ours
carries one empty tensor and a JSON name, and the server is bound to 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from weightsync.backends.sglang.loader import LOADER, read_replies
from weightsync.backends.sglang.serve import FLUSH_TRIES, KEY_VARIABLE, STAGED_PATH, SWITCH_PATH
from weightsync.driver.preflight import read_config, refuse_unsupported_sglang
from weightsync.engine.gate import GATE_PATH, close_gate, open_gate
from weightsync.engine.one_copy.sharing import combine_worker_shares
from weightsync.engine.pause_clock import PauseClock
from weightsync.engine.refit import combine_refit_answers
from weightsync.engine.replica import sharing_of
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
from weightsync.wire.protocol import EndReport, LoadReport, ShareAnswer, StageReport
from weightsync.wire.specs import as_plain, unwrap_all

logger = logging.getLogger(__name__)


CPU_ENGINE_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "mem_fraction_static": 0.1,
    "skip_server_warmup": True,
    # An idle scheduler otherwise polls in a loop and keeps a whole core busy (measured: 101%
    # of one of this machine's two), slowing the trainer and every other process on the host.
    "sleep_on_idle": True,
}


def _checkpoint_dtype(model_path: str) -> str:
    """The dtype the checkpoint's config.json names ("dtype"; "torch_dtype" before transformers
    5), else float32. Not SGLang's "auto": that runs a float32 checkpoint in float16, which a
    float32 trainer's syncs would be refused by."""
    config = read_config(model_path) or {}
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _child_traceback(*, max_lines: int = 14) -> str:
    """The end of the traceback a failed SGLang child logged, read back from this process's
    stderr file (Ray's worker log, which the children inherit); "" if it is not there."""
    try:
        path = os.readlink("/proc/self/fd/2")
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - (256 << 10)))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    start = text.rfind("Scheduler hit an exception:")
    if start < 0:
        return ""
    lines = text[start:].splitlines()
    # The traceback ends where the next log record ("[2026-...") begins.
    end = next((i for i, line in enumerate(lines[1:], 1) if line.startswith("[")), len(lines))
    return "\n".join(lines[max(1, end - max_lines) : end])


_starting_engines = 0


def _on_child_failure(signum: int, frame: Any) -> None:
    """SGLang's SIGQUIT handler in the engine actor (a module function: SGLang pickles it)."""
    from sglang.srt.utils import kill_process_tree

    if not _starting_engines:
        logger.error("an sglang child process failed; ending the engine's processes")
        kill_process_tree(os.getpid())
    raise RuntimeError("an sglang child process failed during start-up (SIGQUIT)")


def _sglang_sampling(options: SamplingOptions, seed: int | None) -> dict[str, Any]:
    """`options` as one request's SGLang sampling_params, with this sample's `seed`."""
    params: dict[str, Any] = {
        "max_new_tokens": options.max_new_tokens,
        "min_new_tokens": options.min_new_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k or -1,  # -1: every token, in SGLang's terms
        "min_p": options.min_p,
        "repetition_penalty": options.repetition_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "ignore_eos": options.ignore_eos,
    }
    if options.stop:
        params["stop"] = list(options.stop)
    if options.stop_token_ids:
        params["stop_token_ids"] = list(options.stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def _samples(outs: list[dict], options: SamplingOptions) -> list[Sample]:
    """SGLang's answers to `generate` (one per sample) as `Sample`s."""
    samples = []
    for out in outs:
        meta = out["meta_info"]
        pairs = meta["output_token_logprobs"]  # (logprob, token id, text) per token
        samples.append(
            Sample(
                tokens=[int(p[1]) for p in pairs],
                logprobs=[float(p[0]) for p in pairs],
                finish_reason=str((meta.get("finish_reason") or {}).get("type")),
                top_logprobs=[
                    [(int(t[1]), float(t[0])) for t in step] for step in meta["output_top_logprobs"]
                ]
                if options.top_logprobs
                else None,
            )
        )
    return samples


class _InProcess:
    def __init__(self, model_path: str, engine_args: dict[str, Any]) -> None:
        import signal

        import sglang
        from sglang.srt.utils import kill_process_tree

        global _starting_engines
        # A child that fails sends this process SIGQUIT. SGLang's own handler then kills the
        # whole process tree, this actor included, and its caller learns nothing (Ray: "The
        # actor never ran"). During start-up raise instead, so the error reaches the caller.
        _starting_engines += 1
        before = signal.getsignal(signal.SIGQUIT)
        try:
            self.engine = sglang.Engine(
                model_path=model_path, custom_sigquit_handler=_on_child_failure, **engine_args
            )
        except Exception as exc:
            kill_process_tree(os.getpid(), include_parent=False)
            signal.signal(signal.SIGQUIT, before)
            child = _child_traceback()
            raise RuntimeError(
                f"sglang engine for {model_path!r} failed to start: {type(exc).__name__}: {exc}"
                + (f"\nits scheduler raised:\n{child}" if child else "")
            ) from exc
        finally:
            _starting_engines -= 1
        self.owned = True
        self.tp_size = int(engine_args.get("tp_size") or 1)

    @classmethod
    def of(cls, engine: Any) -> _InProcess:
        """The client of an `sglang.Engine` its owner made (with weightsync's loader); refuses
        one made without it, naming the argument to add."""
        loaders = list(engine.server_args.custom_weight_loader or [])
        if LOADER not in loaders:
            raise ValueError(
                f"sglang.Engine runs custom weight loaders {loaders}, not weightsync's: make it "
                f"with sglang.Engine(..., custom_weight_loader=[{LOADER!r}])"
            )
        self = cls.__new__(cls)
        self.engine, self.owned = engine, False
        self.tp_size = int(engine.server_args.tp_size or 1)
        return self

    def has_session(self) -> bool:
        return hasattr(self.engine, "begin_weight_update")

    def begin(self) -> tuple[bool, str]:
        return self.engine.begin_weight_update()

    def end(self) -> tuple[bool, str]:
        return self.engine.end_weight_update()

    def update(self, message: str, *, weight_version: str | None) -> tuple[bool, str]:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize([(message, torch.empty(0))])
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * self.engine.server_args.tp_size,
            load_format=LOADER,
            flush_cache=False,
            weight_version=weight_version,
        )
        tm = self.engine.tokenizer_manager
        result = self.engine.loop.run_until_complete(tm.update_weights_from_tensor(req, None))
        if isinstance(result, tuple):
            return bool(result[0]), str(result[1])
        return result.success, result.message

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache().success)

    def staged(self, op: str, message: str | None = None) -> tuple[bool, str]:
        """A staged update's call (`_Http.staged`); this actor is the engine's only client and
        runs one call at a time, so SGLang's own calls wait for nothing."""
        if op == "update":
            return self.update(str(message), weight_version=None)
        return self.begin() if op == "begin" else self.end()

    def staged_support(self) -> str | None:
        return None

    def switch(
        self, message: str, version: str, *, session: bool = False
    ) -> tuple[bool, dict[str, Any]]:
        """A staged update's end (`serve.switch`), nothing to hold: (every scheduler switched,
        its `PauseClock` report). The loader's "revert" message: the last swapping switch
        undone the same way, in an update session of its own with `session`."""
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        revert = json.loads(message)["op"] == "revert"
        clock = PauseClock()
        if not any(self.flush_cache() for _ in range(FLUSH_TRIES)):
            raise NothingSwitched("the cache could not be flushed; nothing was switched")
        clock.mark("cache")
        if revert and session:
            began, text = self.begin()
            if not began:
                raise NothingSwitched(
                    f"the update session did not begin ({text}); nothing was switched"
                )
        done, _ = self.update(message, weight_version=None)
        replies = read_replies(json.loads(message)["reply"]) if done else []
        ok = len(replies) == self.tp_size and all(r.get("ok") for r in replies)
        if session or not revert:
            self.end()
        clock.mark("switch")
        if ok:
            tm = self.engine.tokenizer_manager
            self.engine.loop.run_until_complete(
                tm.update_weight_version(
                    UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
                )
            )
        clock.mark("version")
        return ok, clock.report()

    def generate(
        self,
        input_ids: list[list[int]],
        sampling: list[dict[str, Any]],
        *,
        top_logprobs: int,
        probe: bool = False,
    ) -> list[dict]:
        return self.engine.generate(
            input_ids=input_ids,
            sampling_params=sampling,
            return_logprob=True,
            **({"top_logprobs_num": top_logprobs} if top_logprobs else {}),
        )

    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """Per prompt, SGLang's log-probability of each token after the first given the ones
        before it (input log-probs from position 0: one forward over the prompt, every
        scheduler taking part)."""
        outs = self.engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
        )
        scores = []
        for out in outs:
            steps = out["meta_info"]["input_token_logprobs"]  # (logprob, id, text); first None
            scores.append([float(step[0]) for step in steps[1:]])
        return scores

    def weight_version(self) -> str | None:
        return self.engine.get_model_info().get("weight_version")

    def shutdown(self) -> None:
        if self.owned:  # an engine its owner made stays theirs
            self.engine.shutdown()


def attach_flags() -> list[str]:
    """What a framework's own `python -m sglang.launch_server ...` needs for weightsync to attach
    to it, beside its `--api-key=<key>`."""
    return ["--custom-weight-loader", LOADER]


class _Http:
    gated = False  # weightsync's gate in the server (`pause`, `score`)
    _token = ""  # the open update's: the one request the closed gate lets pass

    @classmethod
    def attach(cls, url: str, *, api_key: str | None) -> _Http:
        """The client of a server its owner started; refuses one weightsync cannot drive
        safely, naming what to add to its command line."""
        self = cls.__new__(cls)
        server = RemoteServer(url, name="sglang", api_key=api_key)
        self.server = server  # type: ignore[assignment]
        self.base, self._request = self.server.base, self.server.request
        fix = f"start it with `{' '.join(attach_flags())} --api-key=<key>`"
        info = server.info("/server_info", key_name="its --api-key", fix=fix)
        loaders = info.get("custom_weight_loader") or []
        if LOADER not in loaders:
            raise ValueError(
                f"sglang server at {url} runs custom weight loaders {loaders}, not weightsync's: "
                f"{fix}"
            )
        self.tp_size = int(info.get("tp_size") or 1)
        # weightsync's gate runs in servers started through weightsync.backends.sglang.serve.
        self.gated = self._request("POST", GATE_PATH, {"close": False})[0] == 200
        return self

    def __init__(
        self, model_path: str, engine_args: dict[str, Any], *, api_key: str | None
    ) -> None:
        # The key travels in the server's environment: a command line is readable by every user.
        cmd = [
            sys.executable,
            "-m",
            "weightsync.backends.sglang.serve",
            "--model-path",
            model_path,
            "--custom-weight-loader",
            LOADER,
            *cli_flags(engine_args),
        ]
        self.server = LocalServer(
            cmd, name="sglang", api_key=api_key, env={KEY_VARIABLE: api_key} if api_key else None
        )
        self.tp_size = int(engine_args.get("tp_size") or 1)
        self.base = self.server.base
        self._request = self.server.request
        self.gated = True  # weightsync.backends.sglang.serve runs the gate

    def _ok(self, path: str, body: Any) -> tuple[bool, str]:
        status, out = self._request("POST", path, body)
        if status == 404:
            return False, "404"
        if isinstance(out, dict):
            return bool(out.get("success", status == 200)), str(out.get("message", ""))
        return status == 200, str(out)

    def has_session(self) -> bool:
        # An older server answers 404 for the session endpoints.
        status, _ = self._request("POST", "/end_weight_update", {})
        return status != 404

    def begin(self) -> tuple[bool, str]:
        return self._ok("/begin_weight_update", {"selector": "all"})

    def end(self) -> tuple[bool, str]:
        return self._ok("/end_weight_update", {})

    def update(self, message: str, *, weight_version: str | None) -> tuple[bool, str]:
        import base64

        from sglang.srt.utils import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize([(message, torch.empty(0))], output_str=True)
        if isinstance(payload, bytes):
            payload = base64.b64encode(payload).decode()
        return self._ok(
            "/update_weights_from_tensor",
            {
                # One payload per TP rank: each scheduler takes serialized_named_tensors[tp_rank].
                "serialized_named_tensors": [payload] * self.tp_size,
                "load_format": LOADER,
                "flush_cache": False,
                "weight_version": weight_version,
            },
        )

    def flush_cache(self) -> bool:
        return self._request("POST", "/flush_cache")[0] == 200

    def staged(self, op: str, message: str | None = None) -> tuple[bool, str]:
        """A staged update's call through weightsync's route (backends/sglang/serve.py
        `STAGED_PATH`), which does not wait for the requests in flight as SGLang's own do."""
        return self._ok(STAGED_PATH, {"op": op, "message": message})

    def staged_support(self) -> str | None:
        status, out = self._request("POST", STAGED_PATH, {})
        if status not in (400, 404):  # 400: the route, refusing a call without an op
            return f"sglang server at {self.base}: {STAGED_PATH} answered {status}: {out}"
        if status == 404:
            return (
                f"sglang server at {self.base} has no {STAGED_PATH} route (weightsync's, in "
                f"servers started with `python -m weightsync.backends.sglang.serve`): its own "
                f"update calls wait for every request in flight, so it cannot stage an update "
                f"while it serves"
            )
        return None

    def switch(
        self, message: str, version: str, *, session: bool = False
    ) -> tuple[bool, dict[str, Any]]:
        """A staged update's end, in one request to the server (backends/sglang/serve.py
        `switch`): (every scheduler switched, how long the server paused generation: its
        `PauseClock` report). The loader's "revert" message: the last swapping switch undone,
        in an update session of its own with `session`."""
        body = {"message": message, "version": version, "session": session}
        status, out = self._request("POST", SWITCH_PATH, body)
        if (
            status == 500
            and isinstance(out, dict)
            and "nothing was switched" in str(out.get("error"))
        ):
            raise NothingSwitched(f"sglang server {SWITCH_PATH}: {out['error']}")
        if status != 200 or not isinstance(out, dict):
            raise RuntimeError(f"sglang server {SWITCH_PATH} answered {status}: {out}")
        return bool(out["ok"]), {k: out[k] for k in ("pause_s", "pause_parts")}

    def pause(self) -> None:
        if self.gated:
            # weightsync's gate holds new requests and waits for those in flight to finish on
            # the old weights; only a request carrying this update's token passes until
            # `resume`: the probe's (`score`).
            self._token = close_gate(self._request, "sglang")
            return
        # "abort" ends every request in flight and holds new ones until /continue_generation;
        # "retract" and "in_place" would finish old requests on the new weights, mixing two
        # versions inside one response.
        status, out = self._request("POST", "/pause_generation", {"mode": "abort"})
        if status != 200:
            raise RuntimeError(f"sglang server /pause_generation answered {status}: {out}")

    def resume(self, refuse: str | None = None) -> None:
        """Generation goes on; `refuse` (why the engine does not serve): a gated server answers
        its clients 503 with it until the next resume (a server without the gate cannot)."""
        if self.gated:
            open_gate(self._request, "sglang", refuse=refuse)
            return
        status, out = self._request("POST", "/continue_generation", {})
        if status != 200:
            raise RuntimeError(f"sglang server /continue_generation answered {status}: {out}")

    def refuse(self, reason: str | None) -> None:
        """A gated server answers its clients 503 with `reason` until the next resume (one
        without the gate cannot); None: it serves them again."""
        if self.gated:
            open_gate(self._request, "sglang", refuse=reason)

    def score(self, prompts: list[list[int]]) -> list[list[float]]:
        """`_InProcess.score` through the server, past its closed gate (`pause`'s token)."""
        status, out = self._request(
            "POST",
            "/generate",
            {
                "input_ids": prompts,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            headers={"X-Weightsync-Probe": self._token},
        )
        if status != 200 or not isinstance(out, list):
            raise RuntimeError(f"sglang server /generate (the probe) answered {status}: {out}")
        return [
            [float(step[0]) for step in o["meta_info"]["input_token_logprobs"][1:]] for o in out
        ]

    def generate(
        self,
        input_ids: list[list[int]],
        sampling: list[dict[str, Any]],
        *,
        top_logprobs: int,
        probe: bool = False,
    ) -> list[dict]:
        """`_InProcess.generate` through the server; with `probe`, past its closed gate (the
        probe's decode steps)."""
        status, out = self._request(
            "POST",
            "/generate",
            {
                "input_ids": input_ids,
                "sampling_params": sampling,
                "return_logprob": True,
                **({"top_logprobs_num": top_logprobs} if top_logprobs else {}),
            },
            headers={"X-Weightsync-Probe": self._token} if probe else None,
        )
        if status != 200:
            raise RuntimeError(f"sglang server /generate answered {status}: {out}")
        return out

    def weight_version(self) -> str | None:
        status, out = self._request("GET", "/model_info")
        return out.get("weight_version") if status == 200 and isinstance(out, dict) else None

    def shutdown(self) -> None:
        self.server.shutdown()


class SglEngineActor(EngineSession):
    """A Ray actor (env "sglang") holding one SGLang engine. See WeightReceiver for the order.

    `dtype` defaults to the checkpoint's (`_checkpoint_dtype`), the context length to SGLang's
    reading of the model's config (max_position_embeddings); on a CPU `CPU_ENGINE_ARGS` come
    first, and `engine_args` go to SGLang as they are and win over all of these."""

    engine_name = "sglang"
    _api_key: str | None

    def __init__(
        self,
        model_path: str | None = None,
        *,
        url: str | None = None,
        engine: Any = None,
        mode: str = "engine",
        dtype: str | None = None,
        api_key: str | None = None,
        engine_args: dict[str, Any] | None = None,
        idle_timeout_s: float = 60.0,
        keep_previous: bool = False,
    ) -> None:
        if mode not in ("engine", "http"):
            raise ValueError(f"mode={mode!r}: expected 'engine' or 'http'")
        if engine is not None:
            # A framework's own in-process engine: this object lives in the framework's actor,
            # which hands it the trainer's calls (`RayEndpoint(..., dispatch=...)`).
            if url is not None or model_path is not None or engine_args or mode != "engine":
                raise ValueError(
                    "engine= wraps an engine its owner made, whose own arguments decide its "
                    "model and shape; leave out model_path, url, mode and engine_args"
                )
            super().__init__(idle_timeout_s=idle_timeout_s)
            self.mode, self.keep_previous, self._api_key = "engine", keep_previous, None
            self.client: _InProcess | _Http = _InProcess.of(engine)
            self.tp_size = self.client.tp_size
            self._ready()
            return
        if url is not None:
            shaping = {"model_path": model_path, "dtype": dtype, "engine_args": engine_args}
            given = [k for k, v in shaping.items() if v is not None]
            if given:
                raise ValueError(
                    f"url={url!r} attaches to a running server, whose own command line decides "
                    f"its model and shape; leave out {', '.join(given)}"
                )
            super().__init__(idle_timeout_s=idle_timeout_s)
            self.mode, self.keep_previous, self._api_key = "http", keep_previous, api_key
            self.client = _Http.attach(url, api_key=api_key)
            self.tp_size = self.client.tp_size
            self._ready()
            return
        if model_path is None:
            raise ValueError("SglEngineActor needs model_path (an engine to start) or url=")
        refuse_unsupported_sglang(
            model_path, engine_args=engine_args, cuda=torch.cuda.is_available()
        )
        super().__init__(idle_timeout_s=idle_timeout_s)
        args = {
            **(CPU_ENGINE_ARGS if not torch.cuda.is_available() else {}),
            "dtype": dtype or _checkpoint_dtype(model_path),
            **(engine_args or {}),
        }
        self.mode = mode
        self.tp_size = int(args.get("tp_size") or 1)
        # Copy what each update overwrites, so a failed update is rolled back and the engine
        # goes on serving its previous weights (costs a copy of the model, during updates).
        self.keep_previous = keep_previous
        self._api_key = None
        if mode == "engine":
            self.client = _InProcess(model_path, {**args, "custom_weight_loader": [LOADER]})
        else:
            # An HTTP server always demands a key: the caller's, or a random one this actor
            # keeps (`server_api_key`) and sends with its own requests.
            self._api_key = api_key or secrets.token_urlsafe(24)
            self.client = _Http(model_path, args, api_key=self._api_key)
        self._ready()

    def _ready(self) -> None:
        self.sessions = self.client.has_session()
        self._finished = False  # the open update's session ended for its probe (`_engine_probe`)
        self._staging = False  # a staged update is open: its calls go by `client.staged`
        self._model_staged_why: str | None = None  # the schedulers' `staged_support`, once
        # Named like the shared-memory segments, so a sender sweeps it if this actor dies.
        self.reply_dir = tempfile.mkdtemp(prefix=f"weightsync-{os.getpid()}-reply-", dir="/dev/shm")
        logger.info("sglang engine up (%s), update sessions: %s", self.mode, self.sessions)

    # ---- control channel -------------------------------------------------------------------
    def _control(self, op: str, *, weight_version: str | None = None, **fields: Any) -> Any:
        """TP rank 0's reply to one control call (`_control_all` for every scheduler's)."""
        return self._control_all(op, weight_version=weight_version, **fields)[0]

    def _control_all(
        self, op: str, *, weight_version: str | None = None, **fields: Any
    ) -> list[Any]:
        """Every TP scheduler's reply, in TP-rank order: each runs our loader on its payload
        (one per TP rank) and writes its own reply file."""
        message = self._message(op, **fields)
        if self._staging:  # the engine serves on meanwhile
            ok, text = self.client.staged(
                "update", json.dumps({**json.loads(message), "staged": True})
            )
        else:
            ok, text = self.client.update(message, weight_version=weight_version)
        if not ok:
            raise RuntimeError(f"sglang refused the {op} request: {text}")
        return self._replies(op)

    def _message(self, op: str, **fields: Any) -> str:
        """One control message (its replies cleared first)."""
        for name in os.listdir(self.reply_dir):
            os.unlink(os.path.join(self.reply_dir, name))
        return json.dumps({"op": op, "reply": self.reply_dir, **fields})

    def _replies(self, op: str) -> list[Any]:
        """Every scheduler's reply to the last message, in TP-rank order."""
        replies = read_replies(self.reply_dir)
        if not replies:
            raise RuntimeError(
                f"sglang ran no weightsync loader for {op}; is custom_weight_loader={LOADER!r} set?"
            )
        if len(replies) != self.tp_size:
            raise RuntimeError(
                f"sglang: {len(replies)} of {self.tp_size} TP schedulers ran "
                f"the weightsync loader for {op}"
            )
        return sorted(unwrap_all(replies), key=lambda r: r.get("tp_rank", 0))

    def _session(self, op: str, *, needed: bool = True) -> None:
        if not self.sessions:
            return
        if self._staging:
            ok, text = self.client.staged(op)
        else:
            ok, text = self.client.begin() if op == "begin" else self.client.end()
        if not ok and needed:
            raise RuntimeError(f"sglang {op}_weight_update failed: {text}")

    # ---- WeightReceiver --------------------------------------------------------------------
    def _read_only(self, op: str, **fields: Any) -> Any:
        return self._read_only_all(op, **fields)[0]

    def _read_only_all(self, op: str, **fields: Any) -> list[Any]:
        """A control call that writes no weight; SGLang still wants it inside a session."""
        if self._open is not None:
            return self._control_all(op, **fields)
        self._session("begin")
        try:
            return self._control_all(op, **fields)
        finally:
            self._session("end")

    def _engine_release_staged(self) -> int:
        return sum(int(r["released"]) for r in self._read_only_all("release_staged"))

    def check_refit(self, specs: list[dict], accept: dict[str, str] | None = None) -> dict:
        """Every TP scheduler checks (`accept`: backends/sglang/derived.py `refuse`);
        `num_receivers`: how many a sync reaches."""
        answers = self._read_only_all(
            "check", specs=specs, **({"accept": accept} if accept else {})
        )
        return combine_refit_answers(answers, who="scheduler", tp_size=self.tp_size)

    def _engine_begin(self, one_copy: bool | list[str]) -> str | None:
        self._finished = False
        self._staging, self._switching = self._into_copy, False
        if self._staging:
            try:
                self._session("begin")
                answers = self._control_all("begin_staged", swap=self.keep_previous)
                whys = [r["why"] for r in answers if r["why"]]
            except BaseException:
                self._drop_staged()  # nothing was written: nothing stays open
                raise
            if whys:
                self._drop_staged()
                return "; ".join(whys)
            return None
        self._session("begin")
        if one_copy:
            whys = [
                r["why"]
                for r in self._control_all(
                    "begin_one_copy", keep_previous=self.keep_previous, sharing=sharing_of(one_copy)
                )
                if r["why"] is not None
            ]
            if whys:
                self._session("end", needed=False)
                return "; ".join(whys)
        return None

    def _engine_load(self, descriptor: dict) -> LoadReport:
        return LoadReport.from_dict(
            self._control("load", descriptor=descriptor, keep_previous=self.keep_previous)
        )

    def probe_support(self, decode: bool = False) -> str | None:
        if isinstance(self.client, _Http) and not self.client.gated:
            return (
                "sglang: this server runs no weightsync gate, and SGLang's own pause holds every "
                "request during an update, so its forward cannot score a probe on the staged "
                "weights; start it with `python -m weightsync.backends.sglang.serve` (its "
                "launch_server flags), or probe an in-process engine (mode='engine' or engine=)"
            )
        return None

    def _engine_probe(self, tokens: list[list[int]]) -> list[list[float]]:
        why = self.probe_support()
        if why:
            raise RuntimeError(why)
        # The staged weights as the model computes with them: the one-copy writes over and the
        # session ended (SGLang post-processes the weights there), the previous weights still
        # kept for a rollback; no KV cache of the previous weights may serve the probe. A
        # staged update's switch did all that (the probe comes after it:
        # `EngineSession._probe_switched`).
        if self._into_copy:
            return self.client.score(tokens)
        self._control_all("finish", one_copy=self._one_copy)
        self._session("end")
        self._finished = True
        if not self.client.flush_cache():
            raise RuntimeError("sglang: the prefix cache could not be flushed before the probe")
        return self.client.score(tokens)

    def _engine_probe_decode(self, tokens: list[list[int]], steps: int) -> list[Decoded]:
        options = probe_decoding(steps)
        outs = self.client.generate(
            tokens,
            [_sglang_sampling(options, None) for _ in tokens],
            top_logprobs=options.top_logprobs,
            probe=True,
        )
        return as_decoded(_samples(outs, options))

    def _engine_end(self, version: str) -> EndReport:
        if self._staging:
            return self._switch(version)
        if self._finished:  # the probe ended the session: a short one carries the commit
            self._session("begin")
        # The version rides on a last, empty control call, so SGLang's own tag moves too.
        commits = self._control_all(
            "commit", weight_version=version, one_copy=self._one_copy and not self._finished
        )
        self._session("end")
        # Still paused (generation resumes once `end` returns): no answer after this update may
        # reuse KV cache computed under the previous weights, so a flush that fails fails the
        # update (the sender aborts it; the engine then refuses to serve until a later sync).
        if not self.client.flush_cache():
            raise RuntimeError(
                f"sglang: the prefix cache could not be flushed after update {version!r}; the "
                f"update fails rather than serve cache of old weights"
            )
        # Where each scheduler's loader puts each tensor (slices at TP > 1), for verification.
        placements = [c["placements"] for c in commits]
        return EndReport(weight_version=version, cache_flushed=True, placements=placements)

    def staged_support(self) -> str | None:
        """In-process always, a server only where weightsync's routes serve a staged update
        (`python -m weightsync.backends.sglang.serve`); and every scheduler's model must be one
        a staged copy can hold (backends/sglang/loader.py `staged_support`). The model's answer
        is asked once (SGLang's own update calls, which wait for the requests in flight) and
        kept: the model does not change."""
        why = self.client.staged_support()
        if why is None:
            if self._model_staged_why is None:
                whys = [r["why"] for r in self._read_only_all("staged_support") if r["why"]]
                self._model_staged_why = "; ".join(whys)
            why = self._model_staged_why or None
        return why

    def _drop_staged(self) -> None:
        """The open staged update dropped: every scheduler's copy marked stale (made again at
        the next staged update), SGLang's update session ended; each step tried whatever the
        other did."""
        for step in (lambda: self._control_all("discard"), lambda: self._session("end")):
            try:
                step()
            except Exception as exc:  # the engine itself may be what failed
                logger.warning("sglang: dropping staged update %r: %s", self._open, exc)
        self._staging = False

    def _switch(self, version: str) -> EndReport:
        """A staged update's end: generation paused with the requests in flight retracted
        (each computed again from its tokens so far, on the new weights, when generation
        continues), the cache flushed, every scheduler's parameters switched to the staged
        copy, SGLang's update session ended, the version tag set (the tokens after the pause
        carry it) only when every scheduler switched, generation continued."""
        message = self._message("switch")
        self._switching = True  # from now on the served weights may have changed
        try:
            switched, timing = self.client.switch(message, version)
        except NothingSwitched as exc:
            self._switching = False
            raise RuntimeError(f"sglang: staged update {version!r}: {exc}") from exc
        except RuntimeError as exc:
            raise RuntimeError(f"sglang: staged update {version!r}: {exc}") from exc
        replies = read_replies(self.reply_dir)
        if not switched and _all_undone(replies, self.tp_size):
            self._switching = False  # every scheduler serves its previous weights: serve on
            first = replies[0]["error"].splitlines()[0][:400]
            raise RuntimeError(
                f"sglang: staged update {version!r}: the switch failed partway in every "
                f"scheduler and was undone (keep_previous): the previous weights are served "
                f"whole: {first}"
            )
        results = self._replies("switch")  # a scheduler that failed to switch fails the update
        if not switched:
            raise RuntimeError(f"sglang: staged update {version!r}: a scheduler did not switch")
        self._staging = False
        return _switched(version, results, timing)

    def _engine_swaps(self) -> bool:
        return self.keep_previous  # its schedulers' switch swaps (the loader's "begin_staged")

    def _engine_revert(self, version: str) -> EndReport:
        """The last swapping switch undone (the loader's "revert" in every scheduler), in one
        pause as the switch: generation paused with the requests in flight retracted, the
        cache flushed, the version tag set back only when every scheduler switched back."""
        message = self._message("revert")
        try:
            switched, timing = self.client.switch(message, version, session=self.sessions)
        except NothingSwitched as exc:
            raise NothingSwitched(f"sglang: revert to {version!r}: {exc}") from exc
        replies = read_replies(self.reply_dir)
        if not switched and _all_undone(replies, self.tp_size):
            # every scheduler's swap back failed partway and was undone: the engine serves the
            # weights it served before, whole; the revert may be asked again
            raise NothingSwitched(
                f"sglang: revert to {version!r}: it failed partway in every scheduler and was "
                f"undone, so the engine serves its current weights whole: "
                f"{replies[0]['error'].splitlines()[0][:300]}"
            )
        results = self._replies("revert")  # a scheduler that failed to switch back fails it
        if not switched:
            raise RuntimeError(f"sglang: revert to {version!r}: a scheduler did not switch back")
        return _switched(version, results, timing)

    def set_keep_previous(self, on: bool) -> None:
        """Turn keeping (and restoring) the previous weights on or off for later updates."""
        if self._open is not None:
            raise RuntimeError(f"sglang: cannot change keep_previous during update {self._open!r}")
        self.keep_previous = bool(on)

    def _engine_abort(self, reason: str) -> bool:
        if self._staging:  # the served weights were not written before the switch
            self._drop_staged()
            # A switch that failed, or whose answer was lost, may have switched some of the
            # parameters: refuse to serve until a sync completes.
            return self._switching
        restored = False
        finished, self._finished = self._finished, False
        if finished:  # the probe ended the session: the rollback needs one
            self._session("begin", needed=False)
        if self.keep_previous and self._loaded:
            try:
                restored = self._control("rollback")["restored"] >= 0
            except Exception as exc:  # the engine itself may be what failed
                logger.warning("sglang: rolling back update %r failed: %s", self._open, exc)
        self._session("end", needed=False)
        if finished:
            # The probe cached KV of the aborted weights (a restored engine serves on).
            try:
                flushed = self.client.flush_cache()
            except Exception as exc:  # the engine itself may be what failed
                logger.warning("sglang: flushing the prefix cache after an abort failed: %s", exc)
                flushed = False
            if not flushed:
                restored = False  # it refuses to serve rather than serve stale cache
        return bool(self._loaded) and not restored

    def fingerprints(self) -> dict[str, list[int]]:
        """TP rank 0's parameters (all of them at TP=1); `worker_fingerprints` for each."""
        return self._read_only("fingerprints")["fingerprints"]

    def worker_fingerprints(self) -> list[dict[str, list[int]]]:
        return [r["fingerprints"] for r in self._read_only_all("fingerprints")]

    def _engine_stage(self) -> StageReport:
        """Each scheduler's fingerprints and placements, inside the open update."""
        answers = self._control_all("stage")
        return StageReport(
            fingerprints=[a["fingerprints"] for a in answers],
            placements=[a["placements"] for a in answers],
        )

    def _engine_prepare(self) -> None:
        if self._staging:
            self._control_all("prepare")  # each scheduler plans its switch's copies

    def _engine_share(self) -> dict:
        answers = [ShareAnswer.from_dict(a) for a in self._read_only_all("share")]
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
            self.client.refuse(reason)

    # ---- serving -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], **sampling: Any) -> dict[str, Any]:
        """{"tokens", "logprobs", "finish_reasons", "weight_version"} (and "top_logprobs" when
        asked): `n` samples per prompt, grouped by prompt (keywords and answer:
        `weightsync.engine.sampling`). Log-probabilities are SGLang's: of logits / temperature,
        before top-p."""
        options = SamplingOptions(**sampling)
        # One request per sample (not SGLang's `n`): the order of rows is ours, and each sample
        # has its own seed.
        params = [
            _sglang_sampling(options, None if options.seed is None else options.seed + j)
            for _ in prompts
            for j in range(options.n)
        ]
        rows = [p for p in prompts for _ in range(options.n)]
        if isinstance(self.client, _InProcess):  # one engine call at a time, weightsync's or this
            with self.serving():
                outs = self.client.generate(rows, params, top_logprobs=options.top_logprobs)
        else:  # the server runs updates between its steps
            self.check_serving()
            outs = self.client.generate(rows, params, top_logprobs=options.top_logprobs)
        return generate_answer(
            _samples(outs, options),
            weight_version=outs[0]["meta_info"].get("weight_version"),
            options=options,
        )

    # ---- SGLang's own paths, for benchmarks -------------------------------------------------
    def _native_engine(self, what: str) -> Any:
        """The in-process `sglang.Engine`, which SGLang's own update paths (`what`) call."""
        if not isinstance(self.client, _InProcess):
            raise ValueError(
                f"sglang: {what} needs the in-process engine (mode='engine'), not "
                f"mode={self.mode!r}"
            )
        return self.client.engine

    def native_update_from_tensor(self, checkpoint_dir: str) -> float:
        """Seconds for update_weights_from_tensor of the checkpoint's tensors (read into memory
        first, untimed), inside SGLang's update session."""
        from safetensors.torch import load_file

        named = []
        for name in sorted(os.listdir(checkpoint_dir)):
            if name.endswith(".safetensors"):
                named += list(load_file(os.path.join(checkpoint_dir, name)).items())
        engine = self._native_engine("native_update_from_tensor")
        start = time.perf_counter()
        self._session("begin")
        ok, text = engine.update_weights_from_tensor(named, flush_cache=False)
        self._session("end")
        seconds = time.perf_counter() - start
        if not ok:
            raise RuntimeError(f"sglang update_weights_from_tensor failed: {text}")
        return seconds

    def native_update_from_disk(self, checkpoint_dir: str) -> float:
        start = time.perf_counter()
        result = self._native_engine("native_update_from_disk").update_weights_from_disk(
            checkpoint_dir
        )
        seconds = time.perf_counter() - start
        if not result[0]:
            raise RuntimeError(f"sglang update_weights_from_disk failed: {result[1]}")
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

    def engine_weight_version(self) -> str | None:
        return self.client.weight_version()

    def shutdown(self) -> None:
        self.client.shutdown()
        shutil.rmtree(self.reply_dir, ignore_errors=True)


def _all_undone(replies: list[dict[str, Any]], tp_size: int) -> bool:
    """Whether every scheduler answered the switch with `SwitchUndone` (its swap failed
    partway and was swapped back: weightsync/engine/staging.py), so none serves the new
    weights. A scheduler that switched while another failed cannot be switched back here."""
    return len(replies) == tp_size and all(
        not r["ok"] and r.get("type") == "SwitchUndone" for r in replies
    )


def _switched(version: str, results: list[dict], timing: dict[str, Any]) -> EndReport:
    """A switch's or a revert's report from every scheduler's reply and the pause's timing."""
    return EndReport(
        weight_version=version,
        cache_flushed=True,
        placements=[r["placements"] for r in results],
        switched_at=max(r["switched_at"] for r in results),
        pause_s=float(timing["pause_s"]),
        pause_parts=timing["pause_parts"],
    )
