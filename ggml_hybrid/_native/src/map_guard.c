#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "map_guard.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* A slot is free while end == 0. The handler reads the slots without a lock (it may run in any thread,
   at any moment); adding writes begin before end, removing clears end first. */
struct guarded {
    _Atomic uintptr_t begin;
    _Atomic uintptr_t end;
    _Atomic uint64_t faults;
};

static struct guarded ranges[HY_MAP_GUARD_MAX];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction previous;
static int installed;
static uintptr_t page_size;

static void pass_on(int sig, siginfo_t * info, void * uctx) {
    if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != NULL) {
        previous.sa_sigaction(sig, info, uctx);
        return;
    }
    if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* the default action: on return the faulting read runs again and the process dies of SIGBUS, as it
       would have without the guard */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
}

static void on_sigbus(int sig, siginfo_t * info, void * uctx) {
    if (info != NULL && info->si_code == BUS_ADRERR) {
        const uintptr_t at = (uintptr_t) info->si_addr;
        for (int i = 0; i < HY_MAP_GUARD_MAX; i++) {
            const uintptr_t end = atomic_load(&ranges[i].end);
            const uintptr_t begin = atomic_load(&ranges[i].begin);
            if (end == 0 || at < begin || at >= end) {
                continue;
            }
            /* the file ends before this page, and so before every later page of the range: zeros over all
               of them at once (one fault, not one per page) */
            const uintptr_t page = at & ~(page_size - 1);
            void * got = mmap((void *) page, end - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (got != MAP_FAILED) {
                atomic_fetch_add(&ranges[i].faults, 1);
                return;
            }
            break;
        }
    }
    pass_on(sig, info, uctx);
}

int hy_map_guard_add(const void * addr, size_t size) {
    if (addr == NULL || size == 0) {
        return -1;
    }
    int id = -1;
    pthread_mutex_lock(&lock);
    if (!installed) {
        page_size = (uintptr_t) sysconf(_SC_PAGESIZE);
        struct sigaction act;
        memset(&act, 0, sizeof(act));
        act.sa_sigaction = on_sigbus;
        act.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&act.sa_mask);
        if (sigaction(SIGBUS, &act, &previous) == 0) {
            installed = 1;
        }
    }
    if (installed) {
        for (int i = 0; i < HY_MAP_GUARD_MAX; i++) {
            if (atomic_load(&ranges[i].end) == 0) {
                atomic_store(&ranges[i].faults, 0);
                atomic_store(&ranges[i].begin, (uintptr_t) addr);
                atomic_store(&ranges[i].end, (uintptr_t) addr + size);
                id = i;
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return id;
}

void hy_map_guard_remove(int id) {
    if (id < 0 || id >= HY_MAP_GUARD_MAX) {
        return;
    }
    pthread_mutex_lock(&lock);
    atomic_store(&ranges[id].end, 0);
    atomic_store(&ranges[id].begin, 0);
    pthread_mutex_unlock(&lock);
}

int64_t hy_map_release(const void * addr, size_t size) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = ((uintptr_t) addr + page - 1) / page * page, end = ((uintptr_t) addr + size) / page * page;
    if (end <= begin) {
        return 0;
    }
    void * got = mmap((void *) begin, end - begin, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    return got == MAP_FAILED ? -1 : (int64_t) (end - begin);
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14; older kernels answer EINVAL */
#endif

int hy_map_populate(const void * addr, size_t size) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) addr / page * page, end = (uintptr_t) addr + size;
    if (end <= begin) {
        return 0;
    }
    if (madvise((void *) begin, end - begin, MADV_POPULATE_READ) == 0) {
        return 0;
    }
    if (errno != EINVAL) {
        return -1;
    }
    volatile uint8_t sink = 0;
    for (uintptr_t p = begin; p < end; p += page) {
        sink ^= *(const volatile uint8_t *) p;
    }
    (void) sink;
    return 0;
}

uint64_t hy_map_guard_faults(int id) {
    if (id < 0 || id >= HY_MAP_GUARD_MAX) {
        return 0;
    }
    return atomic_load(&ranges[id].faults);
}
