"""Every exception ggml-hybrid raises on purpose, in one hierarchy.

Each error names the operation, the offending values and the rule, so that a
wrong call reads like a diagnosis rather than a crash report. Each class also
derives from the built-in exception a Python user would expect (``ValueError``,
``TypeError``, ``MemoryError``, ...), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

MESSAGE_CHARS = 1000  # an error message is cut to about this many characters (it may quote an attacker's value)


def shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    """``text`` cut to about ``limit`` characters: its start (what failed, the value) and its end (the rule), with
    how much was left out between them. Values in messages come from files and requests: a 1 MiB metadata
    string must not become a 1 MiB error line."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]} ... ({len(text) - head - tail} characters left out) ... {text[len(text) - tail:]}"


class GgmlHybridError(Exception):
    """Base class of every error raised by ggml-hybrid."""


# -- arguments -------------------------------------------------------------------------------------

class ArgumentError(GgmlHybridError, ValueError):
    """An argument value outside the rule of the function it was given to."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (a bool where an int is expected, a str where a list is)."""


# -- the native layer ------------------------------------------------------------------------------

class StaleBuildError(GgmlHybridError, ImportError):
    """The compiled native module does not match the sources it sits next to."""


class ClosedError(GgmlHybridError, ValueError):
    """A native object was used after ``close()``."""


class ShapeError(GgmlHybridError, ValueError):
    """Shapes or strides that the operation cannot accept."""


class DTypeError(GgmlHybridError, TypeError):
    """A tensor or array element type the operation cannot accept."""


class IndexRangeError(GgmlHybridError, IndexError):
    """An index (row id, expert id, graph node) outside the range of what it selects from."""


class BackendError(GgmlHybridError, RuntimeError):
    """A backend cannot run an operation or hold a buffer, or a native call failed."""


class AllocationError(BackendError, MemoryError):
    """A backend buffer or graph allocation failed."""


class ComputeError(BackendError):
    """A graph computation returned a failure status."""


class RPCError(BackendError):
    """An RPC server that cannot be reached, or whose connection failed (refused, a failed handshake, lost
    mid-run); the message names the endpoint and the reason."""


class GraphIndexError(IndexRangeError, ComputeError):
    """A graph's kernel met an index value outside what it selects from (a row id of get_rows or set_rows, an
    expert id of mul_mat_id, an id of add_id), on the CPU or on an RPC server: the compute failed; the message
    names the node, its op, the value and the valid range. The indices were computed in the graph or written
    where the Python checks do not see them; the backend and the connection stay usable."""


class NonFiniteError(GgmlHybridError, FloatingPointError):
    """A computation gave NaN or infinite values where a result must be finite (logits of broken weights)."""


class RegionError(GgmlHybridError, ValueError):
    """A graph region registration that the scheduler rejects."""


class RegionOpenError(RegionError):
    """A node inside a region is used by a node outside it (only outputs may be)."""


class RegionOverlapError(RegionError):
    """Two regions claim the same node."""


class RegionNotInGraphError(RegionError):
    """A region input or output is not part of the graph being scheduled."""


class RegionNotContiguousError(RegionError):
    """A region's nodes are interleaved with other nodes in graph order."""


class RegionUnsupportedError(RegionError):
    """The scheduler configuration cannot run regions (e.g. pipeline copies)."""


class GradientError(GgmlHybridError, ValueError):
    """A backward pass GGML cannot build: an op on the path from the parameters to the loss that it cannot
    differentiate (named), a loss or parameter it does not accept, or a graph without room for the gradients."""


class TrainingError(GgmlHybridError, ValueError):
    """A training run refused before it starts: data of the wrong shape or type for the model's input and output,
    a batch size or split the data does not divide, or optimizer hyperparameters outside GGML's rules."""


# -- MoE -------------------------------------------------------------------------------------------

class SlotCacheError(GgmlHybridError, ValueError):
    """A slot-cache configuration or call that the rules reject (bad slot count, policy, duplicate expert,
    row count)."""


class SlotCacheTypeError(SlotCacheError, TypeError):
    """An argument of the slot cache that is not of the required type (for instance an expert id that is not an int)."""


class CpuShareError(GgmlHybridError, ValueError):
    """An argument of the CPU share of misses or of its cost model that the rules reject."""


class TraceError(GgmlHybridError, ValueError):
    """A routing trace, trace record, trace file or replay request that the rules reject."""


class TraceTruncatedWarning(UserWarning):
    """A trace file ends in an incomplete record, which the reader dropped."""


# -- models and sessions ---------------------------------------------------------------------------

class OptionError(GgmlHybridError, ValueError):
    """An option key, value or role that SessionOptions cannot accept; the message names them and the rule."""


class ModelFileError(GgmlHybridError, ValueError):
    """A model file that is missing, not GGUF, truncated, or lacks what is required."""


class NotMoEError(ModelFileError):
    """A model file without routed experts where a MoE model is required."""


class ContextFullError(GgmlHybridError, ValueError):
    """More tokens than the KV cache has cells."""


class ConfigError(GgmlHybridError, ValueError):
    """A configuration file that is missing, not TOML, or has a bad entry."""


class ChatTemplateError(GgmlHybridError, ValueError):
    """Chat messages a template cannot render (bad shape, refused by the template, a template that fails)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template stopped at a bound: ``kind`` is ``time``, ``memory``, ``output`` (too long a prompt) or
    ``stopped`` (its renderer was closed: the process is stopping)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class GrammarError(GgmlHybridError, ValueError):
    """A grammar or JSON schema for constrained decoding that cannot be compiled (a syntax error, not valid JSON
    Schema, over a bound), or a constrained generation the grammar cannot continue; the message says which."""


class HubError(GgmlHybridError, ValueError):
    """A model asked of the Hugging Face Hub (``-hf``) that cannot be had: no such repository, no file of the quant
    tag, offline without it in the cache, a file split in parts; the message names the repository and the files."""


class MissingDependencyError(GgmlHybridError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the extra to install."""
