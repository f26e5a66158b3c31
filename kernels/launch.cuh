/*
 * launch.cuh - the one way kernels/ launches a kernel (kern_launch) and the statement every
 * kernel starts with (KERN_ENTRY), for programmatic dependent launch (launch.h).
 *
 * KERN_ENTRY(): griddepcontrol.wait (this grid's reads and writes start after the grid it
 * depends on has completed and its memory is visible; at once when launched without PDL), then
 * griddepcontrol.launch_dependents (the next kernel on the stream may be scheduled now: it
 * will itself wait at its KERN_ENTRY). Nothing before it may touch memory another kernel
 * writes: tests/kernels/check_kernel_entry.sh checks that it is every kernel's first statement.
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
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define KERN_ENTRY() kern_entry()

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
