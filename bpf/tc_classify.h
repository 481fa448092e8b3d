/* tc_classify.h: the constants and structs of tc_classify.bpf.c (its maps'
 * keys and values, the per-packet state, the request scratch) and the word
 * helpers its parsers share. The agent reads these structs as BCC lays them out. */
#ifndef TC_CLASSIFY_H
#define TC_CLASSIFY_H

#include "spanlet.h"

#ifndef SPANLET_TC_MAX_FLOWS
#define SPANLET_TC_MAX_FLOWS 65536
#endif
/* Bytes of a request's first packet searched for headers (cfg.tc.http_scan_bytes). */
#ifndef SPANLET_TC_SCAN_BYTES
#define SPANLET_TC_SCAN_BYTES 512
#endif
/* A media packet is late when |D| exceeds tau_plc + delta_buffer, in ns. */
#ifndef SPANLET_TC_LATE_NS
#define SPANLET_TC_LATE_NS 40000000ULL
#endif
#ifndef SPANLET_TC_PORT_MAX
#define SPANLET_TC_PORT_MAX 4096
#endif

/* Slack after the scan window so that fixed-length reads at a header found
 * near its end stay inside the buffer (the longest is the traceparent value). */
#define TC_SCAN_SLACK 128
#define TC_PATH_MAX 128
/* Header lines of a request looked at (the rest are not). */
#define TC_MAX_LINES 64

/* Where a flow's modality came from; a higher source is never overridden. */
#define MOD_SRC_NONE 0
#define MOD_SRC_CONTENT 1
#define MOD_SRC_RTP 2
#define MOD_SRC_PORT 3

/* HTTP methods (agent/probes/tc/probe.py: Method). */
#define METHOD_GET 1
#define METHOD_POST 2
#define METHOD_PUT 3
#define METHOD_DELETE 4
#define METHOD_HEAD 5
#define METHOD_OPTIONS 6
#define METHOD_PATCH 7
#define METHOD_CONNECT 8
#define METHOD_TRACE 9

/* Why a packet was not counted (index of tc_uncounted_packets_total). */
#define SKIP_FRAGMENT 0     /* IPv4 non-first fragment, IPv6 extension header */
#define SKIP_NONLINEAR 1    /* headers not in the linear part of the skb */
#define SKIP_N 2

/* What the classifier looked at and would not use (index of
 * spanlet_tc_rejected_total; agent/probes/tc/probe.py: Rejected). */
#define REJECT_TRACEPARENT_INVALID 0   /* not a valid W3C traceparent value */
#define REJECT_TRACEPARENT_TRUNCATED 1 /* value not whole in the scanned bytes */
#define REJECT_TRACEPARENT_DUPLICATE 2 /* several traceparent headers: none used */
#define REJECT_RTP_INVALID 3           /* RTP flow datagram failing RFC 3550 A.1 */
#define REJECT_RTP_UNKNOWN_PT 4        /* RTP data packet of an unconfigured payload type */
#define REJECT_HEADER_INVALID 5        /* IP/TCP/UDP header impossible for the packet's length */
#define REJECT_N 6

struct flow_counters {
    __u64 packets[2];   /* by SPANLET_DIR_* */
    __u64 bytes[2];     /* skb->len: what TC sees, Ethernet header included */
    /* CLS_*: what this CPU knows of the flow's class `cls` (the slot of the
     * class totals): settled (see settled()), every packet skips flow_info;
     * or the class at its last payload packet, for packets without payload. */
    __u32 settled;
    __u32 cls;
    __u64 last_ns;      /* bpf_ktime_get_coarse_ns() of this CPU's last packet (idle flows) */
};

/* Class totals (metrics 3 and 4): one slot per (protocol, modality), index
 * class_of(). A packet is added to its flow's class when it is counted, so
 * a flow that leaves the per-flow maps (idle, LRU eviction) takes nothing
 * from them. */
#define TC_MOD_N 5         /* SPANLET_MOD_OTHER .. SPANLET_MOD_VIDEO */
#define TC_PROTO_N 8       /* SPANLET_PROTO_*, 3 bits */
#define TC_CLASSES (TC_PROTO_N * TC_MOD_N)

struct class_traffic {
    __u64 packets[2];   /* by SPANLET_DIR_* */
    __u64 bytes[2];
};

/* Packets of a TCP flow counted before its class is known (the handshake),
 * added to the class the flow ends up with when its first payload packet
 * classifies it, to tcp when a FIN or RST ends it first, and by the agent to
 * tcp once older than its pending grace. */
struct pending_traffic {
    __u64 packets[2];
    __u64 bytes[2];
    __u64 first_ns;     /* bpf_ktime_get_ns() of the first packet */
};

#define CLS_NONE 0
#define CLS_LAST 1
#define CLS_FINAL 2

struct jitter_counters {
    __u64 media_packets;
    __u64 late_packets;
};

struct jitter_state {
    __u64 last_arrival_ns;
    __u64 last_gap_ns;      /* previous inter-arrival time (IPDV) */
    __u64 jitter_x16_ns;    /* RFC 3550 running jitter J, times 16 */
    __u32 last_rtp_ts;
    __u32 seen;             /* media packets seen, saturating at 2 */
};

struct flow_info {
    struct jitter_state jit[2];  /* by SPANLET_DIR_* */
    __u8 proto;                  /* SPANLET_PROTO_*, UNKNOWN while a TCP flow has no payload */
    __u8 modality;
    __u8 mod_source;             /* MOD_SRC_* */
    __u8 _pad[5];
};

/* What media_packet() made of a packet (added to the class totals with it). */
#define MEDIA_NONE 0
#define MEDIA_ON_TIME 1
#define MEDIA_LATE 2

struct rtp_pt_info {
    __u32 clock_hz;   /* 0: not a configured payload type */
    __u8 modality;
    __u8 _pad[3];
};

/* What the parser learned about one packet. */
struct pkt {
    struct flow_key key;  /* canonical: the lower (address, port) end first */
    __u32 payload_off;    /* from the start of the frame */
    __u32 payload_len;
    __u8 swapped;         /* the packet travels from key.daddr to key.saddr */
    __u8 tcp_end;         /* a TCP packet with FIN or RST */
    __u8 _pad[6];
};

/* Per-CPU scratch: the request packet handed to tc_classify_req (tail call),
 * its first bytes, and what the header scan found there. */
struct tc_scratch {
    struct pkt pkt;
    __u32 dir;
    __u32 method;
    __u32 method_len;
    __u32 traceparent_at;    /* offset of the header name + 1; 0: absent */
    __u32 traceparent_dup;   /* a second traceparent header was found */
    __u32 content_type_at;
    __u32 upgrade_at;
    __u32 scan_len;          /* valid bytes in buf */
    __u32 lines;             /* header lines found (line_at) */
    __u32 media;             /* media_packet() of the packet: MEDIA_* */
    __u32 was_pending;       /* the flow had no class before the packet */
    __u32 line_at[TC_MAX_LINES];
    __u8 buf[SPANLET_TC_SCAN_BYTES + TC_SCAN_SLACK];
};

/* The request in progress on an HTTP/1.x connection (http_request_bytes). */
struct http_request {
    __u8 trace_id[16];
    __u64 parent_id;
    __u64 bytes[2];
    __u8 req_dir;
    __u8 _pad[7];
};

/* Bytes as little-endian words, for comparing several at once. */
#define C2(a, b) ((__u64)(a) | ((__u64)(b) << 8))
#define C4(a, b, c, d) (C2(a, b) | (C2(c, d) << 16))
#define C8(a, b, c, d, e, f, g, h) (C4(a, b, c, d) | (C4(e, f, g, h) << 32))
#define LOWER8 0x2020202020202020ULL
#define LOWER4 0x20202020ULL

static __always_inline __u64 ld64(const __u8 *p) { return *(const __u64 *)p; }
static __always_inline __u32 ld32(const __u8 *p) { return *(const __u32 *)p; }

/* Keep the compiler from testing a copy of v while the access uses another
 * (the verifier then sees an unbounded offset). */
#define BOUND_VAR(v) asm volatile("" : "+r"(v))
/* Largest offset of a header value; every fixed-length read after it stays
 * below SPANLET_TC_SCAN_BYTES + TC_SCAN_SLACK. */
#define VALUE_MAX (SPANLET_TC_SCAN_BYTES + 24)

static __always_inline __u64 abs_diff(__u64 a, __u64 b)
{
    return a < b ? b - a : a - b;
}

#endif /* TC_CLASSIFY_H */
