/* Fuzz target: spanlet._wire.serving_spans on any bytes as a serialized
 * ResourceSpans (the serving metrics' pick of request and first-token spans). */
#include "../native/spanlet_wire.c"
#include "harness.h"

BYTES_TARGET(serving_spans)
