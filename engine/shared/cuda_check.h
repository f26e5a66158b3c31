/*
 * cuda_check.h - CUDA_CHECK: every CUDA runtime call goes through it.
 *
 * A CUDA error such as an illegal address is sticky: the context is unusable and every later
 * call fails. No request can be saved in-process, so we log, abort, and let the supervisor
 * restart the engine; the job queue re-delivers unfinished jobs when their lease expires.
 * Recoverable conditions (a full KV cache, a bad request) never reach this macro: they are
 * Err values. (NCCL_CHECK, in engine/pipeline/pp_comm.h, follows the same policy.)
 *
 * Ownership: none. Threads: any. Errors: fatal by design (log_fatal aborts).
 */
#ifndef ENGINE_SHARED_CUDA_CHECK_H
#define ENGINE_SHARED_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "engine/shared/err.h"

#define CUDA_CHECK(call)                                                                        \
    do {                                                                                        \
        const cudaError_t cuda_check_rc_ = (call);                                              \
        if (cuda_check_rc_ != cudaSuccess)                                                      \
            log_fatal(__FILE__, __LINE__, "%s: %s", #call, cudaGetErrorString(cuda_check_rc_)); \
    } while (0)

#endif  // ENGINE_SHARED_CUDA_CHECK_H
