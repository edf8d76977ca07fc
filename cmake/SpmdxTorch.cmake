# LibTorch (CPU part) from the PyPI torch wheel in the project's Python environment.
#
# Defines spmdx::torch_cpu: ATen/c10 headers and libtorch_cpu + libc10. We do not use the
# wheel's TorchConfig.cmake: the wheel is built with CUDA, and its config links libtorch_cuda,
# which needs the CUDA libraries of the wheel's pip dependencies rather than the system
# toolkit's. The CPU executor needs neither.
set(_python "${SPMDX_VENV}/bin/python")
if(NOT EXISTS "${_python}")
  message(FATAL_ERROR "No Python environment at ${SPMDX_VENV}: run scripts/setup first "
                      "(or pass -DSPMDX_VENV=..., or -DSPMDX_WITH_TORCH=OFF)")
endif()
execute_process(
  COMMAND "${_python}" -c "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__)"
  OUTPUT_VARIABLE _out RESULT_VARIABLE _rc ERROR_VARIABLE _err OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "torch is not importable from ${_python}: ${_err}\nRun scripts/setup.")
endif()
string(REPLACE "\n" ";" _out "${_out}")
list(GET _out 0 SPMDX_TORCH_ROOT)
list(GET _out 1 SPMDX_TORCH_VERSION)
message(STATUS "LibTorch ${SPMDX_TORCH_VERSION} (CPU) from ${SPMDX_TORCH_ROOT}")

add_library(spmdx::torch_cpu INTERFACE IMPORTED)
set_target_properties(spmdx::torch_cpu PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${SPMDX_TORCH_ROOT}/include;${SPMDX_TORCH_ROOT}/include/torch/csrc/api/include"
  INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${SPMDX_TORCH_ROOT}/include;${SPMDX_TORCH_ROOT}/include/torch/csrc/api/include"
  INTERFACE_LINK_LIBRARIES "${SPMDX_TORCH_ROOT}/lib/libtorch_cpu.so;${SPMDX_TORCH_ROOT}/lib/libc10.so"
  INTERFACE_LINK_OPTIONS "LINKER:-rpath,${SPMDX_TORCH_ROOT}/lib")
