# -Wall -Wextra -Werror on the project's own code (not on third-party headers, which come in
# as SYSTEM includes).
function(spmdx_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
endfunction()
