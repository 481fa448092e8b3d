/* span_ctx.bpf.c: owner of the per-thread span context map (tid → trace id,
 * span id, modality) that every process-context probe stamps its events from.
 * Loaded first; the other programs reach the map as an extern table. */
#define SPANLET_SPAN_CTX_OWNER 1
#include "spanlet.h"
