"""A stock SGLang server (nothing of weightsync's in it) synced through SGLang's own reload.

`SglStockEngine(url=...)` attaches to a framework's own `python -m sglang.launch_server`. Each
sync's buckets are staged into a checkpoint on this host (weightsync/engine/stock.py), then one
`/update_weights_from_disk {model_path, weight_version, flush_cache}`: SGLang takes its own
writer lock (requests in flight finish on the old weights, new ones wait), every TP worker loads
the staged checkpoint through SGLang's own loader, the prefix cache is flushed and the version
adopted. Not verified (see the module doc of weightsync/engine/stock.py).

With `--api-key` the server demands the key on every route, its weight routes included; without
one any local user reaching its port can update its weights.
"""

from __future__ import annotations

from weightsync.engine.stock import StockEngine


class SglStockEngine(StockEngine):
    """A Ray actor (env "sglang") on the server's host, syncing a stock SGLang server by
    reloads: `SglStockEngine(url, api_key=..., staging_dir=...)`, `api_key` the server's
    `--api-key` if it has one (`StockEngine`'s arguments)."""

    engine_name = "sglang"

    def _describe(self) -> None:
        info = self._get("/server_info")
        # The startup configuration: the checkpoint it was started from, whatever it reloaded since.
        self.model_path = str(info["model_path"])
        self.tp_size = int(info.get("tp_size") or 1)

    def _reload(self, folder: str, version: str) -> bool:
        self._reloading = True
        status, out = self.server.request(
            "POST",
            "/update_weights_from_disk",
            {"model_path": folder, "weight_version": version, "flush_cache": True},
        )
        if status != 200 or not (isinstance(out, dict) and out.get("success")):
            raise RuntimeError(f"sglang server /update_weights_from_disk answered {status}: {out}")
        return True  # flush_cache: flushed inside the update, or the update failed
