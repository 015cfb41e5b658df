# Turns a binary file into a C++ byte array: cmake -DIN=file -DOUT=file.cc [-DNAME=symbol] -P embed.cmake
# (NAME defaults to kPdkvBatchCopyFatbin; the size is ${NAME}Size).
if(NOT NAME)
  set(NAME kPdkvBatchCopyFatbin)
endif()
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR size "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
file(WRITE ${OUT} "// Generated from ${IN}; do not edit.\n")
file(APPEND ${OUT} "alignas(8) extern const unsigned char ${NAME}[] = {${bytes}};\n")
file(APPEND ${OUT} "extern const unsigned long ${NAME}Size = ${size};\n")
