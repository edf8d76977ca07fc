#pragma once
#include "spmdx/files.h"  // moved to interfaces/ (a host service of the plugin ABI)
