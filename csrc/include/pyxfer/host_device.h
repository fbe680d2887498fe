// Qualifiers for definitions that the CPU reference and the CUDA kernels share bit for bit.
#pragma once

#if defined(__CUDACC__)
#define PYXFER_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PYXFER_HOST_DEVICE inline
#endif
