/* Fuzz target: spanlet._wire.valid_spans on any bytes as a serialized
 * ExportTraceServiceRequest (the receiver's id check, the first native code an
 * OTLP sender's bytes reach). */
#include "../native/spanlet_wire.c"
#include "harness.h"

BYTES_TARGET(valid_spans)
