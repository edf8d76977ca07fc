# LibTorch (CPU part) from the PyPI torch wheel in the project's Python environment.
#
# Defines spmdx::torch_cpu: ATen/c10 headers and libtorch_cpu + libc10. We do not use the
# wheel's TorchConfig.cmake: the wheel is built with CUDA, and its config links libtorch_cuda,
# which needs the CUDA libraries of the wheel's pip dependencies rather than the system
# toolkit's. The CPU executor needs neither.
# SPMDX_TORCH_ROOT: a torch package folder (site-packages/torch) to build against without
# importing it, e.g. a wheel for another Python unpacked for the GPU machine (scripts/device_check).
set(SPMDX_TORCH_ROOT "" CACHE PATH "torch package folder to build against (default: the one ${SPMDX_VENV}'s python imports)")
if(SPMDX_TORCH_ROOT)
  if(NOT EXISTS "${SPMDX_TORCH_ROOT}/lib/libtorch_cpu.so" OR NOT EXISTS "${SPMDX_TORCH_ROOT}/version.py")
    message(FATAL_ERROR "SPMDX_TORCH_ROOT=${SPMDX_TORCH_ROOT} is not a torch package folder (no lib/libtorch_cpu.so or version.py)")
  endif()
  file(STRINGS "${SPMDX_TORCH_ROOT}/version.py" _version REGEX "^__version__")
  string(REGEX REPLACE ".*= *['\"]([^'\"]+)['\"].*" "\\1" SPMDX_TORCH_VERSION "${_version}")
else()
  set(_python "${SPMDX_VENV}/bin/python")
  if(NOT EXISTS "${_python}")
    message(FATAL_ERROR "No Python environment at ${SPMDX_VENV}: run scripts/setup first "
                        "(or pass -DSPMDX_VENV=..., -DSPMDX_TORCH_ROOT=..., or -DSPMDX_WITH_TORCH=OFF)")
  endif()
  execute_process(
    COMMAND "${_python}" -c "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__)"
    OUTPUT_VARIABLE _out RESULT_VARIABLE _rc ERROR_VARIABLE _err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "torch is not importable from ${_python}: ${_err}\nRun scripts/setup.")
  endif()
  string(REPLACE "\n" ";" _out "${_out}")
  list(GET _out 0 _root)
  list(GET _out 1 SPMDX_TORCH_VERSION)
  set(SPMDX_TORCH_ROOT "${_root}")  # shadows the empty cache entry for this configure only
endif()
message(STATUS "LibTorch ${SPMDX_TORCH_VERSION} (CPU) from ${SPMDX_TORCH_ROOT}")

add_library(spmdx::torch_cpu INTERFACE IMPORTED)
set_target_properties(spmdx::torch_cpu PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${SPMDX_TORCH_ROOT}/include;${SPMDX_TORCH_ROOT}/include/torch/csrc/api/include"
  INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${SPMDX_TORCH_ROOT}/include;${SPMDX_TORCH_ROOT}/include/torch/csrc/api/include"
  INTERFACE_LINK_LIBRARIES "${SPMDX_TORCH_ROOT}/lib/libtorch_cpu.so;${SPMDX_TORCH_ROOT}/lib/libc10.so"
  INTERFACE_LINK_OPTIONS "LINKER:-rpath,${SPMDX_TORCH_ROOT}/lib")

# The CUDA side (libspmdx_cuda: the CUDA Device; the nccl plugin's tests), built where the CUDA
# toolkit (headers, cudart) and a CUDA LibTorch (libtorch_cuda) are both found. Machines without
# a GPU build and link it too; what needs a GPU skips there.
set(SPMDX_HAVE_CUDA OFF)
if(SPMDX_WITH_CUDA)
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND)
    message(STATUS "spmdx: CUDA parts not built: no CUDA toolkit (set CUDA_HOME, or CUDAToolkit_ROOT)")
  elseif(NOT EXISTS "${SPMDX_TORCH_ROOT}/lib/libtorch_cuda.so")
    message(STATUS "spmdx: CUDA parts not built: LibTorch ${SPMDX_TORCH_VERSION} has no libtorch_cuda.so (a CPU-only torch)")
  else()
    set(SPMDX_HAVE_CUDA ON)
    message(STATUS "spmdx: CUDA parts built (CUDA toolkit ${CUDAToolkit_VERSION}, LibTorch ${SPMDX_TORCH_VERSION}); -DSPMDX_WITH_CUDA=OFF leaves them out")
    # --no-as-needed: nothing in our objects names a symbol of libtorch_cuda, yet it must load
    # (its static initialisers register ATen's CUDA kernels); Debian's gcc passes --as-needed.
    # -rpath-link: libtorch_cuda needs libraries of the wheel's nvidia-* packages at link time.
    file(GLOB _nvidia_libs LIST_DIRECTORIES true "${SPMDX_TORCH_ROOT}/../nvidia/*/lib")
    set(_rpath_link "")
    foreach(_d IN LISTS _nvidia_libs)
      list(APPEND _rpath_link "LINKER:-rpath-link,${_d}")
    endforeach()
    add_library(spmdx::torch_cuda INTERFACE IMPORTED)
    set_target_properties(spmdx::torch_cuda PROPERTIES
      INTERFACE_LINK_LIBRARIES "spmdx::torch_cpu;-Wl,--no-as-needed;${SPMDX_TORCH_ROOT}/lib/libtorch_cuda.so;${SPMDX_TORCH_ROOT}/lib/libc10_cuda.so;-Wl,--as-needed;CUDA::cudart"
      INTERFACE_LINK_OPTIONS "${_rpath_link}")
  endif()
else()
  message(STATUS "spmdx: CUDA parts not built (-DSPMDX_WITH_CUDA=OFF)")
endif()
