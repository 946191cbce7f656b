#include "buildinfo.h"

#ifndef HY_GGML_VERSION
#error "ggml_hybrid_build defines HY_GGML_VERSION, HY_PATCH_HASH, HY_SOURCE_HASH and GGML_HYBRID_ABI"
#endif

const char * hy_ggml_version(void) { return HY_GGML_VERSION; }
const char * hy_patch_hash(void) { return HY_PATCH_HASH; }
const char * hy_source_hash(void) { return HY_SOURCE_HASH; }
const char * hy_abi(void) { return GGML_HYBRID_ABI; }
