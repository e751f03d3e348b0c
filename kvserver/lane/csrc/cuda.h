/* The CUDA driver calls the data plane makes for a CUDA pool's copies (cuda_jobs.h),
 * through a table of entry points the daemon hands it at a gate's set_cuda(): libcuda's own on a
 * GPU (kvserver/media/cuda/driver.py), a stand-in's in the tests. No header of CUDA's is needed to
 * build it, and nothing here runs unless a gate was given such a table. The signatures are the
 * driver API's (cuda.h): CUresult is an int, CUdeviceptr a 64-bit address, the handles pointers. */
#ifndef KVLANE_CUDA_H
#define KVLANE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#define KV_CU_SUCCESS 0
#define KV_CU_NOT_READY 600 /* CUDA_ERROR_NOT_READY: cuEventQuery of work not done yet */
/* cuEventCreate's flags for a write's completion event: CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING */
#define KV_CU_DONE_EVENT_FLAGS 3u
#define KV_CU_ENTRY_POINTS 8

typedef struct {
    int (*ctx_set_current)(void *ctx);                                   /* cuCtxSetCurrent */
    int (*memcpy_async)(uint64_t dst, uint64_t src, size_t n, void *stream); /* cuMemcpyAsync */
    int (*stream_wait_event)(void *stream, void *event, unsigned flags); /* cuStreamWaitEvent */
    int (*event_record)(void *event, void *stream);                      /* cuEventRecord */
    int (*event_query)(void *event);                                     /* cuEventQuery */
    int (*event_create)(void **event, unsigned flags);                   /* cuEventCreate */
    int (*event_destroy)(void *event);                                   /* cuEventDestroy_v2 */
    int (*launch_kernel)(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned shared_bytes, void *stream, void **params,
                         void **extra);                                  /* cuLaunchKernel */
} kv_cuda_driver;

#endif
