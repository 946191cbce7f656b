"""``python -m ggml_hybrid.cli``: the ``ggml-hybrid`` command."""

from . import main

main()
