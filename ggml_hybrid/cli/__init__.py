"""The ``ggml-hybrid`` command line.

Commands: ``run`` (generate), ``inspect`` (what a file holds), ``bench`` (llama-bench's tests, or two
configurations side by side), ``demo`` (a generated model in every mode, checked bit-identical), ``plan``
(memory per device before loading, and the configuration that fits), ``devices`` (the device names layout
options take), ``options`` (the session options), ``rpc-server`` (serve this machine's device to sessions
elsewhere) and ``serve`` (the OpenAI-compatible server), ``pull`` (a GGUF from the Hugging Face Hub; ``-hf``
on the model commands), ``replay`` (a routing trace through expert caches, drawn with ``--plot``). Every user
error (missing file, bad option, bad value) is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

from . import bench, demo, gen, info, plan_cmd, pull, replay, rpc_server, run, serve  # noqa: F401  (each module registers its command)
from .main import main

__all__ = ["main"]
