# Run by ctest as "PublicHeaders.IncludeNoSpi" (cpp/tests/CMakeLists.txt):
#   cmake -DCXX=<compiler> -DINCLUDE_DIR=<cpp/include> -P check_public_headers.cmake
# Every header directly in pdkv/ or pdkv/options/ is public (for users). Each must
# compile on its own, and none may pull in a header of pdkv/spi/ (the transport
# authors' interface), directly or through another header. -H lists every header the
# compiler opens, so an include added anywhere in the chain is caught.
file(GLOB _headers RELATIVE ${INCLUDE_DIR} ${INCLUDE_DIR}/pdkv/*.h ${INCLUDE_DIR}/pdkv/options/*.h)
if(NOT _headers)
  message(FATAL_ERROR "no public headers found under ${INCLUDE_DIR}/pdkv")
endif()
set(_failed 0)
foreach(_h IN LISTS _headers)
  execute_process(COMMAND ${CXX} -std=c++17 -fsyntax-only -H -x c++ -I${INCLUDE_DIR} ${INCLUDE_DIR}/${_h}
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _opened RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(SEND_ERROR "public header ${_h} does not compile on its own:\n${_opened}")
    set(_failed 1)
  elseif(_opened MATCHES "pdkv/spi/[A-Za-z0-9_]+\\.h")
    message(SEND_ERROR "public header ${_h} includes the SPI header ${CMAKE_MATCH_0}; "
                       "public headers are for users and must not expose the transport interface")
    set(_failed 1)
  else()
    message(STATUS "${_h}: self-contained, no SPI header")
  endif()
endforeach()
if(_failed)
  message(FATAL_ERROR "public header check failed")
endif()
