/* The one clock of our C code: monotonic nanoseconds (CLOCK_MONOTONIC, the clock Python's time.perf_counter_ns
   reads on Linux), for every duration the executors, the worker and the host tier count. */
#pragma once

#include <stdint.h>

int64_t hy_now_ns(void);
