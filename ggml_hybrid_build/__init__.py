"""Build the native part of ggml-hybrid: the pinned GGML and the cffi module (``python -m ggml_hybrid_build``).

Steps, each cached, each in a module of its own:

1. ``pin``: fetch the registry archive named in ``vendor/pin.json`` with pip and check its sha256;
2. ``patches``: extract GGML from it and apply ``vendor/patches/*.patch`` in order;
3. ``cmake``: build GGML with CMake through ``vendor/CMakeLists.txt``: ggml-base, ggml (the backend registry) and the
   CPU backend as shared libraries. The CPU backend is built for this CPU (``-march=native``) or, with
   ``GGML_HYBRID_PORTABLE=1``, once per x86-64 feature level, GGML loading the best one for the CPU it runs on
   (``GGML_CPU_ALL_VARIANTS``, as llama.cpp's release builds do); ``options`` holds the CMake options of each tree;
4. ``backend_libs``: build each optional backend asked for (``options.BACKENDS``: CUDA with ``GGML_HYBRID_CUDA=1``,
   ``cuda`` finding the toolkit; Vulkan with ``GGML_HYBRID_VULKAN=1``) in a tree of its own, as a library that GGML
   loads at run time (``GGML_BACKEND_DL``): an install with it still imports and runs on a machine without the GPU,
   its driver or its runtime. It is built from the pin and its own patches only, once per pin, as long as the ABI
   probe (``abi`` runs ``abiprobe``: struct layouts, enum values, signatures, inline code and macros of ggml-base's
   headers, the pin's against the patched ones) finds the patch series keeps what a backend takes from ggml-base;
   otherwise with ggml-base's patches too;
5. ``cffi_module``: compile the cffi extension (API mode, out-of-line) against the patched headers, linked to
   ggml-base and ggml;
6. ``install``: copy the module into ``ggml_hybrid/_native``, the GGML libraries into ``_native/lib`` and the optional
   backends into ``_native/backends``, and write the module's type stub (``stub``: from the compiled module's own
   description of its functions, through cffi's public API).

Each GGML build lives in a cache folder keyed by the pin, the patch series, the wrapper CMake file and its options
(``cmake.ggml_key``), so reinstalling with nothing changed reuses it. ``python -m ggml_hybrid_build --help`` lists the
options; ``build_backend.py`` (the PEP 517 backend) runs the same ``install.build`` before setuptools packages the
result. The package is named so that it shadows nothing: ``python -m build`` in the checkout is PyPA's build.
"""

from __future__ import annotations

from .install import build
from .options import Options, options_from_env

__all__ = ["Options", "build", "options_from_env"]
