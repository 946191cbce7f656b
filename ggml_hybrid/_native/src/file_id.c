#include "file_id.h"

#include <string.h>
#include <sys/stat.h>

int hy_file_identity(int fd, int64_t id[HY_FILE_ID_N]) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        return -1;
    }
    id[0] = (int64_t) st.st_dev;
    id[1] = (int64_t) st.st_ino;
    id[2] = (int64_t) st.st_size;
    id[3] = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    return 0;
}

bool hy_file_unchanged(int fd, const int64_t id[HY_FILE_ID_N]) {
    int64_t now[HY_FILE_ID_N];
    return hy_file_identity(fd, now) == 0 && memcmp(now, id, sizeof(now)) == 0;
}
