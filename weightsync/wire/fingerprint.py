"""Position-sensitive fingerprints, computed the same way on the trainer and inside an engine.

A tensor's bytes are read as signed 16-bit words (unsigned bytes for 1-byte dtypes), in the
tensor's logical (row-major) order: x_0, x_1, ... A fingerprint is three integers:

- `s`: the sum of the words, mod 2**64. One changed 16-bit word always changes it; a changed
  float32 element (two words) may keep it (+d in one word, -d in the other), and then moves h1
  and h2 by d * r**j * (1 - r), never 0 mod p: one changed element of up to 4 bytes always
  changes the fingerprint. Wider elements have the hashes' odds only.
- `h1`, `h2`: polynomial hashes, sum of x_j * r**j mod p, for two primes p just under 2**21 and a
  primitive root r of each. Moving an element moves its weight: a transposed tensor, two swapped
  rows, or q and k swapped inside a fused QKV parameter change them (unless the moved words are
  equal), and two random changes collide with odds of about 2**-42.

All three are exact integers (the same on any device, thread count or torch release) and
combinable over the pieces of a parameter, given where each piece sits: a piece whose words
start at word `o` of the parameter contributes `shift(fingerprint(piece), o)` (the hashes times
r**o), and a parameter's fingerprint is the `combine`d sum of its pieces' contributions. Zero
words (the rows an engine pads a vocabulary with) contribute nothing. Where each trainer tensor
sits in an engine parameter is its placement (weightsync/wire/placement.py), learned from the
engine's own loader; `placed` gives the contribution of a strided run pattern there.

How: words are widened to float64 in rows of at most 2**16 and multiplied by one [row, 3] table
(1, r1**j mod p1, r2**j mod p2) with a BLAS (or cuBLAS) GEMM, one pass over the bytes. Every
product is below 2**36 and every row's sum below 2**52, so float64 holds each exactly, in any
summation order; the rows are then combined with the powers of their start positions in int64.
On a GPU with Triton one kernel (weightsync/gpu/word_sums.py) computes the same row sums reading
every word once, with no float64 scratch, for many tensors of any lengths at once. On a GPU the
result stays on the device until read (`fingerprints` reads many tensors' at once).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

MASK = (1 << 64) - 1
PRIMES = (2097143, 2097133)
ROOTS = (1000005, 1000004)  # a primitive root of each prime
_ROW = 1 << 16  # words per GEMM row: keeps every float64 row sum exact (see above)
_BLOCK_WORDS = {"cpu": 1 << 20, "other": 1 << 24}  # float64 scratch per block of rows
KERNEL = True  # CUDA tensors hashed by weightsync/gpu/word_sums.py where Triton runs
_KERNEL_WORDS = 1 << 28  # words queued before the kernel runs on them

Fingerprint = tuple[int, int, int]


def prints_digest(prints: Mapping[str, Sequence[int]]) -> str:
    """One short digest of {parameter: fingerprint}: equal for two maps exactly when they
    hold the same parameters with the same fingerprints (up to a BLAKE2b collision). A
    verified sync's `stage` sends the trainer's for each worker, and an engine whose own
    equals it answers in a few bytes instead of every parameter's fingerprint."""
    lines = "\n".join(f"{n}\t{','.join(map(str, map(int, prints[n])))}" for n in sorted(prints))
    return hashlib.blake2b(lines.encode(), digest_size=16).hexdigest()


def same_prints(workers: Sequence[Mapping[str, Sequence[int]]], expect: Any) -> bool:
    """Whether each worker's {parameter: fingerprint} digests to `expect`'s digest for it
    (`prints_digest`, one per worker, in order); False without `expect` or where the
    numbers of workers differ."""
    if not isinstance(expect, list | tuple) or len(expect) != len(workers) or not workers:
        return False
    return all(prints_digest(w) == e for w, e in zip(workers, expect))


_local = threading.local()


def _words(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach()
    flat = flat.view(-1) if flat.is_contiguous() else flat.reshape(-1).contiguous()
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
        mult = torch.tensor(
            [pow(r, n * step, p) for p, r in zip(PRIMES, ROOTS)], dtype=torch.int64, device=device
        )
        out[n : n + m] = out[:m] * mult % primes
        n += m
    return out


def _row_weights(count: int, device: torch.device) -> torch.Tensor:
    """[count, 3] int64: 1, r1**(k * _ROW) mod p1, r2**(k * _ROW) mod p2 for row k (cached)."""
    cache = getattr(_local, "row_weights", None)
    if cache is None:
        cache = _local.row_weights = {}
    have = cache.get(device)
    if have is None or have.shape[0] < count:
        size = max(count, 2 * (0 if have is None else have.shape[0]), 64)
        weights = torch.ones((size, 3), dtype=torch.int64, device=device)
        weights[:, 1:] = _powers(0, _ROW, size, device)
        cache[device] = have = weights
    return have[:count]


def _whole_sums(words: list[torch.Tensor], out: torch.Tensor) -> None:
    """Add to `out` ([G, 3] int64 on the words' device) [s, h1, h2] of each of `words` (G
    flat word tensors of one length, each its own tensor's words from word 0), the hashes not
    yet reduced mod p (each stays below 2**62 while a tensor has fewer than 2**20 rows)."""
    n = words[0].numel()
    device = words[0].device
    rows = -(-n // _ROW)
    per_block = max(1, _BLOCK_WORDS["cpu" if device.type == "cpu" else "other"] // _ROW)
    if rows <= per_block:  # whole tensors, as many as fit, widened side by side
        width = _ROW if rows > 1 else n  # a short tensor is one row of its own length
        at_once = max(1, per_block * _ROW // (rows * width))
        for g in range(0, len(words), at_once):
            part = words[g : g + at_once]
            wide = _scratch(device, len(part) * rows * width).view(len(part), rows * width)
            if rows * width != n:
                wide[:, n:].zero_()  # zero words hash to nothing
            if len(part) == 1:
                wide[0, :n].copy_(part[0])
            else:
                torch._foreach_copy_([wide[i, :n] for i in range(len(part))], part)
            _reduce(wide.view(len(part), rows, width), 0, out[g : g + len(part)])
        return
    for i, tensor_words in enumerate(words):  # a large tensor: blocks of rows
        for r in range(0, rows, per_block):
            chunk = tensor_words[r * _ROW : (r + per_block) * _ROW]
            count = -(-chunk.numel() // _ROW)
            wide = _scratch(device, count * _ROW)
            if count * _ROW != chunk.numel():
                wide[chunk.numel() :].zero_()
            wide[: chunk.numel()].copy_(chunk)
            _reduce(wide.view(1, count, _ROW), r, out[i : i + 1])


def _reduce(wide: torch.Tensor, first_row: int, out: torch.Tensor) -> None:
    """Add to `out` ([G, 3]) the sums of `wide` ([G, R, width] float64 words, rows
    `first_row`.. of G tensors): one GEMM, then each row's hashes reduced and weighted by
    its position."""
    device = wide.device
    groups, count, width = wide.shape
    sums = torch.mm(wide.view(-1, width), _table(device)[:, :width].t()).to(torch.int64)
    sums = sums.view(groups, count, 3)
    sums[:, :, 1:] = sums[:, :, 1:].remainder(
        torch.tensor(PRIMES, dtype=torch.int64, device=device)
    )
    sums *= _row_weights(first_row + count, device)[first_row:]
    out += sums.sum(1)


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """A float64 buffer of `numel` elements: per thread and reused on CPU, fresh elsewhere
    (the caching allocator reuses it there)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.float64, device=device)
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < numel:
        buf = _local.scratch = torch.empty(max(numel, 1 << 16), dtype=torch.float64)
    return buf[:numel]


def _kernel_runs(device: torch.device) -> bool:
    """Whether tensors on `device` are hashed by the GPU kernel (weightsync/gpu/word_sums.py:
    one read of every word, no float64 scratch) instead of the GEMM. `KERNEL` False: never.
    The kernel's first use on a device is checked against the GEMM (`_kernel_checked`)."""
    if device.type != "cuda" or not KERNEL:
        return False
    from weightsync.gpu import word_sums

    return word_sums.available() and _kernel_checked(device)


def _kernel_checked(device: torch.device) -> bool:
    """Once per device: a few tensors (both word sizes, several rows and groups, an empty one)
    hashed by the kernel and by the GEMM; any difference turns the kernel off in this process."""
    checked = getattr(_local, "kernel_checked", None)
    if checked is None:
        checked = _local.kernel_checked = {}
    if device not in checked:
        from weightsync.gpu import word_sums

        gen = torch.Generator().manual_seed(0)
        span = word_sums.ROW * word_sums.ROWS
        ok = True
        for dtype, n in ((torch.int16, span + 3 * _ROW + 5), (torch.uint8, _ROW + 7)):
            low, high = (-(1 << 15), 1 << 15) if dtype == torch.int16 else (0, 256)
            tensors = [
                torch.randint(low, high, (m,), generator=gen, dtype=torch.int64)
                .to(dtype)
                .to(device)
                for m in (n, 0, 3)
            ]
            want = torch.zeros((3, 3), dtype=torch.int64, device=device)
            _whole_sums([_words(tensors[0])], want[0:1])
            _whole_sums([_words(tensors[2])], want[2:3])
            try:
                got, _ = _kernel_sums(tensors, dtype == torch.uint8)
            except RuntimeError:
                ok = False
                break
            if not torch.equal(_reduced(got), _reduced(want)):
                word_sums.disable(f"its sums differ from the GEMM's on {device} ({dtype})")
                ok = False
                break
        checked[device] = ok
    return checked[device]


def _reduced(sums: torch.Tensor) -> torch.Tensor:
    out = sums.clone()
    out[:, 1:] = out[:, 1:].remainder(torch.tensor(PRIMES, dtype=torch.int64, device=sums.device))
    return out


class _KernelWork:
    """What the host prepares for one `_kernel_sums` call (the kernel's work list, row
    weights, moduli on the device), kept to hash the same tensors again with no host work
    beyond the launches."""

    __slots__ = ("table", "weights", "row_weights", "primes", "count")

    def __init__(self, tensors: list[torch.Tensor], byte_words: bool) -> None:
        from weightsync.gpu import word_sums

        device = tensors[0].device
        size = 1 if byte_words else 2
        counts = [t.numel() * t.element_size() // size for t in tensors]
        rows = -(-max(counts) // _ROW)
        self.count = len(tensors)
        self.table: torch.Tensor | None = None
        if rows == 0:
            return
        self.weights = _row_weights(max(rows, word_sums.ROWS), device)
        self.row_weights = self.weights[: word_sums.ROWS, 1:].t().to(torch.float64).contiguous()
        self.primes = torch.tensor(PRIMES, dtype=torch.int64, device=device)
        self.table = word_sums.group_table(
            [t.data_ptr() for t in tensors], counts, byte_words=byte_words, device=device
        )


def _kernel_sums(
    tensors: list[torch.Tensor], byte_words: bool, work: _KernelWork | None = None
) -> tuple[torch.Tensor, _KernelWork]:
    """[G, 3] int64: what `_whole_sums` adds for `tensors` (contiguous, one device, words of one
    size: bytes if `byte_words`), from the GPU kernel (weightsync/gpu/word_sums.py), and the
    host's preparation of it (`work`: the same, made before for the same tensors, lying where
    they lay). Raises RuntimeError where the kernel cannot run."""
    from weightsync.gpu import word_sums

    device = tensors[0].device
    if work is None:
        work = _KernelWork(tensors, byte_words)
    out = torch.zeros((work.count, 3), dtype=torch.int64, device=device)
    if work.table is None:
        return out, work
    sums, run, first_row = word_sums.group_sums(
        [],
        [],
        byte_words=byte_words,
        col_weights=_table(device)[1:],
        row_weights=work.row_weights,
        moduli=PRIMES,
        table=work.table,
    )
    sums[:, 1:] = sums[:, 1:].remainder(work.primes)
    sums *= work.weights[first_row]
    return out.index_add_(0, run, sums), work


def _hash(key: tuple, items: list[torch.Tensor], work: list | None = None) -> torch.Tensor:
    """[G, 3] int64 sums of one group of `FingerprintBatch` (`key`: device, word kind, length;
    length None: tensors of any length for the GPU kernel, else flat word tensors of it).
    `work`: a list kept with the group, holding the kernel's host preparation (filled here on
    the first call, reused on the next)."""
    device, byte_words, n = key
    if n is None:
        try:
            sums, prepared = _kernel_sums(items, byte_words, work[0] if work else None)
            if work is not None and not work:
                work.append(prepared)
            return sums
        except RuntimeError:  # the kernel stopped running here: the GEMM, by length
            sums = torch.zeros((len(items), 3), dtype=torch.int64, device=device)
            words = [_words(t) for t in items]
            for length in sorted({w.numel() for w in words} - {0}):
                same = [i for i, w in enumerate(words) if w.numel() == length]
                part = torch.zeros((len(same), 3), dtype=torch.int64, device=device)
                _whole_sums([words[i] for i in same], part)
                sums[same] = part
            return sums
    out = torch.zeros((len(items), 3), dtype=torch.int64, device=device)
    if n:
        _whole_sums(items, out)
    return out


class KeptHashes:
    """How `FingerprintBatch.add_all` grouped one list of tensors (each group's word tensors,
    hashed by one kernel launch or GEMM call), kept to hash the same list again."""

    __slots__ = ("tensors", "flushes")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] | None = None  # the list these groups were made for
        # per group: its key, indices, word tensors, and the kernel's host preparation of it
        self.flushes: list[tuple[tuple, list[int], list[torch.Tensor], list]] = []


class FingerprintBatch:
    """Fingerprints of many tensors with few kernels: on a GPU with Triton, tensors of one
    device and word size hashed together by one kernel launch; elsewhere tensors of one device
    and word count widened and hashed together (one GEMM per group, not per tensor). Results
    stay on their device until `read()` reads them all back at once."""

    def __init__(self) -> None:
        self._groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        self._done: list[tuple[list[int], torch.Tensor]] = []
        self._queued: dict[tuple, int] = {}  # words queued per kernel group
        self._count = 0
        self._recording: list[tuple[tuple, list[int], list[torch.Tensor], list]] | None = None

    def add(self, tensor: torch.Tensor) -> int:
        """Queue `tensor`; its index in `read()`'s list."""
        index = self._count
        self._count += 1
        if tensor.is_cuda and _kernel_runs(tensor.device):  # one kernel, tensors of any length
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()  # kept (queued) until hashed
            size = tensor.element_size()
            key: tuple = (tensor.device, size == 1, None)
            group = self._groups.setdefault(key, [])
            group.append((index, tensor))
            n = tensor.numel() * (1 if size == 1 else size // 2)
            self._queued[key] = self._queued.get(key, 0) + n
            if self._queued[key] >= _KERNEL_WORDS:
                self._flush(key)
            return index
        words = _words(tensor)
        n = words.numel()
        key = (words.device, words.dtype, n)
        group = self._groups.setdefault(key, [])
        group.append((index, words))
        budget = _BLOCK_WORDS["cpu" if words.device.type == "cpu" else "other"]
        if n == 0 or len(group) * n >= budget:
            self._flush(key)
        return index

    def _flush(self, key: tuple) -> None:
        group = self._groups.pop(key, [])
        self._queued.pop(key, None)
        if not group:
            return
        indices, items = [i for i, _ in group], [t for _, t in group]
        work: list = []
        self._done.append((indices, _hash(key, items, work)))
        if self._recording is not None:
            self._recording.append((key, indices, items, work))

    def add_all(self, tensors: list[torch.Tensor], kept: KeptHashes | None = None) -> None:
        """`add` each of `tensors` and hash them now (before their memory is reused). With
        `kept`, how they were grouped and hashed is kept there, and the next call with the same
        list object hashes them again without any per-tensor work: the caller keeps that list
        to tensors whose memory has not moved."""
        if kept is not None and kept.tensors is tensors:
            base = self._count
            for key, indices, items, work in kept.flushes:
                self._done.append(([base + i for i in indices], _hash(key, items, work)))
            self._count += len(tensors)
            return
        self.flush()
        base = self._count
        self._recording = [] if kept is not None else None
        try:
            for tensor in tensors:
                self.add(tensor)
            self.flush()
            recorded = self._recording
        finally:
            self._recording = None
        if kept is not None and recorded is not None:
            # A tensor hashed through a contiguous copy cannot be hashed again from that copy.
            keepable = all(t.is_contiguous() for t in tensors)
            kept.tensors = tensors if keepable else None
            kept.flushes = [
                (k, [i - base for i in idx], items, work) for k, idx, items, work in recorded
            ]

    def flush(self) -> None:
        """Hash what is queued now (before its memory is reused); results stay on device."""
        for key in list(self._groups):
            self._flush(key)

    def read(self) -> list[Fingerprint]:
        return table_prints(self.read_table())

    def read_table(self) -> torch.Tensor:
        """`read` as one [count, 3] int64 CPU tensor in `add` order, with no work per tensor:
        s as a signed 64-bit word (`& MASK` gives the fingerprint's), h1 and h2 reduced."""
        self.flush()
        table = torch.zeros((self._count, 3), dtype=torch.int64)
        primes = torch.tensor([1, *PRIMES], dtype=torch.int64)
        for indices, sums in self._done:
            sums = sums.cpu()
            sums[:, 1:] = sums[:, 1:].remainder(primes[1:])
            table[torch.tensor(indices, dtype=torch.int64)] = sums
        self._done = []
        return table


def table_prints(table: torch.Tensor) -> list[Fingerprint]:
    """The fingerprints of `FingerprintBatch.read_table`'s rows."""
    return [(s & MASK, h1, h2) for s, h1, h2 in table.tolist()]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """(s, h1, h2) of a tensor whose first word is word 0 (see the module doc)."""
    batch = FingerprintBatch()
    batch.add(tensor)
    return batch.read()[0]


def fingerprints(tensors: list[torch.Tensor]) -> list[Fingerprint]:
    """`fingerprint` of each tensor, batched (`FingerprintBatch`)."""
    batch = FingerprintBatch()
    for tensor in tensors:
        batch.add(tensor)
    return batch.read()


def _placed_rows(rows: torch.Tensor, start: int, stride: int) -> Fingerprint:
    """(s, h1, h2) of [count, n] words (n <= _ROW) whose row i starts at word
    `start + i * stride` of a parameter."""
    count, n = rows.shape
    device = rows.device
    table = _table(device)[:, :n].t()
    wide = rows.to(torch.float64)
    sums = torch.mm(wide, table).to(torch.int64)
    primes = torch.tensor(PRIMES, dtype=torch.int64, device=device)
    hashes = sums[:, 1:].remainder(primes) * _powers(start, stride, count, device) % primes
    h1, h2 = hashes.sum(0).tolist()
    return (int(sums[:, 0].sum().item()), h1 % PRIMES[0], h2 % PRIMES[1])


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
    parts = [
        _placed_rows(words[:, c : c + _ROW], dst * per + c, dst_stride * per)
        for c in range(0, words.shape[1], _ROW)
    ]
    return combine(parts)


def as_fingerprint(values: Sequence[int]) -> Fingerprint:
    """A fingerprint from plain data (after crossing an environment boundary it is a list)."""
    s, h1, h2 = values
    return (s, h1, h2)


def shift(fp: Fingerprint, words: int) -> Fingerprint:
    """The contribution of a piece with fingerprint `fp` whose first word is word `words` of
    the parameter."""
    return (
        fp[0],
        fp[1] * pow(ROOTS[0], words, PRIMES[0]) % PRIMES[0],
        fp[2] * pow(ROOTS[1], words, PRIMES[1]) % PRIMES[1],
    )


def combine(prints: list[Fingerprint]) -> Fingerprint:
    """A parameter's fingerprint from its pieces' contributions (each already `shift`ed or
    `placed` where it sits)."""
    return (
        sum(p[0] for p in prints) & MASK,
        sum(p[1] for p in prints) % PRIMES[0],
        sum(p[2] for p in prints) % PRIMES[1],
    )


def expected_fingerprints(
    param_of: dict[str, list[str]],
    sent: dict[str, Fingerprint],
    holders: dict[str, str] | None = None,
) -> dict[str, Fingerprint]:
    """What each engine parameter's fingerprint must be, for a receiver that reports no
    placements: a parameter exactly one trainer tensor lands in holds it from its first word
    (the reference receiver's and a padded vocabulary's layout). Parameters made of several
    tensors, and tensors landing in several parameters, cannot be placed this way and are left
    out (engines report placements for those). `holders`: `sole_holders(param_of)`, if kept."""
    if holders is None:
        holders = sole_holders(param_of)
    return {p: sent[name] for p, name in holders.items()}


def sole_holders(param_of: dict[str, list[str]]) -> dict[str, str]:
    """{engine parameter: the one trainer tensor it holds whole} (`expected_fingerprints`)."""
    holders: dict[str, list[str]] = {}
    for name, targets in param_of.items():
        for target in targets:
            holders.setdefault(target, []).append(name)
    return {
        p: names[0]
        for p, names in holders.items()
        if len(names) == 1 and len(param_of[names[0]]) == 1
    }


def model_fingerprints(model: nn.Module, param_of: dict[str, list[str]]) -> dict[str, list[int]]:
    """Engine side: {parameter name: [s, h1, h2]} of every parameter some trainer tensor lands
    in (`param_of`: trainer tensor -> engine parameters), as plain data."""
    return ModelPrints(model)(param_of)


class ModelPrints:
    """`model_fingerprints` of one model, asked again and again (every verified sync): the
    parameters `param_of` covers are found once per `param_of` (object and size), and their hashing kept
    (`KeptHashes`) while every one of them still lies where it lay (its data pointer)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._param_of: dict[str, list[str]] | None = None
        self._size = 0  # entries of `_param_of` then
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._tensors: list[torch.Tensor] = []
        self._pointers: list[int] = []
        self._kept = KeptHashes()

    def forget(self) -> None:
        """Let go of the kept tensors (they hold their memory): parameters were given new
        memory (shared, fenced off) and the next call may be far away."""
        self._param_of, self._size = None, 0
        self._params, self._tensors, self._pointers = [], [], []
        self._kept = KeptHashes()

    def __call__(self, param_of: dict[str, list[str]]) -> dict[str, list[int]]:
        # An engine that learns where tensors land while loading adds to the same map.
        if param_of is not self._param_of or len(param_of) != self._size:
            covered = {p for targets in param_of.values() for p in targets}
            named = [(n, p) for n, p in self.model.named_parameters() if n in covered]
            self._names = [n for n, _ in named]
            self._params = [p for _, p in named]
            self._param_of, self._size, self._pointers = param_of, len(param_of), []
        pointers = [p.data_ptr() for p in self._params]
        if pointers != self._pointers:  # new parameters, or a parameter's memory moved
            self._tensors = [p.data for p in self._params]
            self._pointers, self._kept = pointers, KeptHashes()
        batch = FingerprintBatch()
        batch.add_all(self._tensors, self._kept)
        return {name: list(fp) for name, fp in zip(self._names, batch.read())}
