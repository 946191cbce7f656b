/* See signals.h. */
#include "signals.h"

#include <pthread.h>
#include <signal.h>
#include <stddef.h>

static pthread_t main_thread;
static struct sigaction sigint_before;

static void forward(int sig, siginfo_t * info, void * uctx) {
    if (!pthread_equal(pthread_self(), main_thread)) {
        pthread_kill(main_thread, sig);  /* async-signal-safe; the main thread runs the handler below */
        return;
    }
    if ((sigint_before.sa_flags & SA_SIGINFO) && sigint_before.sa_sigaction != NULL) {
        sigint_before.sa_sigaction(sig, info, uctx);
    } else if (sigint_before.sa_handler != SIG_DFL && sigint_before.sa_handler != SIG_IGN) {
        sigint_before.sa_handler(sig);
    }
}

int hy_forward_sigint_to_main_thread(void) {
    struct sigaction now;
    if (sigaction(SIGINT, NULL, &now) != 0) {
        return -1;
    }
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == forward) {
        return 0;  /* already in place */
    }
    if (!(now.sa_flags & SA_SIGINFO) && (now.sa_handler == SIG_IGN || now.sa_handler == SIG_DFL)) {
        return 0;  /* ignored, or the default (the process ends whichever thread takes it) */
    }
    main_thread = pthread_self();
    sigint_before = now;
    struct sigaction act = now;
    act.sa_sigaction = forward;
    act.sa_flags = now.sa_flags | SA_SIGINFO;
    return sigaction(SIGINT, &act, NULL) == 0 ? 1 : -1;
}
