/*
 * launch.h - whether kernels/ launches its kernels with programmatic dependent launch (PDL,
 * sm_90 and later): each kernel may then be scheduled while the one before it on the stream
 * finishes, instead of after it. Every kernel of kernels/ starts by waiting for the grid it
 * depends on to complete (kernels/launch.cuh KERN_ENTRY: griddepcontrol.wait, which returns at
 * once on a launch without the attribute) and only then lets its own dependents be scheduled,
 * so the results are the same either way; what changes is the gap between two kernels of a
 * decode step (its graph records the attribute as a programmatic edge).
 *
 * Off until set. The CUDA backend sets it (on, but off for its graphed steps of more than
 * GLMSPARK_CUDA_PDL tokens); the kernel tests run without it. One flag for the process: one
 * backend setting it, launches from the thread that sets it.
 *
 * Ownership: none. Threads: set it before launching from any thread (a plain flag, read at
 * each launch). Errors: none.
 */
#ifndef KERNELS_LAUNCH_H
#define KERNELS_LAUNCH_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

void kern_set_pdl(bool on);
bool kern_pdl(void);

// The current device's SM count and the shared memory one block may opt in to
// (cudaDevAttrMaxSharedMemoryPerBlockOptin), read once per process (one device kind a process).
int kern_sm_count(void);
int kern_smem_optin(void);

#ifdef __cplusplus
}
#endif
#endif  // KERNELS_LAUNCH_H
