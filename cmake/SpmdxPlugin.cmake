# spmdx_add_plugin(NAME SOURCES src... [OUTPUT_DIRECTORY dir] [NO_INSTALL])
#
# Builds a plugin: a MODULE library libspmdx_<NAME>.so against spmdx::host, the host services of
# the plugin ABI (which brings the ABI headers of interfaces/), as C++20, with hidden symbols
# except the SPMDX_PLUGIN entry point. Linked with -z defs: every symbol the plugin uses must
# come from the host services, the C++ runtime or a library the plugin links itself, so a
# plugin that calls any other spmdx symbol fails to link ("undefined reference to ...").
# In the spmdx tree it lands in build/lib/spmdx/plugins and installs to lib/spmdx/plugins;
# out of tree (after find_package(spmdx)) it lands in OUTPUT_DIRECTORY, or the current
# binary folder; point SPMDX_PLUGIN_PATH or --plugin-path there.
function(spmdx_add_plugin name)
  cmake_parse_arguments(arg "NO_INSTALL" "OUTPUT_DIRECTORY" "SOURCES" ${ARGN})
  if(NOT arg_SOURCES)
    message(FATAL_ERROR "spmdx_add_plugin(${name}): SOURCES is empty")
  endif()
  add_library(${name} MODULE ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE spmdx::host)
  target_link_options(${name} PRIVATE "LINKER:-z,defs")
  set(out "${arg_OUTPUT_DIRECTORY}")
  if(NOT out AND DEFINED SPMDX_PLUGIN_OUTPUT_DIR)
    set(out "${SPMDX_PLUGIN_OUTPUT_DIR}")
  endif()
  if(NOT out)
    set(out "${CMAKE_CURRENT_BINARY_DIR}")
  endif()
  set_target_properties(${name} PROPERTIES
    PREFIX "lib"
    OUTPUT_NAME "spmdx_${name}"
    LIBRARY_OUTPUT_DIRECTORY "${out}"
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    CXX_STANDARD 20  # the standard of the ABI (interfaces/spmdx/plugin.h) and of the host
    CXX_STANDARD_REQUIRED ON
    CXX_EXTENSIONS OFF)
  if(TARGET spmdx_host)  # in the spmdx tree: the host services library is two folders up
    set_target_properties(${name} PROPERTIES BUILD_RPATH "$ORIGIN/../.." INSTALL_RPATH "$ORIGIN/../..")
    if(COMMAND spmdx_warnings)
      spmdx_warnings(${name})
    endif()
    if(NOT arg_NO_INSTALL)
      install(TARGETS ${name} LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}/spmdx/plugins")
    endif()
  endif()
endfunction()
