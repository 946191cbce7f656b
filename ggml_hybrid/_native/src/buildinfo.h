/* What the cffi module was built from, compiled in as macros by ggml_hybrid_build, and the ABI stamp of the ggml-base
   actually loaded: _native/buildinfo.py compares them at import, so a stale build fails loudly. */
#pragma once

const char * hy_ggml_version(void);
const char * hy_patch_hash(void);
const char * hy_source_hash(void);
const char * hy_abi(void);
/* the ABI stamp compiled into the ggml-base actually loaded (vendor/CMakeLists.txt adds it) */
const char * ggml_hybrid_base_abi(void);
