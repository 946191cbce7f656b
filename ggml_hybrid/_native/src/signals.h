/* Ctrl-C for a main thread blocked in a system call. The kernel hands a process-directed signal to any thread
   that does not block it; threads that C libraries start (a Vulkan driver's, an OpenMP pool's) block nothing.
   When SIGINT lands on one of them, Python's handler only sets a flag for the main thread, and a main thread
   asleep in select() (readline waiting for a key in `run -cnv`) never wakes to see it: Ctrl-C did nothing.
   The handler installed here, in front of the one in place, sends a SIGINT received by another thread on to
   the main thread, whose system call then returns EINTR and whose Python raises KeyboardInterrupt; in the main
   thread it calls the handler that was there before. */
#pragma once

/* Install the forwarder for SIGINT in front of the handler in place, from the main thread (the thread that
   calls it is taken as the main one). Returns 1 when installed, 0 when already in place or SIGINT is ignored
   or default, -1 on failure. Python's `signal.signal(SIGINT, ...)` afterwards replaces it. */
int hy_forward_sigint_to_main_thread(void);
