// From one logical graph to per-rank graphs: propagation (propagate.h), redistribution
// (redistribute.h) and the Rewriter (rewriter.h), included together for code that uses all
// three.
#pragma once

#include "spmdx/sharding/propagate.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/sharding/rewriter.h"
