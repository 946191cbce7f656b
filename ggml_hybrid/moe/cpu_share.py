"""Split the cache misses of one MoE layer call between the CPU and the device.

A layer call requests DISTINCT experts, each with a number of (token, expert)
*rows*. An expert resident in the device expert cache is a *hit*; every other
requested expert is a *miss*. With ``moe_cpu_share = s`` a share of the misses is
computed on the CPU straight from the host copy of the weights (never loaded into
the cache), while the device computes the hits and loads and computes the
remaining misses. Everything here is pure Python and deterministic: results
depend only on the *set* of requested experts, their row counts, the residency
and (for :class:`CostModel`) the history of observations and choices, never on
the order in which experts are listed.

Fixed share (:func:`split_misses`)
---------------------------
Hits. Hits always stay on the device, whatever the share.

Rounding. For ``n`` misses the CPU takes ``n_cpu = n_cpu_for_share(s, n)``
misses: the share is read as the decimal number that ``repr(float(s))`` writes
(the shortest decimal that round-trips the float, so ``0.3`` means exactly 3/10,
not the binary value 0.29999999999999998889...), and
``n_cpu = floor(s * n + 1/2)`` (round half up) is evaluated exactly in rational
arithmetic (:class:`fractions.Fraction`), then clipped to ``[0, n]``. So
``s = 0`` gives 0, ``s = 1`` gives ``n``; ``0.3`` of 5 misses gives 2 (1.5 rounds
up; the binary value of the float 0.3 would give 1) and ``0.29`` of 50 misses
gives 15 (floating-point ``floor(0.29 * 50 + 0.5)`` gives 14).

Selection. The CPU takes the misses with the FEWEST rows first; among misses of
equal rows, the one LEAST LIKELY TO BE REUSED SOON first, by the layer's request
history (``history``, the cache's :meth:`~ggml_hybrid.moe.slot_cache.SlotCache.reuse_key`):
fewest past requests first, then the least recent request, then lower expert id.
Without a history (``history=None``: the rule before the history existed, kept for
comparison in the replay) ties go straight to the lower expert id. Reason for rows:
a miss costs the device a transfer of the expert's whole weight bytes over the bus
whatever its row count, then a compute that is nearly free per row; the CPU reads
the same bytes from host RAM (faster than PCIe) and its compute grows with the rows.
So the CPU is most useful for the experts with few rows (all of them at decode, where
both sides are bound by moving the bytes) and the device for the experts with many
rows (compute-bound, where the device's arithmetic wins by orders of magnitude).
Reason for reuse: a loaded expert pays back only if it is hit before it is evicted;
an expert the layer rarely asks for would most likely be evicted unused, so the CPU
computes it from host memory and the device loads the misses that will pay back.
On the real routing traces, at the same share, this loads fewer experts than the
id tie-break in 90 of 96 replays (every one at 1/8 and 1/4 of the experts as slots)
and mostly leaves fewer misses for the CPU too (docs/benchmarks.md, section 13).

Result. :class:`MissSplit` lists ``device_hits``, ``device_misses`` and
``cpu_misses`` as sorted tuples of expert ids; the three are disjoint and
together are exactly the requested experts. ``share`` is the share actually
applied, ``len(cpu_misses) / n_misses`` (0.0 when there are no misses).

Validation. ``experts`` are distinct non-negative ints; ``rows`` are positive
ints, one per expert; ``resident`` is an iterable of non-negative ints (it may
name experts that are not requested, e.g. ``SlotCache.resident()``); ``share`` is
a finite real number in [0, 1]. Bools are rejected wherever an int or a number is
expected. A violation raises :class:`CpuShareError` (a ``ValueError``) naming
the argument, the value and the rule.

Automatic share (:class:`CostModel`)
------------------------------------
One model per layer learns, from timings of past calls, four coefficients:

* ``cpu_per_byte`` (a) and ``cpu_per_row`` (b): a CPU job that reads ``bytes``
  weight bytes and computes ``rows`` rows takes ``a*bytes + b*rows`` seconds;
* ``load_per_byte`` (L): loading ``bytes`` into device slots takes ``L*bytes``;
* ``device_per_row`` (d): computing ``rows`` expert rows on the device takes
  ``d*rows``.

Fitting. Every observation is folded into exponential moving averages with
weight ``alpha`` (new = (1-alpha)*old + alpha*x; the k-th most recent
observation weighs ``alpha*(1-alpha)**k``), all starting at zero, so only ratios
of them are used and the zero start introduces no bias.

* ``L = EMA(load seconds) / EMA(load bytes)`` and
  ``d = EMA(device seconds) / EMA(device rows)``: a ratio of averages, i.e. the
  weighted least-squares slope through the origin with variance proportional to
  size, robust to small noisy jobs.
* (a, b) cannot be read off one scalar per job, so the model keeps the
  exponentially weighted normal equations of ``t = a*bytes + b*rows`` (EMAs of
  bytes^2, bytes*rows, rows^2, bytes*t, rows*t) and solves them at
  :meth:`CostModel.estimate` time: an exponentially forgetting least-squares fit,
  which is a running least squares without the bookkeeping of a ring buffer. The
  fit is done in units of the prior (``a = a0*u``, ``b = b0*v`` with the prior
  values a0, b0) and adds a tiny ridge term pulling toward the prior,
  ``RIDGE * (M11*(u-1)^2 + M22*(v-1)^2)`` where M11 and M22 are the diagonal of
  the scaled normal matrix (the EMAs of ``(a0*bytes)^2`` and ``(b0*rows)^2``) and
  ``RIDGE = 1e-6`` (when all jobs had zero bytes or zero rows, so that M11 or
  M22 is 0, both weights are ``RIDGE * (M11 + M22)`` and the unobserved
  coefficient stays at its prior). Reason: at decode every CPU job computes one row per expert,
  so bytes and rows are exactly proportional and only their combination is
  identified; the ridge then returns (to within about RIDGE) the point of that
  line nearest to the prior, which predicts every such job, instead of a singular
  system. On data that identifies both coefficients the pull is about
  ``RIDGE / (1 - rho^2)`` of the gap to the prior (rho: the weighted correlation
  of bytes and rows), i.e. negligible; nearly collinear noisy data may split the
  time between a and b noisily, but the jobs that look like the data are still
  predicted well, and those are the jobs being placed.
  Negative coefficients are excluded: the non-negative optimum of the (convex)
  ridge objective is the interior solution when both are >= 0, otherwise the
  better of the two boundary solutions (u = 0 or v = 0, the other clipped at 0).

A coefficient with no informative observation yet (no job, or only zero-byte /
zero-row jobs) takes its prior value.

* ``cpu_per_job`` (c): the fixed cost of a CPU job (handing it to the worker, waking it, setting up
  its graph), paid once per call that sends the CPU anything, whatever its bytes and rows:
  ``c = EMA(job seconds) / EMA(1)``, measured from the hand-off to the start of the job's compute.
  Without it a model fitted on decode's one-row jobs charges the CPU nothing for taking one more
  expert, and sends it experts the device would have finished sooner.

Priors (a "sane start", representative of a PCIe 4.0 x16 GPU and a DDR4/DDR5
desktop host; the ``prior`` dict overrides any of them). A row's compute is a
matrix-vector product over all of the expert's weights (2 FLOP per weight, about
1.8 weights per byte at ~4.5-bit quantization, so ~3.6 FLOP per weight byte), so
the per-row priors are given per row AND per expert weight byte and are
multiplied by ``expert_bytes`` when used:

* ``cpu_per_byte = 1/30e9`` s: dual-channel DDR4-3200 streams 51 GB/s peak,
  DDR5-5600 90 GB/s; ggml's quantized CPU kernels read weights at roughly a third
  to a half of that, ~30 GB/s.
* ``load_per_byte = 1/20e9`` s: PCIe 4.0 x16 is 32 GB/s raw, ~25 GB/s with
  pinned buffers; staging expert weights from pageable host memory lands near
  20 GB/s. (Slower than the CPU's own read, as the selection rule assumes.)
* ``cpu_per_row_per_byte = 1e-11`` s: ~3.6 FLOP per byte at ~360 GFLOP/s, a
  multi-core AVX2/AVX-512 host running quantized dot products.
* ``device_per_row_per_byte = 1e-13`` s: 100 times faster than the CPU
  (~36 TFLOP/s effective for batched quantized matmul).
* ``cpu_per_job = 20e-6`` s: a thread wake-up and a small graph's setup.

With these, decode (1 row per expert) puts about half of the misses on the CPU
(a CPU miss costs ``(3.3e-11 + 1e-11)*B`` against the device's ``5e-11*B``),
while prefill with ~64 rows per expert leaves all but the smallest misses to the
device (a CPU miss then costs ``6.7e-10*B``).

Modeled time of a split (``B = expert_bytes``, every expert of a layer has
the same size; ``rows_e`` the rows of expert e)::

    cpu_seconds    = (c if n_cpu else 0) + a*B*n_cpu + b*sum(rows_e for e in cpu_misses)
    device_seconds = L*B*n_device_misses + d*sum(rows_e for e in device_hits + device_misses)
                     + R*rounds   # only with round_s (below)
    makespan       = max(cpu_seconds, device_seconds)   # CPU jobs and the device run in parallel

A device's rounds (``round_s``, :meth:`CostModel.for_link`, over RPC): :mod:`.round_cost`. With ``round_s = 0`` (a
local device) nothing of it applies: ``d`` is the ratio above and no round is priced.

Choice. :meth:`CostModel.choose` orders the misses as :func:`split_misses` does (fewest
rows first, ties by the history, then by lower id), evaluates the makespan of every
``n_cpu = 0..n_misses`` (the CPU taking the first ``n_cpu`` of that order) and
takes the minimum, ties by the smallest ``n_cpu``.

Hysteresis. The model remembers a share ``S`` (None before the first call with
misses). On a call with ``n`` misses it computes ``k_prev = floor(S * n + 1/2)``
(clipped to ``[0, n]``) and keeps ``k_prev`` unless the best candidate's
makespan is better by more than ``hysteresis`` relative, i.e. unless
``makespan(best) < (1 - hysteresis) * makespan(k_prev)``; only when it switches
(or on the first call) does ``S`` become ``best / n``, kept as that exact fraction
(so the native executor, with integers, decides exactly as this does). ``S`` is therefore not
re-derived from each call's rounded share, so it does not drift across calls
with different miss counts. A call without misses changes nothing. With
``hysteresis = 0`` every choice has the minimal modeled makespan.

Cost. :func:`split_misses` is O(E log E) for E requested experts; :meth:`CostModel.choose`
adds O(E) for the sweep over ``n_cpu``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, cast

from .._native.cstruct import enum_names
from ..checks import check_int, check_real
from ..errors import CpuShareError
from .round_cost import device_rounds, round_seconds

if TYPE_CHECKING:
    from ..ggml.rpc import Link

#: The request history of a layer: expert id -> (requests, tick of the last request); lower = less likely reused.
History = Callable[[int], tuple[int, int]]

__all__ = ["COEFFICIENTS", "History", "PRIOR_KEYS", "CostModel", "CpuShareError", "DEFAULT_PRIOR", "MissSplit",
           "link_prior", "makespans", "n_cpu_for_share", "split_misses"]

#: The cost model's coefficients, in the order of every array of them (estimates, fixed coefficients, priors,
#: a synthetic clock): the C enum ``hy_cost_coef`` (``_native/src/moe_policy.h``) is their one list.
COEFFICIENTS: tuple[str, ...] = enum_names("enum hy_cost_coef", "HY_COST_")
#: The prior of each coefficient, in that order; the per-row costs are given per row and expert weight byte.
PRIOR_KEYS: tuple[str, ...] = tuple(f"{k}_per_byte" if k.endswith("_per_row") else k for k in COEFFICIENTS)

DEFAULT_PRIOR: dict[str, float] = {
    "cpu_per_byte": 1.0 / 30e9,
    "cpu_per_row_per_byte": 1e-11,
    "load_per_byte": 1.0 / 20e9,
    "device_per_row_per_byte": 1e-13,
    "cpu_per_job": 20e-6,
}


def link_prior(link: Link | None) -> dict[str, float] | None:
    """The cost model's prior for loads over a measured link (an RPC device's; None: no link, the default prior):
    an upload's bytes at the link's rate. Its round trips are left to the observed loads, which the model
    averages from the first call on."""
    if link is None:
        return None
    return {"load_per_byte": 1.0 / _real(link.bytes_per_s, "link_prior: bytes per second", 0.0, lo_open=True)}


@dataclass(frozen=True)
class MissSplit:
    """Where the experts of one layer call are computed; see the module docstring.

    ``device_hits``: sorted ids resident in the cache (computed on the device);
    ``device_misses``: sorted ids loaded into slots and computed on the device;
    ``cpu_misses``: sorted ids computed on the CPU (never loaded into the cache);
    ``share``: the share applied, ``len(cpu_misses) / n_misses`` (0.0 without misses).
    """

    device_hits: tuple[int, ...]
    device_misses: tuple[int, ...]
    cpu_misses: tuple[int, ...]
    share: float

    @property
    def n_misses(self) -> int:
        return len(self.device_misses) + len(self.cpu_misses)


# -- validation ------------------------------------------------------------------------------------


def _int(value: object, what: str, minimum: int) -> int:
    return check_int(value, what, minimum, error=CpuShareError)


def _real(value: object, what: str, lo: float | None = 0.0, hi: float | None = None, *, lo_open: bool = False,
          hi_open: bool = False) -> float:
    return check_real(value, what, lo, hi, lo_open=lo_open, hi_open=hi_open, error=CpuShareError)


def _share(share: object, what: str) -> float:
    return _real(share, what, 0.0, 1.0)


def _sequence(value: object, what: str, rule: str) -> object:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or not hasattr(value, "__len__"):
        raise CpuShareError(f"{what} must be {rule}, got {type(value).__name__}")
    return value


def _check_call(where: str, experts: Sequence[int], rows: Sequence[int],
                resident: Iterable[int]) -> tuple[list[int], list[int], set[int]]:
    _sequence(experts, f"{where}: experts", "a sequence of distinct int expert ids >= 0")
    ids: list[int] = []
    seen: dict[int, int] = {}
    for i, value in enumerate(experts):
        e = _int(value, f"{where}: experts[{i}]", 0)
        if e in seen:
            raise CpuShareError(f"{where}: expert {e} is listed twice (experts[{seen[e]}] and experts[{i}]); "
                                 "a call lists distinct experts")
        seen[e] = i
        ids.append(e)
    _sequence(rows, f"{where}: rows", "a sequence of int row counts >= 1, one per expert")
    if len(rows) != len(ids):
        raise CpuShareError(
            f"{where}: rows has {len(rows)} entries but experts has {len(ids)}; one row count per expert")
    counts = [_int(r, f"{where}: rows[{i}] (expert {ids[i]})", 1) for i, r in enumerate(rows)]
    if isinstance(resident, (str, bytes)) or not isinstance(resident, Iterable):
        raise CpuShareError(f"{where}: resident must be an iterable of int expert ids >= 0, "
                             f"got {type(resident).__name__}")
    res = {_int(e, f"{where}: resident expert", 0) for e in resident}
    return ids, counts, res


# -- fixed share -----------------------------------------------------------------------------------


def n_cpu_for_share(share: float, n_misses: int) -> int:
    """The number of misses the CPU takes for ``share`` of ``n_misses``.

    Rule: round half up, ``floor(share * n_misses + 1/2)``, clipped to ``[0, n_misses]``,
    evaluated exactly with :class:`fractions.Fraction` on the decimal number that
    ``repr(float(share))`` writes (0.3 is exactly 3/10), so no floating-point error
    can move a result across a rounding boundary: ``share = 0`` gives 0, ``share = 1``
    gives ``n_misses``, ``n_cpu_for_share(0.3, 5) == 2``, ``n_cpu_for_share(0.29, 50) == 15``.
    """
    s = _share(share, "n_cpu_for_share: share")
    n = _int(n_misses, "n_cpu_for_share: n_misses", 0)
    k = math.floor(Fraction(repr(s)) * n + Fraction(1, 2))
    return min(max(k, 0), n)


def _split(ids: list[int], counts: list[int], res: set[int],
           history: History | None) -> tuple[list[int], list[tuple[int, int]]]:
    """Hits sorted by id; misses as (rows, id) in the order the CPU takes them (module docstring, Selection)."""
    hits = sorted(e for e in ids if e in res)
    if history is None:
        misses = sorted((r, e) for e, r in zip(ids, counts) if e not in res)
    else:
        misses = sorted(((r, e) for e, r in zip(ids, counts) if e not in res),
                        key=lambda m: (m[0], *history(m[1]), m[1]))
    return hits, misses


def _history(history: object, where: str) -> History | None:
    if history is not None and not callable(history):
        raise CpuShareError(f"{where}: history must be None or a callable expert -> (requests, last request), "
                            f"got {type(history).__name__}")
    return cast("History | None", history)


def _miss_split(hits: list[int], misses: list[tuple[int, int]], n_cpu: int) -> MissSplit:
    n = len(misses)
    return MissSplit(device_hits=tuple(hits),
                     device_misses=tuple(sorted(e for _, e in misses[n_cpu:])),
                     cpu_misses=tuple(sorted(e for _, e in misses[:n_cpu])),
                     share=(n_cpu / n) if n else 0.0)


def split_misses(experts: Sequence[int], rows: Sequence[int], resident: Iterable[int], share: float,
                 history: History | None = None) -> MissSplit:
    """Split the misses of one layer call with a fixed CPU ``share`` of the misses.

    ``experts[i]`` has ``rows[i]`` rows; ``resident`` holds the ids in the device cache.
    Hits stay on the device; the CPU takes ``n_cpu_for_share(share, n_misses)`` misses,
    those with the FEWEST rows first, ties by ``history`` (the fewest past requests, then the
    least recent; the cache's ``reuse_key``), then lower expert id. A miss costs the device a
    transfer of the expert's whole weight bytes over the bus whatever its row count,
    while the CPU reads the same bytes from host RAM (faster than PCIe) and its compute
    grows with the rows; so the CPU is most useful for the experts with few rows (all of
    them at decode) and the device for the experts with many rows (compute-bound).
    Raises :class:`CpuShareError` for invalid arguments; see the module docstring.
    """
    ids, counts, res = _check_call("split_misses", experts, rows, resident)
    s = _share(share, "split_misses: share")
    hits, misses = _split(ids, counts, res, _history(history, "split_misses"))
    return _miss_split(hits, misses, n_cpu_for_share(s, len(misses)))


# -- automatic share -------------------------------------------------------------------------------


def _times(c: Mapping[str, float], expert_bytes: int, n_cpu: int, cpu_rows: int, n_dev: int,
           dev_rows: int) -> tuple[float, float]:
    """(cpu_seconds, device_seconds); the single formula shared by ``choose`` and ``modeled_times``."""
    job = c["cpu_per_job"] if n_cpu else 0.0
    cpu = job + c["cpu_per_byte"] * expert_bytes * n_cpu + c["cpu_per_row"] * cpu_rows
    dev = c["load_per_byte"] * expert_bytes * n_dev + c["device_per_row"] * dev_rows
    return cpu, dev


def makespans(c: Mapping[str, float], expert_bytes: int, hit_rows: int, miss_rows: Sequence[int],
              round_s: float = 0.0, n_hits: int | None = None, n_slots: int = 0) -> list[float]:
    """Modeled makespan of every ``n_cpu = 0..len(miss_rows)``, the CPU taking the first ``n_cpu`` misses.

    ``miss_rows`` lists the misses' row counts in the order the CPU takes them (fewest rows first);
    ``c`` holds the coefficients of :meth:`CostModel.estimate`; ``round_s`` per round (:mod:`.round_cost`).
    """
    n = len(miss_rows)
    total = hit_rows + sum(miss_rows)
    hits = int(hit_rows > 0) if n_hits is None else n_hits
    spans, cpu_rows = [], 0
    for k in range(n + 1):
        if k:
            cpu_rows += miss_rows[k - 1]
        cpu, dev = _times(c, expert_bytes, k, cpu_rows, n - k, total - cpu_rows)
        if round_s > 0.0:
            dev += round_s * float(device_rounds(hits, n - k, n_slots))
        spans.append(max(cpu, dev))
    return spans



class CostModel:
    """Online cost model for ``moe_cpu_share='auto'`` (one per layer).

    See the module docstring for the model, the fit, the priors and the hysteresis.
    ``alpha`` in (0, 1] is the EMA weight of a new observation, ``hysteresis`` in
    [0, 1) the relative gain a new choice needs over the remembered share, and
    ``prior`` overrides entries of :data:`DEFAULT_PRIOR` (positive finite floats).
    """

    RIDGE = 1e-6
    RIDGE_DEVICE_ROW = 1e-3  # the per-row pull of a round's fit (:mod:`.round_cost`; moe_policy.c: the same)

    def __init__(self, alpha: float = 0.25, hysteresis: float = 0.05, prior: Mapping[str, float] | None = None,
                 round_s: float = 0.0) -> None:
        self.alpha = _real(alpha, "CostModel: alpha", 0.0, 1.0, lo_open=True)
        self.hysteresis = _real(hysteresis, "CostModel: hysteresis", 0.0, 1.0, hi_open=True)
        self.round_s = _real(round_s, "CostModel: round_s", 0.0)
        self.prior = dict(DEFAULT_PRIOR)
        if prior is not None:
            if not isinstance(prior, Mapping):
                raise CpuShareError(f"CostModel: prior must be a dict with keys among {sorted(DEFAULT_PRIOR)}, "
                                     f"got {type(prior).__name__}")
            for key, value in prior.items():
                if key not in DEFAULT_PRIOR:
                    raise CpuShareError(f"CostModel: prior key {key!r} is unknown; keys are {sorted(DEFAULT_PRIOR)}")
                self.prior[key] = _real(value, f"CostModel: prior[{key!r}]", 0.0, lo_open=True)
        # EMAs: CPU normal equations, load and device-compute ratios
        self._cpu = [0.0] * 5  # bytes^2, bytes*rows, rows^2, bytes*t, rows*t
        self._load = [0.0, 0.0]  # seconds, bytes
        self._dev = [0.0, 0.0]  # seconds, rows
        self._dev_fit = [0.0] * 5  # with round_s: 1, rows, rows^2, t, rows*t (t = round + device_per_row * rows)
        self._job = [0.0, 0.0]  # seconds, weight (a job's fixed cost: hand-off and wake-up)
        self._n = {"cpu": 0, "load": 0, "device": 0, "job": 0}
        self._share: Fraction | None = None
        self._fixed: dict[str, float] | None = None

    @classmethod
    def for_link(cls, link: Link | None) -> CostModel:
        """The model of a device behind ``link`` (None: a local one): :func:`link_prior`, :func:`round_seconds`."""
        return cls(prior=link_prior(link), round_s=round_seconds(link))

    @classmethod
    def fixed(cls, coefficients: Mapping[str, float], hysteresis: float = 0.05) -> CostModel:
        """A model whose estimates are ``coefficients`` (seconds: ``cpu_per_byte``, ``cpu_per_row``,
        ``load_per_byte``, ``device_per_row``) and never change: observations are ignored.

        Replays use it, and so can a session that should make the same choices run after run.
        """
        if not isinstance(coefficients, Mapping) or set(coefficients) != set(COEFFICIENTS):
            raise CpuShareError(f"CostModel.fixed: coefficients must be a dict with exactly the keys "
                                f"{', '.join(COEFFICIENTS)}, got {coefficients!r}")
        model = cls(hysteresis=hysteresis)
        model._fixed = {k: _real(v, f"CostModel.fixed: coefficients[{k!r}]") for k, v in coefficients.items()}
        return model

    def __repr__(self) -> str:
        return (f"CostModel(alpha={self.alpha}, hysteresis={self.hysteresis}, share={self._share}, "
                f"observations={self._n})")

    @property
    def share(self) -> float | None:
        """The remembered share of the hysteresis (None before the first call with misses)."""
        return None if self._share is None else float(self._share)

    # -- observations --------------------------------------------------------------------------

    def _ema(self, stats: list[float], values: Sequence[float]) -> None:
        keep = 1.0 - self.alpha
        for i, v in enumerate(values):
            stats[i] = keep * stats[i] + self.alpha * v

    def observe_cpu(self, bytes_read: int, rows: int, seconds: float) -> None:
        """One CPU job: ``bytes_read`` weight bytes read and ``rows`` rows computed in ``seconds``."""
        if self._fixed is not None:
            return
        x = float(_int(bytes_read, "CostModel.observe_cpu: bytes_read", 0))
        r = float(_int(rows, "CostModel.observe_cpu: rows", 0))
        t = _real(seconds, "CostModel.observe_cpu: seconds")
        self._ema(self._cpu, (x * x, x * r, r * r, x * t, r * t))
        self._n["cpu"] += 1

    def observe_cpu_job(self, seconds: float) -> None:
        """The fixed cost of one CPU job: from its hand-off to the worker until its compute starts."""
        if self._fixed is not None:
            return
        t = _real(seconds, "CostModel.observe_cpu_job: seconds")
        self._ema(self._job, (t, 1.0))
        self._n["job"] += 1

    def observe_load(self, bytes_loaded: int, seconds: float) -> None:
        """Device loads: ``bytes_loaded`` weight bytes moved into slots in ``seconds``."""
        if self._fixed is not None:
            return
        x = float(_int(bytes_loaded, "CostModel.observe_load: bytes_loaded", 0))
        t = _real(seconds, "CostModel.observe_load: seconds")
        self._ema(self._load, (t, x))
        self._n["load"] += 1

    def observe_device(self, rows: int, seconds: float) -> None:
        """Device expert compute: one round of ``rows`` (token, expert) rows in ``seconds``."""
        if self._fixed is not None:
            return
        r = float(_int(rows, "CostModel.observe_device: rows", 0))
        t = _real(seconds, "CostModel.observe_device: seconds")
        self._ema(self._dev, (t, r))
        if self.round_s > 0.0:
            self._ema(self._dev_fit, (1.0, r, r * r, t, r * t))
        self._n["device"] += 1

    # -- estimates -----------------------------------------------------------------------------

    def _fit_round(self, expert_bytes: int) -> tuple[float, float]:
        """(a device round's fixed cost, its cost per row), from the rounds seen (with ``round_s``)."""
        return self._fit(self._dev_fit, self.RIDGE, self.RIDGE_DEVICE_ROW, self.round_s,
                         self.prior["device_per_row_per_byte"] * expert_bytes)

    @staticmethod
    def _fit(stats: Sequence[float], ridge1: float, ridge2: float, a0: float, b0: float) -> tuple[float, float]:
        """t = a*x + b*r from the EMAs (x^2, x*r, r^2, x*t, r*t), pulled to the priors a0, b0 (module docstring)."""
        sbb, sbr, srr, sbt, srt = stats
        # normal equations in prior units: features a0*bytes and b0*rows
        m11, m12, m22 = a0 * a0 * sbb, a0 * b0 * sbr, b0 * b0 * srr
        r1, r2 = a0 * sbt, b0 * srt
        if not m11 + m22 > 0.0:
            return a0, b0
        lam1, lam2 = ridge1 * m11, ridge2 * m22
        if lam1 == 0.0 or lam2 == 0.0:  # only zero-byte or only zero-row jobs: one coefficient is unidentified
            lam1, lam2 = ridge1 * (m11 + m22), ridge2 * (m11 + m22)
        m11 += lam1
        m22 += lam2
        r1 += lam1
        r2 += lam2

        def objective(u: float, v: float) -> float:  # 1/2 z'Mz - r'z
            return 0.5 * (m11 * u * u + 2.0 * m12 * u * v + m22 * v * v) - r1 * u - r2 * v

        det = m11 * m22 - m12 * m12
        u = (m22 * r1 - m12 * r2) / det
        v = (m11 * r2 - m12 * r1) / det
        if u < 0.0 or v < 0.0:
            cand = [(0.0, max(0.0, r2 / m22)), (max(0.0, r1 / m11), 0.0)]
            u, v = min(cand, key=lambda z: objective(*z))
        return a0 * u, b0 * v

    def estimate(self, expert_bytes: int) -> dict[str, float]:
        """Current coefficients for experts of ``expert_bytes`` bytes (used by the per-row priors).

        Returns ``cpu_per_byte``, ``cpu_per_row``, ``load_per_byte``, ``device_per_row`` (seconds)
        and ``cpu_observations``, ``load_observations``, ``device_observations`` (counts).
        """
        B = _int(expert_bytes, "CostModel.estimate: expert_bytes", 1)
        if self._fixed is not None:
            return {**self._fixed, "cpu_observations": 0, "load_observations": 0, "device_observations": 0,
                    "job_observations": 0}
        p = self.prior
        a, b = self._fit(self._cpu, self.RIDGE, self.RIDGE, p["cpu_per_byte"], p["cpu_per_row_per_byte"] * B)
        lt, lx = self._load
        dt, dr = self._dev
        jt, jw = self._job
        return {
            "cpu_per_byte": a,
            "cpu_per_row": b,
            "load_per_byte": lt / lx if lx > 0.0 else p["load_per_byte"],
            "device_per_row": (self._fit_round(B)[1] if self.round_s > 0.0 else
                               dt / dr if dr > 0.0 else p["device_per_row_per_byte"] * B),
            "cpu_per_job": jt / jw if jw > 0.0 else p["cpu_per_job"],
            "cpu_observations": self._n["cpu"],
            "load_observations": self._n["load"],
            "device_observations": self._n["device"],
            "job_observations": self._n["job"],
        }

    def round_cost(self, expert_bytes: int) -> float:
        """The estimated fixed cost of a device round (seconds; 0 without ``round_s``, which is its prior)."""
        B = _int(expert_bytes, "CostModel.round_cost: expert_bytes", 1)
        if self._fixed is not None or not self.round_s > 0.0:
            return self.round_s
        return self._fit_round(B)[0]

    def modeled_times(self, split: MissSplit, rows: Mapping[int, int], expert_bytes: int) -> tuple[float, float]:
        """``(cpu_seconds, device_seconds)`` of ``split`` under the current estimates.

        ``rows[e]`` is the row count of every expert ``e`` of the split.
        """
        if not isinstance(split, MissSplit):
            raise CpuShareError(f"CostModel.modeled_times: split must be a MissSplit, "
                                 f"got {type(split).__name__}")
        if not isinstance(rows, Mapping):
            raise CpuShareError(f"CostModel.modeled_times: rows must be a dict expert -> row count, "
                                 f"got {type(rows).__name__}")

        def total(ids: tuple[int, ...]) -> int:
            s = 0
            for e in ids:
                if e not in rows:
                    raise CpuShareError(f"CostModel.modeled_times: rows has no entry for expert {e} "
                                         "of the split; every split expert needs a row count")
                s += _int(rows[e], f"CostModel.modeled_times: rows[{e}]", 1)
            return s

        c = self.estimate(expert_bytes)
        return _times(c, expert_bytes, len(split.cpu_misses), total(split.cpu_misses),
                      len(split.device_misses), total(split.device_hits) + total(split.device_misses))

    def choose(self, experts: Sequence[int], rows: Sequence[int], resident: Iterable[int],
               expert_bytes: int, history: History | None = None, n_slots: int = 0) -> MissSplit:
        """The split of minimal modeled makespan, with hysteresis; see the module docstring (``n_slots``: rounds)."""
        ids, counts, res = _check_call("CostModel.choose", experts, rows, resident)
        B = _int(expert_bytes, "CostModel.choose: expert_bytes", 1)
        n_slots = _int(n_slots, "CostModel.choose: n_slots", 0)
        hits, misses = _split(ids, counts, res, _history(history, "CostModel.choose"))
        n = len(misses)
        if n == 0:
            return _miss_split(hits, misses, 0)
        c = self.estimate(B)
        hit_rows = sum(r for e, r in zip(ids, counts) if e in res)
        spans = makespans(c, B, hit_rows, [r for r, _ in misses], self.round_cost(B), len(hits), n_slots)
        best = min(range(n + 1), key=lambda k: (spans[k], k))
        k_prev = None if self._share is None else min(math.floor(self._share * n + Fraction(1, 2)), n)
        if k_prev is None or (best != k_prev and spans[best] < (1.0 - self.hysteresis) * spans[k_prev]):
            k = best
            self._share = Fraction(best, n)
        else:
            k = k_prev
        return _miss_split(hits, misses, k)
