# pdkv_embed_fatbin(<kernel.cu> <symbol> <what>): compiles a CUDA kernel file into a
# fatbin (sm_80, sm_90 and compute_90 PTX for later GPUs) with nvcc and embeds it into
# pdkv_core as `symbol` (bytes) and `symbol`Size; without nvcc the array is empty
# (size 0) and callers take their no-kernel path. The kernels are loaded at run time
# with cuModuleLoadData: no CUDA runtime dependency.
find_program(PDKV_NVCC nvcc HINTS ENV CUDACXX /usr/local/cuda/bin)

function(pdkv_embed_fatbin kernel symbol what)
  get_filename_component(_name ${kernel} NAME_WE)
  set(_cc ${CMAKE_CURRENT_BINARY_DIR}/${_name}_fatbin.cc)
  if(PDKV_NVCC)
    set(_fatbin ${CMAKE_CURRENT_BINARY_DIR}/${_name}.fatbin)
    get_filename_component(_dir ${kernel} DIRECTORY)
    file(GLOB _headers ${_dir}/*.h)
    add_custom_command(
      OUTPUT ${_fatbin}
      COMMAND ${PDKV_NVCC} -fatbin -O3 -I${_dir}
              -gencode arch=compute_80,code=sm_80
              -gencode arch=compute_90,code=sm_90
              -gencode arch=compute_90,code=compute_90
              -o ${_fatbin} ${kernel}
      DEPENDS ${kernel} ${_headers}
      COMMENT "nvcc: ${what} -> fatbin")
    add_custom_command(
      OUTPUT ${_cc}
      COMMAND ${CMAKE_COMMAND} -DIN=${_fatbin} -DOUT=${_cc} -DNAME=${symbol} -P ${PROJECT_SOURCE_DIR}/cpp/cmake/embed.cmake
      DEPENDS ${_fatbin} ${PROJECT_SOURCE_DIR}/cpp/cmake/embed.cmake)
    # pdkv_core lives in another directory: build the file through a custom target.
    add_custom_target(${symbol}_target DEPENDS ${_cc})
    add_dependencies(pdkv_core ${symbol}_target)
    set_source_files_properties(${_cc} TARGET_DIRECTORY pdkv_core PROPERTIES GENERATED TRUE)
    message(STATUS "pdkv: ${what} built with ${PDKV_NVCC}")
  else()
    file(WRITE ${_cc} "extern const unsigned char ${symbol}[] = {0};\nextern const unsigned long ${symbol}Size = 0;\n")
    message(STATUS "pdkv: nvcc not found; no ${what}")
  endif()
  target_sources(pdkv_core PRIVATE ${_cc})
endfunction()
