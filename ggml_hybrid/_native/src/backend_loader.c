/* dladdr and Dl_info: which file a backend was loaded from */
#define _GNU_SOURCE

#include "backend_loader.h"
#include "buildinfo.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "ggml-backend-impl.h"

/* The file a backend's code lives in (a registry entry's functions point into it). */
const char * hy_reg_path(ggml_backend_reg_t reg) {
    Dl_info dl;
    if (reg == NULL || dladdr((void *) reg->iface.get_name, &dl) == 0 || dl.dli_fname == NULL) {
        return "";
    }
    return dl.dli_fname;
}

/* What GGML logs while a backend loads is kept here instead of going to stderr: a CUDA backend on a
   machine without a GPU explains why, once, in the package's own words. */
static char load_log[2048];
static size_t load_log_used;

static void capture_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level;
    (void) user_data;
    size_t n = strlen(text);
    if (load_log_used + n >= sizeof(load_log)) {
        n = sizeof(load_log) - 1 - load_log_used;
    }
    memcpy(load_log + load_log_used, text, n);
    load_log_used += n;
    load_log[load_log_used] = '\0';
}

const char * hy_backend_load_log(void) { return load_log; }

ggml_backend_reg_t hy_backend_load(const char * path, char * err, size_t n_err) {
    err[0] = '\0';
    load_log_used = 0;
    load_log[0] = '\0';
    void * handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char * why = dlerror();
        snprintf(err, n_err, "%s", why != NULL ? why : "dlopen failed");
        return NULL;
    }
    const char * (*abi)(void) = (const char * (*)(void)) dlsym(handle, "ggml_hybrid_backend_abi");
    if (abi == NULL) {
        snprintf(err, n_err, "%s was not built by ggml-hybrid's build (it has no ABI stamp)", path);
        dlclose(handle);
        return NULL;
    }
    if (strcmp(abi(), ggml_hybrid_base_abi()) != 0) {
        snprintf(err, n_err, "%s was built for GGML ABI %s, this ggml-base is %s; rebuild it", path, abi(),
                 ggml_hybrid_base_abi());
        dlclose(handle);
        return NULL;
    }
    /* the logger in place before (the package's quiet one) is put back afterwards */
    ggml_log_callback prev_log;
    void * prev_data;
    ggml_log_get(&prev_log, &prev_data);
    ggml_log_set(capture_log, NULL);
    ggml_backend_reg_t reg = ggml_backend_load(path); /* GGML's loader: API version check, registers the devices */
    ggml_log_set(prev_log, prev_data);
    dlclose(handle); /* GGML keeps a handle of its own */
    if (reg == NULL) {
        snprintf(err, n_err, "GGML could not initialise %s: %s", path, load_log);
    }
    return reg;
}

/* GGML's default logger prints every level to stderr, debug included (one line per repacked tensor);
   llama.cpp installs its own. Ours drops debug messages (and their continuations). */
static enum ggml_log_level last_level = GGML_LOG_LEVEL_INFO;

static void quiet_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_CONT) {
        level = last_level;
    } else {
        last_level = level;
    }
    if (level != GGML_LOG_LEVEL_DEBUG) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

void hy_log_quiet(void) { ggml_log_set(quiet_log, NULL); }
