# Post-link check (cmake -DLIB=<library> -DCXX=<compiler> -P check_libstdcxx.cmake): the op
# library must take libstdc++ from the shared libstdc++.so.6 that torch loads, not carry a copy of
# its own. A compiler that links libstdc++ statically, or whose newer libstdc++ defines symbols
# inside the library, gives a library that segfaults when torch formats its first error message
# (seen with CXX=/opt/gcc/bin/g++ on this workplace's GPU machine, where this check found 146
# such symbols, 2026-11-22). Stops the build with the fix and removes the library.
find_program(_readelf readelf)
find_program(_nm nm)
if(NOT _readelf OR NOT _nm)
  message(STATUS "flashcute: readelf/nm not found; skipping the libstdc++ check")
  return()
endif()
execute_process(COMMAND ${_readelf} -d ${LIB} OUTPUT_VARIABLE _dyn ERROR_QUIET)
# Defined (not imported) symbols of libstdc++'s own implementation: locale, ios_base, the
# exception throw helpers, the C++ runtime's __cxa_* entry points.
execute_process(COMMAND ${_nm} --defined-only ${LIB} OUTPUT_VARIABLE _defined ERROR_QUIET)
string(REGEX MATCHALL "[ \t](_ZNSt6locale[A-Za-z0-9_]*|_ZNSt8ios_base[A-Za-z0-9_]*|__cxa_throw|__cxa_allocate_exception|_ZSt[0-9]+__throw_[A-Za-z0-9_]*)\n"
       _own "${_defined}")
if(NOT _dyn MATCHES "libstdc\\+\\+\\.so" OR _own)
  list(LENGTH _own _n)
  file(REMOVE ${LIB})  # nobody may load it by accident (FLASHCUTE_LIBRARY pointing at the build tree)
  message(FATAL_ERROR
    "flashcute: ${LIB} carries its own copy of libstdc++ (${_n} libstdc++ symbols defined inside it"
    "${_dyn_msg}), built by the C++ compiler ${CXX}. torch loads the system's libstdc++.so.6; a library "
    "built this way crashes when torch formats an error. Rebuild with the compiler torch was built "
    "with, e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ bash scripts/install.sh")
endif()
