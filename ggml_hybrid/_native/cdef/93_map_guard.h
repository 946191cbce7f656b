// Declared in src/map_guard.h, defined in src/map_guard.c: SIGBUS from a truncated mapped model file.
#define GGML_HYBRID_MAP_GUARD_MAX ...
int ggml_hybrid_map_guard_add(const void * addr, size_t size);
void ggml_hybrid_map_guard_remove(int id);
uint64_t ggml_hybrid_map_guard_faults(int id);
