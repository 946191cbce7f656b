/* Optional backends (CUDA, Vulkan) loaded at run time (GGML_BACKEND_DL) when their ABI stamp is this ggml-base's,
   and GGML's log: captured while a backend loads, quiet (no debug lines) otherwise. */
#pragma once

#include <stddef.h>

#include "ggml-backend.h"

const char * hy_reg_path(ggml_backend_reg_t reg);
ggml_backend_reg_t hy_backend_load(const char * path, char * err, size_t n_err);
const char * hy_backend_load_log(void);

/* GGML's log messages to stderr, but for debug ones */
void hy_log_quiet(void);
