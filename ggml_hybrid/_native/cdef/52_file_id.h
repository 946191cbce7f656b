// A file's identity (src/file_id.h): what the session opened, checked before the mapping or the file is read.
#define HY_FILE_ID_N ...
int hy_file_identity(int fd, int64_t id[4]);
bool hy_file_unchanged(int fd, const int64_t id[4]);
