// The CUDA driver API, loaded at run time.
//
// pdkv never links against CUDA: libcuda.so.1 is dlopen()ed on first use, so the
// package builds, imports and runs on machines without a GPU, and the CUDA paths
// report a clear NotSupported there. Only the few driver types pdkv uses are
// declared here (ABI-stable since CUDA 4), so no CUDA headers are needed to build.
//
// The environment variable PDKV_CUDA_DRIVER, when set and non-empty, names the
// library to load instead (a path or a soname, as dlopen() takes it): a libcuda
// outside the loader's search path, or tests/fakecuda (the driver API emulated on
// host memory, so the CUDA paths run in CI without a GPU). It is read once, on the
// first CudaDriver::get() in the process.
//
// Thread safety: CudaDriver::get() is thread-safe; the function pointers are
// immutable after loading.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "pdkv/status.h"

namespace pdkv::cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUdeviceptr = unsigned long long;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
struct CUipcMemHandle {
  char reserved[64];
};

inline constexpr CUresult kSuccess = 0;
inline constexpr CUresult kNotReady = 600;
inline constexpr unsigned kIpcLazyEnablePeerAccess = 0x1;
inline constexpr unsigned kEventBlockingSync = 0x1;
inline constexpr unsigned kEventDisableTiming = 0x2;
inline constexpr unsigned kStreamNonBlocking = 0x1;
inline constexpr int kPointerAttrContext = 1;
inline constexpr int kPointerAttrMemoryType = 2;
inline constexpr int kPointerAttrDeviceOrdinal = 9;
inline constexpr unsigned kMemHostAllocPortable = 0x1;

struct CudaDriver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);

  // Loads libcuda.so.1 (or $PDKV_CUDA_DRIVER) and calls cuInit(0) once. NotSupported
  // with the reason when there is no driver or no device.
  static Result<const CudaDriver*> get();
  // Whether get() is expected to succeed, WITHOUT initializing CUDA (cuInit in a
  // process that later fork()s breaks CUDA in its children): the library loads and an
  // NVIDIA device node exists. The real answer once get() has run.
  static Status probe();
  // Whether NVIDIA GPU hardware is present (a device node), whatever driver library is
  // loaded: speeds of GPU kernels are modelled only there, never for an emulation
  // (tests/fakecuda) named by PDKV_CUDA_DRIVER.
  static bool hardware_present();
  // OK, or `what` failed with the driver's error string.
  Status check(CUresult r, const char* what) const;
  // Makes device `ordinal`'s primary context current on this thread.
  Status use_device(int ordinal) const;
};

// True when a CUDA driver and at least one device are present (never throws or aborts).
bool cuda_available();

}  // namespace pdkv::cuda
