"""Position-sensitive fingerprints, computed the same way on the trainer and inside an engine.

A tensor's bytes are read as signed 16-bit words (unsigned bytes for 1-byte dtypes), in the
tensor's logical (row-major) order: x_0, x_1, ... A fingerprint is three integers:

- `s`: the sum of the words, mod 2**64. One changed element always changes it.
- `h1`, `h2`: polynomial hashes, sum of x_j * r**j mod p, for two primes p just under 2**21 and a
  primitive root r of each. Moving an element moves its weight: a transposed tensor, two swapped
  rows, or q and k swapped inside a fused QKV parameter change them (unless the moved words are
  equal), and two random changes collide with odds of about 2**-42.

All three are exact integers (the same on any device, thread count or torch release) and
combinable over the pieces of a parameter, given where each piece sits: a piece whose words
start at word `o` of the parameter contributes `shift(fingerprint(piece), o)` (the hashes times
r**o), and a parameter's fingerprint is the `combine`d sum of its pieces' contributions. Zero
words (the rows an engine pads a vocabulary with) contribute nothing. Where each trainer tensor
sits in an engine parameter is its placement (weightsync/placement.py), learned from the
engine's own loader; `placed` gives the contribution of a strided run pattern there.

How: words are widened to float64 in rows of at most 2**16 and multiplied by one [row, 3] table
(1, r1**j mod p1, r2**j mod p2) with a BLAS (or cuBLAS) GEMM, one pass over the bytes. Every
product is below 2**36 and every row's sum below 2**52, so float64 holds each exactly, in any
summation order; the rows are then combined with the powers of their start positions in int64.
On a GPU the result stays on the device until read (`fingerprints` reads many tensors' at once).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

MASK = (1 << 64) - 1
PRIMES = (2097143, 2097133)
ROOTS = (1000005, 1000004)  # a primitive root of each prime
_ROW = 1 << 16  # words per GEMM row: keeps every float64 row sum exact (see above)
_BLOCK_WORDS = {"cpu": 1 << 20, "other": 1 << 24}  # float64 scratch per block of rows

Fingerprint = tuple[int, int, int]
Sums = "list[int] | torch.Tensor"  # [s, h1, h2] before it is read back

_local = threading.local()


def _words(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.numel() > 1 and flat.stride(0) != 1:
        flat = flat.contiguous()
    if flat.dtype == torch.bool or flat.element_size() == 1:
        return flat.view(torch.uint8)
    return flat.view(torch.int16)


def words_per_element(dtype: torch.dtype) -> int:
    """How many fingerprint words one element of `dtype` is."""
    size = torch.empty((), dtype=dtype).element_size()
    return 1 if size == 1 else size // 2


def _table(device: torch.device) -> torch.Tensor:
    """[3, _ROW] float64 on `device`: 1, r1**j mod p1, r2**j mod p2 for j < _ROW."""
    tables = getattr(_local, "tables", None)
    if tables is None:
        tables = _local.tables = {}
    if device not in tables:
        cols = [[1] * _ROW]
        for p, r in zip(PRIMES, ROOTS):
            col, v = [], 1
            for _ in range(_ROW):
                col.append(v)
                v = v * r % p
            cols.append(col)
        tables[device] = torch.tensor(cols, dtype=torch.float64).to(device)
    return tables[device]


def _powers(start: int, step: int, count: int, device: torch.device) -> torch.Tensor:
    """[count, 2] int64: r**(start + i * step) mod p for each prime, i < count."""
    out = torch.empty((count, 2), dtype=torch.int64, device=device)
    out[0] = torch.tensor([pow(r, start, p) for p, r in zip(PRIMES, ROOTS)])
    primes = torch.tensor(PRIMES, dtype=torch.int64, device=device)
    n = 1
    while n < count:  # doubling: rows [n, 2n) are rows [0, n) times r**(n * step)
        m = min(n, count - n)
        mult = torch.tensor([pow(r, n * step, p) for p, r in zip(PRIMES, ROOTS)],
                            dtype=torch.int64, device=device)
        out[n:n + m] = out[:m] * mult % primes
        n += m
    return out


def _rows_sums(rows: torch.Tensor, start: int, stride: int) -> Sums:
    """[s, h1, h2] for a [count, n] tensor of words whose row i starts at word
    `start + i * stride` (n <= _ROW): a list on CPU, an int64 tensor on the rows' device."""
    count, n = rows.shape
    device = rows.device
    table = _table(device)[:, :n].t()  # column-major: what the GEMM reads fastest
    block = max(1, _BLOCK_WORDS["cpu" if device.type == "cpu" else "other"] // max(n, 1))
    per_row = []
    for i in range(0, count, block):
        part = rows[i:i + block]
        wide = part.to(torch.float64) if device.type != "cpu" else _scratch(part)
        per_row.append(torch.mm(wide, table))
    sums = (per_row[0] if len(per_row) == 1 else torch.cat(per_row)).to(torch.int64)
    if device.type == "cpu" and count <= 64:  # few rows: cheaper in Python than in kernels
        out = [0, 0, 0]
        for i, (s, h1, h2) in enumerate(sums.tolist()):
            at = start + i * stride
            out[0] += s
            out[1] += h1 * pow(ROOTS[0], at, PRIMES[0])
            out[2] += h2 * pow(ROOTS[1], at, PRIMES[1])
        return [out[0] & MASK, out[1] % PRIMES[0], out[2] % PRIMES[1]]
    primes = torch.tensor(PRIMES, dtype=torch.int64, device=device)
    hashes = sums[:, 1:].remainder(primes)
    weights = _powers(start, stride, count, device)
    placed = (hashes * weights % primes).sum(0) % primes
    return torch.cat([sums[:, 0].sum().reshape(1), placed])


def _scratch(part: torch.Tensor) -> torch.Tensor:
    """`part` widened to float64 in a per-thread buffer reused across calls (CPU)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < part.numel():
        buf = _local.scratch = torch.empty(max(part.numel(), 1 << 16), dtype=torch.float64)
    wide = buf[:part.numel()].view(part.shape)
    wide.copy_(part)
    return wide


def _add(total: Sums | None, part: Sums) -> Sums:
    if total is None:
        return part
    if isinstance(total, list) and isinstance(part, list):
        return [(total[0] + part[0]) & MASK, (total[1] + part[1]) % PRIMES[0],
                (total[2] + part[2]) % PRIMES[1]]
    device = part.device if isinstance(part, torch.Tensor) else total.device
    a, b = (torch.as_tensor(x, dtype=torch.int64, device=device)
            if isinstance(x, torch.Tensor) else torch.tensor(_signed(x), device=device)
            for x in (total, part))
    out = a + b
    out[1:] = out[1:].remainder(torch.tensor(PRIMES, dtype=torch.int64, device=device))
    return out


def _signed(sums: list[int]) -> list[int]:
    """A list's s as the int64 a tensor holds (two's complement)."""
    return [sums[0] - (1 << 64) if sums[0] >= 1 << 63 else sums[0], sums[1], sums[2]]


def _placed_sums(rows: torch.Tensor, start: int, stride: int) -> Sums:
    """`_rows_sums` for rows of any length (split into columns of at most _ROW words)."""
    total = None
    for col in range(0, rows.shape[1], _ROW):
        total = _add(total, _rows_sums(rows[:, col:col + _ROW], start + col, stride))
    return total


def _device_sums(tensor: torch.Tensor) -> Sums:
    """[s, h1, h2] of a tensor (s wrapping mod 2**64, as the result does): a list on CPU,
    an int64 tensor on another device."""
    words = _words(tensor)
    n = words.numel()
    full = n - n % _ROW
    total = None
    if full:
        total = _rows_sums(words[:full].view(-1, _ROW), 0, _ROW)
    if n > full:
        total = _add(total, _rows_sums(words[full:].view(1, -1), full, 0))
    return total


def _to_print(sums: Sums) -> Fingerprint:
    if isinstance(sums, torch.Tensor):
        sums = sums.tolist()
    return (sums[0] & MASK, sums[1], sums[2])


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """(s, h1, h2) of a tensor whose first word is word 0 (see the module doc)."""
    if tensor.numel() == 0:
        return (0, 0, 0)
    return _to_print(_device_sums(tensor))


def fingerprints(tensors: list[torch.Tensor]) -> list[Fingerprint]:
    """`fingerprint` of each tensor. GPU tensors are reduced on their device without a host
    round trip per tensor and read back together at the end."""
    out: list[Fingerprint | None] = [None] * len(tensors)
    pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.numel() == 0 or tensor.device.type == "cpu":
            out[i] = fingerprint(tensor)
            continue
        pending.setdefault(tensor.device, []).append((i, _device_sums(tensor)))
    for items in pending.values():
        sums = torch.stack([s for _, s in items]).tolist()
        for (i, _), row in zip(items, sums):
            out[i] = _to_print(row)
    return out  # type: ignore[return-value]


def placed(runs: torch.Tensor, dst: int, dst_stride: int) -> Fingerprint:
    """The contribution to a parameter's fingerprint of `runs` ([count, length] elements, as
    `placement.pattern_view` gives them) whose run i starts at element `dst + i * dst_stride`
    of the flat parameter."""
    if runs.numel() == 0:
        return (0, 0, 0)
    per = words_per_element(runs.dtype)
    if runs.stride(-1) != 1:
        runs = runs.contiguous()
    words = runs.view(torch.uint8) if runs.element_size() == 1 else runs.view(torch.int16)
    return _to_print(_placed_sums(words, dst * per, dst_stride * per))


def shift(fp: Fingerprint, words: int) -> Fingerprint:
    """The contribution of a piece with fingerprint `fp` whose first word is word `words` of
    the parameter."""
    return (fp[0], fp[1] * pow(ROOTS[0], words, PRIMES[0]) % PRIMES[0],
            fp[2] * pow(ROOTS[1], words, PRIMES[1]) % PRIMES[1])


def combine(prints: list[Fingerprint]) -> Fingerprint:
    """A parameter's fingerprint from its pieces' contributions (each already `shift`ed or
    `placed` where it sits)."""
    return (sum(p[0] for p in prints) & MASK, sum(p[1] for p in prints) % PRIMES[0],
            sum(p[2] for p in prints) % PRIMES[1])


def diff(expected: dict[str, Fingerprint], actual: dict[str, Fingerprint]) -> list[str]:
    """Names whose fingerprints differ or are missing on one side, sorted."""
    names = set(expected) | set(actual)
    return sorted(
        n for n in names
        if n not in expected or n not in actual or tuple(expected[n]) != tuple(actual[n])
    )


def expected_fingerprints(param_of: dict[str, list[str]],
                          sent: dict[str, Fingerprint]) -> dict[str, Fingerprint]:
    """What each engine parameter's fingerprint must be, for a receiver that reports no
    placements: a parameter exactly one trainer tensor lands in holds it from its first word
    (the reference receiver's and a padded vocabulary's layout). Parameters made of several
    tensors, and tensors landing in several parameters, cannot be placed this way and are left
    out (engines report placements for those)."""
    holders: dict[str, list[str]] = {}
    for name, targets in param_of.items():
        for target in targets:
            holders.setdefault(target, []).append(name)
    return {p: tuple(sent[names[0]]) for p, names in holders.items()
            if len(names) == 1 and len(param_of[names[0]]) == 1}


def model_fingerprints(model: nn.Module,
                       param_of: dict[str, list[str]]) -> dict[str, list[int]]:
    """Engine side: {parameter name: [s, h1, h2]} of every parameter some trainer tensor lands
    in (`param_of`: trainer tensor -> engine parameters), as plain data."""
    covered = {p for targets in param_of.values() for p in targets}
    named = [(name, p.data) for name, p in model.named_parameters() if name in covered]
    prints = fingerprints([t for _, t in named])
    return {name: list(fp) for (name, _), fp in zip(named, prints)}
