/* A guard for memory-mapped model files: a read of a page past the end of a file truncated while it is
   mapped raises SIGBUS, which would kill the process wherever the read happens (a GGML kernel, the CPU
   worker, a copy into a device). Inside a guarded range the guard's SIGBUS handler maps zero pages over
   the rest of the range instead, counts the fault and returns: the read goes on with zeros, and the
   caller, which checks the count after its reads, raises a clear error instead of using the result.
   Faults outside every guarded range go to the handler that was installed before (or kill the process,
   as they would have). */
#pragma once

#include <stddef.h>
#include <stdint.h>

/* Guarded ranges at once (one per open model file). */
#define HY_MAP_GUARD_MAX 64

/* Guard [addr, addr + size) (installs the handler on first use). Returns the range's id (>= 0), or -1
   when every slot is taken or the handler could not be installed. */
int hy_map_guard_add(const void * addr, size_t size);

/* Stop guarding range `id` (before its mapping goes away). */
void hy_map_guard_remove(int id);

/* Faults the guard caught in range `id` since it was added. */
uint64_t hy_map_guard_faults(int id);

/* Unmap the file from the whole pages inside [addr, addr + size) of a mapping: zero pages of no file take their
   place (read-only, committed to nothing), so those bytes cost no page cache and a stray read gives zeros, never
   the file. The bytes released (whole pages), or -1 with errno set. */
int64_t hy_map_release(const void * addr, size_t size);

/* Fault in the pages of [addr, addr + size) of a mapping now (MADV_POPULATE_READ; where the kernel lacks it, a read
   of every page): a tensor used in place from the mapping is read at load as a copy of it would be, so its first
   compute takes no page fault, whose readahead would bring the file's neighbouring pages (experts the host tier
   reads itself) back into the page cache. 0, or -1 with errno set. */
int hy_map_populate(const void * addr, size_t size);
