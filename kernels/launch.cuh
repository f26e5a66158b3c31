/*
 * launch.cuh - the one way kernels/ launches a kernel (kern_launch) and the statement every
 * kernel starts with (KERN_ENTRY), for programmatic dependent launch (launch.h).
 *
 * KERN_ENTRY(): griddepcontrol.wait (this grid's reads and writes start after the grid it
 * depends on has completed and its memory is visible; at once when launched without PDL), then
 * griddepcontrol.launch_dependents (the next kernel on the stream may be scheduled now: it
 * will itself wait at its KERN_ENTRY). Nothing before it may touch memory another kernel
 * writes: tests/tools/check_kernel_entry.sh checks that it (or KERN_ENTRY_AFTER, below) is
 * every kernel's first statement. Built with -DKERN_PDL_TRIGGER_AT_EXIT (an experiment's
 * build: docs/perf.md), no kernel triggers its dependents itself, so each is scheduled as the
 * last block of the one before it exits (the implicit trigger) instead of as soon as every
 * block has started.
 *
 * kern_launch(kernel, grid, block, smem, stream, args...): cudaLaunchKernelEx with the PDL
 * attribute when kern_pdl(); a launch failure is fatal (engine/shared/cuda_check.h).
 */
#ifndef KERNELS_LAUNCH_CUH
#define KERNELS_LAUNCH_CUH

#include <cuda_runtime.h>

#include <utility>

#include "engine/shared/cuda_check.h"
#include "kernels/launch.h"

static __device__ __forceinline__ void kern_entry(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifndef KERN_PDL_TRIGGER_AT_EXIT
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
}

#define KERN_ENTRY() kern_entry()

// KERN_ENTRY after `prefetch`, a call (its name ends in _prefetch) that computes addresses from
// the kernel's parameters and indices only and issues L2 prefetches of memory no kernel
// writes (weights): a GEMV's first weight lines then stream in while the kernel before it
// finishes. kern_prefetch_l2 is the one such instruction.
#define KERN_ENTRY_AFTER(prefetch) \
    do {                           \
        prefetch;                  \
        kern_entry();              \
    } while (0)

// A hint to bring the 128-byte line holding p into L2 (no value is returned; callers pass
// addresses inside an allocation: the PTX ISA promises nothing for others).
static __device__ __forceinline__ void kern_prefetch_l2(const void *p)
{
    asm volatile("prefetch.L2 [%0];" ::"l"(p));  // generic address
}

template <typename... KArgs, typename... Args>
static inline void kern_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, Args &&...args)
{
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = kern_pdl() ? 1 : 0;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

#endif  // KERNELS_LAUNCH_CUH
