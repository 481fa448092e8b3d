/* The span marker that agent/client.py calls on every span start and end; the
 * agent's uprobe on spanlet_mark (bpf/span_ctx.bpf.c) reads its arguments. */

/*
 * Built by the top-level Makefile with exactly
 *     $(CC) -O2 -fPIC -shared -o agent/_native/libspanlet_marker.so native/spanlet_marker.c
 * The test build adds -DSPANLET_MARKER_RECORD, which makes spanlet_mark also keep
 * a bounded log of its calls (tests/unit/test_client.py); the production build
 * contains none of that code.
 *
 * ABI (x86-64 SysV, all four arguments in registers, read by the uprobe at entry):
 *   rdi = trace_hi   high 64 bits of the 128-bit trace id (big-endian bytes 0..7)
 *   rsi = trace_lo   low 64 bits (bytes 8..15)
 *   rdx = span_id    the 64-bit span id; 0 means "this thread is in no span"
 *   ecx = modality   0 other, 1 text, 2 image, 3 audio, 4 video (agent/events.py)
 * A change to that contract, or to spanlet_mark_halves (the entry point the
 * Python client calls, below), bumps SPANLET_MARKER_ABI_VERSION, which the
 * client checks before it uses the library.
 */

#ifdef SPANLET_MARKER_RECORD
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <stdint.h>

#ifndef SPANLET_MARKER_ABI_VERSION /* -D only to test the client's version check */
#define SPANLET_MARKER_ABI_VERSION 1
#endif
#define SPANLET_EXPORT __attribute__((visibility("default"), noinline, used))

#ifdef SPANLET_MARKER_RECORD
/* Big enough for every test; calls past it are counted but not kept. */
#define SPANLET_MARKER_RECORD_CAP 65536

struct spanlet_marker_record {
	uint64_t trace_hi;
	uint64_t trace_lo;
	uint64_t span_id;
	uint32_t modality;
	uint32_t tid;
};

static struct spanlet_marker_record records[SPANLET_MARKER_RECORD_CAP];
static uint64_t records_seen;

static void record(uint64_t trace_hi, uint64_t trace_lo, uint64_t span_id, uint32_t modality)
{
	uint64_t slot = __atomic_fetch_add(&records_seen, 1, __ATOMIC_RELAXED);

	if (slot >= SPANLET_MARKER_RECORD_CAP)
		return;
	records[slot] = (struct spanlet_marker_record){
		.trace_hi = trace_hi,
		.trace_lo = trace_lo,
		.span_id = span_id,
		.modality = modality,
		.tid = (uint32_t)syscall(SYS_gettid),
	};
}

/* Number of calls since the last reset, kept or not. */
SPANLET_EXPORT uint64_t spanlet_marker_record_count(void)
{
	return __atomic_load_n(&records_seen, __ATOMIC_ACQUIRE);
}

/* Copies call number `index` into *out; returns 0, or -1 if it was not kept. */
SPANLET_EXPORT int spanlet_marker_record_get(uint64_t index, struct spanlet_marker_record *out)
{
	if (index >= SPANLET_MARKER_RECORD_CAP || index >= spanlet_marker_record_count())
		return -1;
	*out = records[index];
	return 0;
}

SPANLET_EXPORT void spanlet_marker_record_reset(void)
{
	__atomic_store_n(&records_seen, 0, __ATOMIC_RELEASE);
}
#endif /* SPANLET_MARKER_RECORD */

/*
 * Where the uprobe goes on x86-64: a 5-byte NOP. Since Linux 6.18
 * (arch_uprobe_optimize, "uprobes/x86: Add support to optimize uprobes") a
 * uprobe on exactly this instruction is turned, after its first hit, into a
 * call to a trampoline instead of an int3 trap: under 1 µs a hit instead of
 * about 7 µs, measured on the 6.18 VM this was written on. Older kernels trap
 * on it like on any instruction. At -O2 it is the function's first instruction
 * (unless the compiler adds endbr64 for -fcf-protection: then it follows at +4).
 */
#if defined(__x86_64__)
#define SPANLET_PROBE_SITE ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00" /* nopl 0x0(%rax,%rax,1) */
#else
#define SPANLET_PROBE_SITE ""
#endif

/*
 * The probed function. Its whole production body is the probe-site NOP in an
 * asm that claims to read the arguments and clobber memory, so the compiler
 * can neither drop the call site's argument setup nor fold this function into
 * another one.
 */
SPANLET_EXPORT void spanlet_mark(uint64_t trace_hi, uint64_t trace_lo, uint64_t span_id,
				 uint32_t modality)
{
	__asm__ volatile(SPANLET_PROBE_SITE : : "r"(trace_hi), "r"(trace_lo), "r"(span_id),
			 "r"(modality) : "memory");
#ifdef SPANLET_MARKER_RECORD
	record(trace_hi, trace_lo, span_id, modality);
#endif
}

/*
 * What the Python client calls instead of spanlet_mark. ctypes converts a
 * uint64_t argument through a temporary c_uint64 object (1.3 µs a call against
 * 0.4 µs without, measured; the client's budget is 1.5 µs per span edge), but
 * passes a Python int below 2**32 with no argtypes as it is; so the ids arrive as
 * 32-bit halves and are joined here. The call to spanlet_mark is a real call
 * (it is noinline and interposable), so the uprobe on it fires.
 */
SPANLET_EXPORT void spanlet_mark_halves(uint32_t trace_hi_hi, uint32_t trace_hi_lo,
					uint32_t trace_lo_hi, uint32_t trace_lo_lo,
					uint32_t span_id_hi, uint32_t span_id_lo, uint32_t modality)
{
	spanlet_mark((uint64_t)trace_hi_hi << 32 | trace_hi_lo,
		     (uint64_t)trace_lo_hi << 32 | trace_lo_lo,
		     (uint64_t)span_id_hi << 32 | span_id_lo, modality);
}

SPANLET_EXPORT uint32_t spanlet_marker_abi_version(void)
{
	return SPANLET_MARKER_ABI_VERSION;
}
