// Declared in src/map_guard.h, defined in src/map_guard.c: SIGBUS from a truncated mapped model file.
int hy_map_guard_add(const void * addr, size_t size);
void hy_map_guard_remove(int id);
uint64_t hy_map_guard_faults(int id);
int64_t hy_map_release(const void * addr, size_t size);
int hy_map_populate(const void * addr, size_t size);
