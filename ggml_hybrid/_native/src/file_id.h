/* A file's identity: what tells the model file a session opened from a file truncated or rewritten in place since
   (device, inode, size, modification time in ns), read from the open descriptor (fstat: a few hundred ns, where a
   stat of /proc/self/fd/N costs µs). The one definition: Python's GGUFStore reads it through cffi, the native
   executor and the host tier compare against it before they read the mapping or the file. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

enum { HY_FILE_ID_N = 4 };

/* the identity of open descriptor `fd` into id[0..HY_FILE_ID_N): 0, or -1 (errno set) when fstat fails */
int hy_file_identity(int fd, int64_t id[HY_FILE_ID_N]);
/* whether `fd` still has identity `id` (false when fstat fails) */
bool hy_file_unchanged(int fd, const int64_t id[HY_FILE_ID_N]);
