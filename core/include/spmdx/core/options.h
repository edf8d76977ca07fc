#pragma once
#include "spmdx/options.h"  // moved to interfaces/ (a host service of the plugin ABI)
