/*
 * launch.cu - launch.h's switch and the device facts launchers size grids by.
 */
#include "kernels/launch.h"

#include <cuda_runtime.h>

#include "engine/shared/cuda_check.h"

static bool pdl_on;

void kern_set_pdl(bool on)
{
    pdl_on = on;
}

bool kern_pdl(void)
{
    return pdl_on;
}

static int device_attr(cudaDeviceAttr a)
{
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, a, dev));
    return n;
}

int kern_sm_count(void)
{
    static int n_sm = 0;  // benign race: every thread reads the same value
    if (n_sm == 0) n_sm = device_attr(cudaDevAttrMultiProcessorCount);
    return n_sm;
}

int kern_smem_optin(void)
{
    static int bytes = 0;
    if (bytes == 0) bytes = device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin);
    return bytes;
}
