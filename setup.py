"""setuptools glue: the wheel holds compiled code (the cffi module and GGML's libraries), so it is tagged for
this interpreter and platform (cp3XX-cp3XX-linux_x86_64), not as pure Python. Everything else is in
pyproject.toml; the native part is built by ggml_hybrid_build, which build_backend.py runs first."""

import sysconfig

from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


# only this interpreter's module: a checkout may hold others, built by other Pythons
MODULE = "_ggml" + sysconfig.get_config_var("EXT_SUFFIX")
setup(distclass=BinaryDistribution,
      package_data={"ggml_hybrid": ["py.typed"], "ggml_hybrid.server.web": ["*.html", "*.js", "*.css"],
                    "ggml_hybrid._native": [MODULE, "_ggml.pyi", "lib/libggml*", "backends/libggml-*.so",
                                            "cdef/*.h", "cdef/patched/*.h", "src/*.c", "src/*.h"]})
