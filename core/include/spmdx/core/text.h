#pragma once
#include "spmdx/text.h"  // moved to interfaces/ (a host service of the plugin ABI)
