// Declared in src/signals.h, defined in src/signals.c: Ctrl-C reaches a main thread blocked in a system call.
int hy_forward_sigint_to_main_thread(void);
