/* Forwarding header, kept only while the executor's files (moe_exec.c, moe_worker.c) include it: sched_hooks.c
   was split by what it holds (cpu_backend, backend_loader, graph_access, sched_step, buildinfo). Include
   cpu_backend.h instead, then delete this file. */
#pragma once

#include "cpu_backend.h"
