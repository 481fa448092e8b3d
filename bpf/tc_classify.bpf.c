/* tc_classify.bpf.c: TC clsact classifier (ingress and egress). Per flow: protocol
 * class, modality, packets/bytes per direction, RTP/IPDV jitter for the Jitter
 * Sensitivity Score, and the W3C traceparent of plain HTTP/1.x requests.
 * Never drops or alters a packet: every path returns TC_PASS. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include "spanlet.h"

/* The verdict of every path. TC_ACT_UNSPEC passes the packet untouched, as
 * TC_ACT_OK does, but also lets the filters after ours run: TC_ACT_OK would
 * end the clsact chain and silently disable another tool's filter with a
 * higher pref (tests/kernel/test_tc.py checks a later filter still runs). */
#define TC_PASS TC_ACT_UNSPEC

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

/* HTTP methods (agent/probes/tc.py: Method). */
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
 * spanlet_tc_rejected_total; agent/probes/tc.py: Rejected). */
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
    /* This CPU found the flow settled (see settled()): it skips flow_info. */
    __u64 settled;
};

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
    __u8 _pad[7];
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
    __u32 line_at[TC_MAX_LINES];
    __u8 buf[SPANLET_TC_SCAN_BYTES + TC_SCAN_SLACK];
};

/* Metric 3 (spanlet_network_bytes_total): packets and bytes per flow and direction. */
BPF_TABLE("lru_percpu_hash", struct flow_key, struct flow_counters,
          spanlet_network_bytes_total, SPANLET_TC_MAX_FLOWS);
/* Metric 4 (spanlet_jitter_sensitivity_score): media and late packets per flow. */
BPF_TABLE("lru_percpu_hash", struct flow_key, struct jitter_counters,
          spanlet_jitter_sensitivity_score, SPANLET_TC_MAX_FLOWS);
BPF_TABLE("lru_hash", struct flow_key, struct flow_info, flow_info, SPANLET_TC_MAX_FLOWS);

/* The request in progress on each HTTP/1.x connection that carried a
 * traceparent, and its wire bytes so far (kernel.net.rx_bytes/tx_bytes of
 * the server span): replaced, and sent as an http_bytes_event, when the next
 * request on the connection starts. */
struct http_request {
    __u8 trace_id[16];
    __u64 parent_id;
    __u64 bytes[2];
    __u8 req_dir;
    __u8 _pad[7];
};
BPF_TABLE("lru_hash", struct flow_key, struct http_request, http_request_bytes,
          SPANLET_TC_MAX_FLOWS);
/* Configuration pushed by the agent at start. */
BPF_HASH(tc_port_modality, __u16, __u8, SPANLET_TC_PORT_MAX);
BPF_ARRAY(tc_rtp_payload_types, struct rtp_pt_info, 128);
BPF_PERCPU_ARRAY(tc_scratch, struct tc_scratch, 1);
BPF_PERCPU_ARRAY(tc_uncounted_packets_total, __u64, SKIP_N);
BPF_PERCPU_ARRAY(spanlet_tc_rejected_total, __u64, REJECT_N);
/* Slot 0: tc_classify_req. Request parsing is a program of its own so that
 * the verifier walks the header scan once, not once per path leading to it. */
BPF_PROG_ARRAY(tc_request_parser, 1);

#define C2(a, b) ((__u64)(a) | ((__u64)(b) << 8))
#define C4(a, b, c, d) (C2(a, b) | (C2(c, d) << 16))
#define C8(a, b, c, d, e, f, g, h) (C4(a, b, c, d) | (C4(e, f, g, h) << 32))
#define LOWER8 0x2020202020202020ULL
#define LOWER4 0x20202020ULL

static __always_inline __u64 ld64(const __u8 *p) { return *(const __u64 *)p; }
static __always_inline __u32 ld32(const __u8 *p) { return *(const __u32 *)p; }

static __always_inline void count_uncounted(int why)
{
    __u64 *n = tc_uncounted_packets_total.lookup(&why);
    if (n)
        *n += 1;
}

static __always_inline void count_rejected(int why)
{
    __u64 *n = spanlet_tc_rejected_total.lookup(&why);
    if (n)
        *n += 1;
}

/* 1 when (a, pa) sorts after (b, pb), so the key is written with b first. */
static __always_inline int end_after(const __u8 *a, __u16 pa, const __u8 *b, __u16 pb)
{
    __u64 a0 = ld64(a), b0 = ld64(b), a1 = ld64(a + 8), b1 = ld64(b + 8);
    if (a0 != b0)
        return a0 > b0;
    if (a1 != b1)
        return a1 > b1;
    return pa > pb;
}

static __always_inline void canonicalize(struct pkt *p)
{
    struct flow_key *k = &p->key;
    if (!end_after(k->saddr, k->sport, k->daddr, k->dport))
        return;
    __u8 tmp[16];
    __builtin_memcpy(tmp, k->saddr, 16);
    __builtin_memcpy(k->saddr, k->daddr, 16);
    __builtin_memcpy(k->daddr, tmp, 16);
    __u16 port = k->sport;
    k->sport = k->dport;
    k->dport = port;
    p->swapped = 1;
}

/* A header reaches past data_end, which ends at `end` bytes into the frame:
 * the packet is too short to hold it (malformed), or its headers are outside
 * the linear data of the skb. */
static __always_inline void count_short(struct __sk_buff *skb, __u32 end)
{
    if (end > skb->len)
        count_rejected(REJECT_HEADER_INVALID);
    else
        count_uncounted(SKIP_NONLINEAR);
}

/* Parse Ethernet / IPv4|IPv6 / TCP|UDP with direct packet access.
 * 0: a TCP or UDP packet to count; <0: not ours to count. A packet whose IP
 * length leaves no room for its L4 header, or whose TCP data offset is under
 * 5 words, is counted, but as carrying no payload. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    __u32 l3_len, l4_off, l4_hdr;
    __u8 l4proto;

    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = data + ETH_HLEN;
        if ((void *)(ip + 1) > data_end) {
            count_short(skb, ETH_HLEN + sizeof(*ip));
            return -1;
        }
        if (ip->ihl < 5) {
            count_rejected(REJECT_HEADER_INVALID);
            return -1;
        }
        l4proto = ip->protocol;
        if (l4proto != IPPROTO_TCP && l4proto != IPPROTO_UDP)
            return -1;
        if (ip->frag_off & bpf_htons(0x1fff)) {
            count_uncounted(SKIP_FRAGMENT);
            return -1;
        }
        __builtin_memcpy(p->key.saddr, &ip->saddr, 4);
        __builtin_memcpy(p->key.daddr, &ip->daddr, 4);
        p->key.family = 4;
        l4_off = ETH_HLEN + ip->ihl * 4;
        /* tot_len is 0 for BIG TCP super-packets; Ethernet padding is not IP. */
        l3_len = bpf_ntohs(ip->tot_len);
        if (l3_len == 0)
            l3_len = skb->len - ETH_HLEN;
        l3_len += ETH_HLEN;
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr *ip6 = data + ETH_HLEN;
        if ((void *)(ip6 + 1) > data_end) {
            count_short(skb, ETH_HLEN + sizeof(*ip6));
            return -1;
        }
        l4proto = ip6->nexthdr;
        if (l4proto != IPPROTO_TCP && l4proto != IPPROTO_UDP) {
            /* ICMPv6 is not a flow we classify; anything else is an extension header. */
            if (l4proto != IPPROTO_ICMPV6)
                count_uncounted(SKIP_FRAGMENT);
            return -1;
        }
        __builtin_memcpy(p->key.saddr, &ip6->saddr, 16);
        __builtin_memcpy(p->key.daddr, &ip6->daddr, 16);
        p->key.family = 6;
        l4_off = ETH_HLEN + sizeof(*ip6);
        l3_len = bpf_ntohs(ip6->payload_len);
        if (l3_len == 0)
            l3_len = skb->len - l4_off;
        l3_len += l4_off;
    } else {
        return -1;
    }

    /* l4_off is at most ETH_HLEN + 60: keep the verifier's bound explicit. */
    l4_off &= 0x7f;
    /* TCP and UDP both start with the two ports. */
    struct udphdr *l4 = data + l4_off;
    if ((void *)(l4 + 1) > data_end) {
        count_short(skb, l4_off + sizeof(*l4));
        return -1;
    }
    p->key.sport = bpf_ntohs(l4->source);
    p->key.dport = bpf_ntohs(l4->dest);
    l4_hdr = sizeof(*l4);
    if (l4proto == IPPROTO_TCP) {
        struct tcphdr *th = (void *)l4;
        if ((void *)(th + 1) > data_end) {
            count_short(skb, l4_off + sizeof(*th));
            return -1;
        }
        l4_hdr = th->doff * 4;
    }
    p->key.l4proto = l4proto;
    p->payload_off = l4_off + l4_hdr;
    if (l3_len > skb->len)
        l3_len = skb->len;
    p->payload_len = l3_len > p->payload_off ? l3_len - p->payload_off : 0;
    if (p->payload_off > l3_len || (l4proto == IPPROTO_TCP && l4_hdr < 20)) {
        count_rejected(REJECT_HEADER_INVALID);
        p->payload_len = 0;
    }
    canonicalize(p);
    return 0;
}

/* The flow key as the packet travels (source first), for events. */
static __always_inline void wire_key(const struct pkt *p, struct flow_key *out)
{
    *out = p->key;
    if (p->swapped) {
        __builtin_memcpy(out->saddr, p->key.daddr, 16);
        __builtin_memcpy(out->daddr, p->key.saddr, 16);
        out->sport = p->key.dport;
        out->dport = p->key.sport;
    }
}

static __always_inline void fill_net_hdr(struct spanlet_hdr *h, struct __sk_buff *skb,
                                         __u16 kind, __u8 modality, int dir)
{
    __builtin_memset(h, 0, sizeof(*h));
    h->ts_ns = bpf_ktime_get_ns();
    /* The sending socket's cgroup (the pod) is known on egress only. */
    if (dir == SPANLET_DIR_EGRESS)
        h->cgroup_id = bpf_skb_cgroup_id(skb);
    h->kind = kind;
    h->modality = modality;
}

static __always_inline void emit_flow_event(struct __sk_buff *skb, const struct pkt *p,
                                            const struct flow_info *fi, int dir)
{
    struct flow_event *ev = events.ringbuf_reserve(sizeof(*ev));
    if (!ev) {
        spanlet_count_drop();
        return;
    }
    fill_net_hdr(&ev->hdr, skb, SPANLET_KIND_FLOW, fi->modality, dir);
    wire_key(p, &ev->flow);
    ev->ifindex = skb->ifindex;
    ev->proto_class = fi->proto;
    ev->direction = dir;
    ev->_pad[0] = 0;
    ev->_pad[1] = 0;
    events.ringbuf_submit(ev, 0);
}

static __always_inline __u8 port_modality(const struct flow_key *k, __u8 *found)
{
    __u16 port = k->sport;
    __u8 *m = tc_port_modality.lookup(&port);
    if (!m) {
        port = k->dport;
        m = tc_port_modality.lookup(&port);
    }
    *found = m != 0;
    return m ? *m : SPANLET_MOD_OTHER;
}

/* ---- HTTP/1.x ------------------------------------------------------------ */

/* Method of a request line starting with `w` (first 8 bytes); 0 if none. */
static __always_inline __u8 http_method(__u64 w, __u32 *len)
{
    __u64 w4 = w & 0xffffffffULL, w5 = w & 0xffffffffffULL, w6 = w & 0xffffffffffffULL;
    if (w4 == C4('G', 'E', 'T', ' ')) { *len = 4; return METHOD_GET; }
    if (w5 == (C4('P', 'O', 'S', 'T') | ((__u64)' ' << 32))) { *len = 5; return METHOD_POST; }
    if (w4 == C4('P', 'U', 'T', ' ')) { *len = 4; return METHOD_PUT; }
    if (w5 == (C4('H', 'E', 'A', 'D') | ((__u64)' ' << 32))) { *len = 5; return METHOD_HEAD; }
    if ((w & 0xffffffffffffffULL) == (C4('D', 'E', 'L', 'E') | (C4('T', 'E', ' ', 0) << 32))) {
        *len = 7; return METHOD_DELETE;
    }
    if (w == C8('O', 'P', 'T', 'I', 'O', 'N', 'S', ' ')) { *len = 8; return METHOD_OPTIONS; }
    if (w6 == (C4('P', 'A', 'T', 'C') | (C2('H', ' ') << 32))) { *len = 6; return METHOD_PATCH; }
    if (w == C8('C', 'O', 'N', 'N', 'E', 'C', 'T', ' ')) { *len = 8; return METHOD_CONNECT; }
    if (w6 == (C4('T', 'R', 'A', 'C') | (C2('E', ' ') << 32))) { *len = 6; return METHOD_TRACE; }
    return 0;
}

/* Record where a header line starts, first occurrence only. */
static __always_inline void mark_header(__u32 *slot, __u32 at)
{
    if (*(volatile __u32 *)slot == 0)
        *(volatile __u32 *)slot = at;
}

static __always_inline __u64 scan_len(const struct tc_scratch *s)
{
    __u64 n = *(volatile const __u32 *)&s->scan_len;
    return n > SPANLET_TC_SCAN_BYTES ? 0 : n;
}

/* Find the header lines we read, in two passes so that the verifier can walk
 * them: the first only notes where lines start (one branch per byte), the
 * second looks at those lines. Anything a pass learns goes through volatile
 * memory, never a register, so that the verifier's state at each loop head is
 * the same whatever was found and each loop is walked once per offset. */
static __always_inline void scan_headers(struct tc_scratch *s)
{
    __u64 n = scan_len(s);
    *(volatile __u32 *)&s->lines = 0;
    for (__u32 i = 0; i < SPANLET_TC_SCAN_BYTES; i++) {
        if (i + 1 >= n)
            break;
        if (s->buf[i] != '\n')
            continue;
        if (s->buf[i + 1] == '\r' || s->buf[i + 1] == '\n')
            break; /* end of the header block (CRLF CRLF, or bare LF LF) */
        __u32 k = *(volatile __u32 *)&s->lines;
        if (k >= TC_MAX_LINES)
            break;
        s->line_at[k] = i + 1;
        *(volatile __u32 *)&s->lines = k + 1;
    }

    *(volatile __u32 *)&s->traceparent_at = 0;
    *(volatile __u32 *)&s->traceparent_dup = 0;
    *(volatile __u32 *)&s->content_type_at = 0;
    *(volatile __u32 *)&s->upgrade_at = 0;
    for (__u32 j = 0; j < TC_MAX_LINES; j++) {
        if (j >= *(volatile __u32 *)&s->lines)
            break;
        __u64 at = *(volatile __u32 *)&s->line_at[j];
        if (at > SPANLET_TC_SCAN_BYTES)
            break;
        /* Past the packet's bytes the buffer holds an older packet's: a name
         * must end inside this one (the longest we look for is 13 bytes). */
        if (at + 13 > *(volatile __u32 *)&s->scan_len)
            break;
        __u8 c = s->buf[at] | 0x20;
        __u64 w = ld64(&s->buf[at]) | LOWER8;
        if (c == 't') {
            if (w == C8('t', 'r', 'a', 'c', 'e', 'p', 'a', 'r') &&
                (ld32(&s->buf[at + 8]) | LOWER4) == C4('e', 'n', 't', ':')) {
                if (*(volatile __u32 *)&s->traceparent_at)
                    *(volatile __u32 *)&s->traceparent_dup = 1;
                mark_header(&s->traceparent_at, at + 1);
            }
        } else if (c == 'c') {
            if (w == C8('c', 'o', 'n', 't', 'e', 'n', 't', '-') &&
                (ld32(&s->buf[at + 8]) | LOWER4) == C4('t', 'y', 'p', 'e') &&
                s->buf[at + 12] == ':')
                mark_header(&s->content_type_at, at + 1);
        } else if (c == 'u') {
            if (w == C8('u', 'p', 'g', 'r', 'a', 'd', 'e', ':'))
                mark_header(&s->upgrade_at, at + 1);
        }
    }
}

/* Keep the compiler from testing a copy of v while the access uses another
 * (the verifier then sees an unbounded offset). */
#define BOUND_VAR(v) asm volatile("" : "+r"(v))
/* Largest offset of a header value; every fixed-length read after it stays
 * below SPANLET_TC_SCAN_BYTES + TC_SCAN_SLACK. */
#define VALUE_MAX (SPANLET_TC_SCAN_BYTES + 24)

/* Offset of a header's value: `at` (name offset + 1, from the scan) plus the
 * name, then optional whitespace. Returns 0 when absent. */
static __always_inline __u64 header_value(const struct tc_scratch *s, __u64 at, __u64 name_len)
{
    if (at == 0)
        return 0;
    __u64 v = at - 1 + name_len;
    BOUND_VAR(v);
    if (v > SPANLET_TC_SCAN_BYTES + 16)
        return 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        __u8 c = s->buf[v];
        if (c != ' ' && c != '\t')
            break;
        v++;
    }
    return v;
}

static __always_inline int hexval(__u8 c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* Results of parse_traceparent: valid, or a REJECT_TRACEPARENT_* reason. */
#define TP_VALID -1
/* Whitespace allowed after the value before its line ends (HTTP's OWS). */
#define TP_OWS_MAX 8

/* W3C traceparent "vv-<32 hex>-<16 hex>-ff" at s->buf[v]; lowercase hex only,
 * as the Recommendation requires; version ff, all-zero ids and, for version
 * 00, anything but whitespace after the 55 characters make it invalid (a
 * higher version may append "-..."). The line must end (CR or LF) after the
 * value within what was scanned. TP_VALID and the ids, or why not. */
static __always_inline int parse_traceparent(const struct tc_scratch *s, __u64 v, __u64 n,
                                             struct spanlet_hdr *h, __u8 *flags)
{
    BOUND_VAR(v);
    if (v == 0 || v > VALUE_MAX || v + 56 > n)
        return REJECT_TRACEPARENT_TRUNCATED;
    const __u8 *t = &s->buf[v];
    int hi = hexval(t[0]), lo = hexval(t[1]);
    if (hi < 0 || lo < 0 || (hi == 15 && lo == 15))
        return REJECT_TRACEPARENT_INVALID;
    int version = hi * 16 + lo;
    if (t[2] != '-' || t[35] != '-' || t[52] != '-')
        return REJECT_TRACEPARENT_INVALID;
    if (!(version > 0 && t[55] == '-')) {
#pragma unroll
        for (int k = 0; k < TP_OWS_MAX; k++) {
            if (v + 55 + k >= n)
                return REJECT_TRACEPARENT_TRUNCATED;
            __u8 c = t[55 + k];
            if (c == '\r' || c == '\n')
                break;
            if ((c != ' ' && c != '\t') || k == TP_OWS_MAX - 1)
                return REJECT_TRACEPARENT_INVALID;
        }
    }
    __u8 tid[16];
    __u8 any = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int a = hexval(t[3 + 2 * i]), b = hexval(t[4 + 2 * i]);
        if (a < 0 || b < 0)
            return REJECT_TRACEPARENT_INVALID;
        tid[i] = a * 16 + b;
        any |= tid[i];
    }
    if (!any)
        return REJECT_TRACEPARENT_INVALID;
    __u64 sid = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int a = hexval(t[36 + i]);
        if (a < 0)
            return REJECT_TRACEPARENT_INVALID;
        sid = (sid << 4) | a;
    }
    if (!sid)
        return REJECT_TRACEPARENT_INVALID;
    int fa = hexval(t[53]), fb = hexval(t[54]);
    if (fa < 0 || fb < 0)
        return REJECT_TRACEPARENT_INVALID;
    __builtin_memcpy(h->trace_id, tid, 16);
    h->span_id = sid;
    *flags = fa * 16 + fb;
    return TP_VALID;
}

/* The request's traceparent into ev when there is exactly one and it is
 * valid; a header that is there but not used is counted, by reason. */
static __always_inline void request_traceparent(const struct tc_scratch *s, struct http_event *ev)
{
    if (!*(volatile const __u32 *)&s->traceparent_at)
        return;
    if (*(volatile const __u32 *)&s->traceparent_dup) {
        count_rejected(REJECT_TRACEPARENT_DUPLICATE);
        return;
    }
    __u64 v = header_value(s, s->traceparent_at, 12);
    int r = parse_traceparent(s, v, scan_len(s), &ev->hdr, &ev->trace_flags);
    if (r == TP_VALID)
        ev->hdr.flags |= SPANLET_HTTP_TRACEPARENT;
    else
        count_rejected(r);
}

static __always_inline __u8 content_modality(const struct tc_scratch *s, __u64 v, __u64 n)
{
    BOUND_VAR(v);
    if (v == 0 || v > VALUE_MAX || v + 5 > n)
        return SPANLET_MOD_OTHER;
    __u64 w = ld64(&s->buf[v]) | LOWER8;
    __u64 w6 = w & 0xffffffffffffULL;
    if (v + 6 <= n) {
        if (w6 == (C4('i', 'm', 'a', 'g') | (C2('e', '/') << 32)))
            return SPANLET_MOD_IMAGE;
        if (w6 == (C4('a', 'u', 'd', 'i') | (C2('o', '/') << 32)))
            return SPANLET_MOD_AUDIO;
        if (w6 == (C4('v', 'i', 'd', 'e') | (C2('o', '/') << 32)))
            return SPANLET_MOD_VIDEO;
    }
    if ((w & 0xffffffffffULL) == (C4('t', 'e', 'x', 't') | ((__u64)'/' << 32)))
        return SPANLET_MOD_TEXT;
    if (v + 16 <= n && w == C8('a', 'p', 'p', 'l', 'i', 'c', 'a', 't') &&
        (ld64(&s->buf[v + 8]) | LOWER8) == C8('i', 'o', 'n', '/', 'j', 's', 'o', 'n'))
        return SPANLET_MOD_TEXT;
    return SPANLET_MOD_OTHER;
}

static __always_inline int is_websocket(const struct tc_scratch *s, __u64 v, __u64 n)
{
    BOUND_VAR(v);
    if (v == 0 || v > VALUE_MAX || v + 9 > n)
        return 0;
    return (ld64(&s->buf[v]) | LOWER8) == C8('w', 'e', 'b', 's', 'o', 'c', 'k', 'e') &&
           (s->buf[v + 8] | 0x20) == 't';
}

/* FNV-1a (32 bit) of the request path, query string excluded. */
static __always_inline __u32 path_hash(const struct tc_scratch *s, __u64 start, __u64 n)
{
    __u32 h = 2166136261U;
    BOUND_VAR(start);
    if (start > 8)
        return h;
    for (__u64 i = 0; i < TC_PATH_MAX; i++) {
        __u64 at = start + i;
        if (at >= n)
            break;
        __u8 c = s->buf[at];
        if (c == ' ' || c == '?' || c == '\r' || c == '\n')
            break;
        h ^= c;
        h *= 16777619U;
    }
    return h;
}

/* A packet that starts an HTTP/1.x request (tail call from handle()): emit
 * its http_event, learn the modality from Content-Type and the class
 * (websocket) from Upgrade. Context comes in the per-CPU scratch. */
/* Send the bytes of the request in progress on this connection, without the
 * packet that starts the next one (already added by handle()). */
static __always_inline void finish_request(struct __sk_buff *skb, const struct pkt *p,
                                           __u32 next_len, int dir)
{
    struct http_request *r = http_request_bytes.lookup((struct flow_key *)&p->key);
    if (!r)
        return;
    struct http_bytes_event *ev = events.ringbuf_reserve(sizeof(*ev));
    if (!ev) {
        spanlet_count_drop();
    } else {
        fill_net_hdr(&ev->hdr, skb, SPANLET_KIND_HTTP_BYTES, 0, dir);
        __builtin_memcpy(ev->hdr.trace_id, r->trace_id, 16);
        ev->hdr.span_id = r->parent_id;
        wire_key(p, &ev->flow);
        ev->bytes[0] = r->bytes[0];
        ev->bytes[1] = r->bytes[1];
        if (dir == 0)
            ev->bytes[0] -= ev->bytes[0] >= next_len ? next_len : ev->bytes[0];
        else
            ev->bytes[1] -= ev->bytes[1] >= next_len ? next_len : ev->bytes[1];
        ev->req_dir = r->req_dir;
        __builtin_memset(ev->_pad, 0, sizeof(ev->_pad));
        events.ringbuf_submit(ev, 0);
    }
    http_request_bytes.delete((struct flow_key *)&p->key);
}

int tc_classify_req(struct __sk_buff *skb)
{
    int zero = 0;
    struct tc_scratch *s = tc_scratch.lookup(&zero);
    if (!s)
        return TC_PASS;
    struct pkt p = s->pkt;
    int dir = s->dir & 1;
    struct flow_info *fi = flow_info.lookup(&p.key);
    if (!fi)
        return TC_PASS;
    __u32 len = p.payload_len < SPANLET_TC_SCAN_BYTES ? p.payload_len : SPANLET_TC_SCAN_BYTES;
    *(volatile __u32 *)&s->scan_len = len;
    /* n is re-read from memory wherever a loop may have narrowed it to a
     * constant, so that what follows is verified once, not once per value. */
    __u64 n = scan_len(s);
    if (n < 16 || bpf_skb_load_bytes(skb, p.payload_off, s->buf, n) < 0)
        return TC_PASS;
    scan_headers(s);
    n = scan_len(s);

    __u64 v = header_value(s, s->content_type_at, 13);
    if (v && fi->mod_source == MOD_SRC_NONE) {
        __u8 m = content_modality(s, v, n);
        if (m != SPANLET_MOD_OTHER) {
            fi->modality = m;
            fi->mod_source = MOD_SRC_CONTENT;
        }
    }
    if (fi->proto == SPANLET_PROTO_UNKNOWN) {
        v = header_value(s, s->upgrade_at, 8);
        fi->proto = is_websocket(s, v, n) ? SPANLET_PROTO_WEBSOCKET : SPANLET_PROTO_HTTP1;
        emit_flow_event(skb, &p, fi, dir);
    }

    struct http_event *ev = events.ringbuf_reserve(sizeof(*ev));
    if (!ev) {
        spanlet_count_drop();
        return TC_PASS;
    }
    fill_net_hdr(&ev->hdr, skb, SPANLET_KIND_HTTP, fi->modality, dir);
    __builtin_memset(ev->_pad, 0, sizeof(ev->_pad));
    ev->trace_flags = 0;
    request_traceparent(s, ev);
    wire_key(&p, &ev->flow);
    ev->ifindex = skb->ifindex;
    ev->path_hash = path_hash(s, s->method_len, scan_len(s));
    ev->method = s->method;
    ev->direction = dir;
    struct http_request next = {};
    int traced = ev->hdr.flags & SPANLET_HTTP_TRACEPARENT;
    if (traced) {
        __builtin_memcpy(next.trace_id, ev->hdr.trace_id, 16);
        next.parent_id = ev->hdr.span_id;
        next.req_dir = dir;
        next.bytes[dir] = skb->len;
    }
    events.ringbuf_submit(ev, 0);
    finish_request(skb, &p, skb->len, dir);
    if (traced)
        http_request_bytes.update(&p.key, &next);
    return TC_PASS;
}

/* The HTTP/2 connection preface "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" in three words. */
#define H2_PREFACE_0 C8('P', 'R', 'I', ' ', '*', ' ', 'H', 'T')
#define H2_PREFACE_1 C8('T', 'P', '/', '2', '.', '0', '\r', '\n')
#define H2_PREFACE_2 C8('\r', '\n', 'S', 'M', '\r', '\n', '\r', '\n')

/* A TCP payload packet: classify the flow on its first one; on HTTP/1.x
 * flows look at every packet that starts a request (keep-alive). */
static __always_inline void tcp_payload(struct __sk_buff *skb, const struct pkt *p,
                                        struct flow_info *fi, int dir)
{
    __u8 head[24] = {};
    __u32 len = p->payload_len < 24 ? p->payload_len : 24;
    if (fi->proto != SPANLET_PROTO_UNKNOWN && fi->proto != SPANLET_PROTO_HTTP1)
        return;
    if (len < 8) {
        if (fi->proto == SPANLET_PROTO_UNKNOWN) {
            fi->proto = SPANLET_PROTO_TCP;
            emit_flow_event(skb, p, fi, dir);
        }
        return;
    }
    /* Only the first 8 bytes for established HTTP flows; 24 to classify. */
    if (fi->proto == SPANLET_PROTO_HTTP1)
        len = 8;
    if (len == 24) {
        if (bpf_skb_load_bytes(skb, p->payload_off, head, 24) < 0)
            return;
    } else if (bpf_skb_load_bytes(skb, p->payload_off, head, 8) < 0) {
        return;
    }
    __u32 method_len = 0;
    __u8 method = http_method(ld64(head), &method_len);
    if (method && p->payload_len >= 16) {
        int zero = 0;
        struct tc_scratch *s = tc_scratch.lookup(&zero);
        if (!s)
            return;
        s->pkt = *p;
        s->dir = dir;
        s->method = method;
        s->method_len = method_len;
        tc_request_parser.call(skb, 0);
        /* Only reached if the parser is not loaded: still a request. */
        if (fi->proto == SPANLET_PROTO_UNKNOWN) {
            fi->proto = SPANLET_PROTO_HTTP1;
            emit_flow_event(skb, p, fi, dir);
        }
        return;
    }
    if (fi->proto != SPANLET_PROTO_UNKNOWN)
        return;
    if (len == 24 && ld64(head) == H2_PREFACE_0 && ld64(head + 8) == H2_PREFACE_1 &&
        ld64(head + 16) == H2_PREFACE_2)
        fi->proto = SPANLET_PROTO_HTTP2;
    else if ((ld64(head) & 0xffffffffffffffULL) ==
             (C4('H', 'T', 'T', 'P') | (C4('/', '1', '.', 0) << 32)))
        fi->proto = SPANLET_PROTO_HTTP1; /* the response was the first payload seen */
    else
        fi->proto = SPANLET_PROTO_TCP;
    emit_flow_event(skb, p, fi, dir);
}

/* ---- RTP and jitter ------------------------------------------------------ */

static __always_inline int is_rtcp(__u8 b0, __u8 b1)
{
    return (b0 >> 6) == 2 && b1 >= 200 && b1 <= 204;
}

/* Class of a new UDP flow from its first datagram; sets RTP modality. */
static __always_inline void classify_udp(struct __sk_buff *skb, const struct pkt *p,
                                         struct flow_info *fi)
{
    __u8 b[2];
    fi->proto = SPANLET_PROTO_UDP;
    if (p->payload_len < 8 || bpf_skb_load_bytes(skb, p->payload_off, b, 2) < 0)
        return;
    if (is_rtcp(b[0], b[1])) {
        fi->proto = SPANLET_PROTO_RTP;
        return;
    }
    if ((b[0] >> 6) != 2 || p->payload_len < 12)
        return;
    __u32 pt = b[1] & 0x7f;
    struct rtp_pt_info *info = tc_rtp_payload_types.lookup(&pt);
    if (!info || !info->clock_hz)
        return;
    fi->proto = SPANLET_PROTO_RTP;
    if (fi->mod_source < MOD_SRC_RTP) {
        fi->modality = info->modality;
        fi->mod_source = MOD_SRC_RTP;
    }
}

static __always_inline __u64 abs_diff(__u64 a, __u64 b)
{
    return a < b ? b - a : a - b;
}

/* RFC 3550 A.1: the fixed header, CSRC list, header extension and padding
 * of an RTP packet whose first byte is b0 fit in its payload_len bytes, and
 * a padding count is at least 1. */
static __always_inline int rtp_lengths_valid(struct __sk_buff *skb, const struct pkt *p, __u8 b0)
{
    __u32 len = p->payload_len;
    __u32 need = 12 + 4 * (b0 & 0x0f);
    if (len < need)
        return 0;
    if (b0 & 0x10) { /* extension: 16-bit profile data, 16-bit length in words */
        __u8 x[4];
        if (len < need + 4 || bpf_skb_load_bytes(skb, p->payload_off + need, x, 4) < 0)
            return 0;
        need += 4 + 4 * (((__u32)x[2] << 8) | x[3]);
        if (len < need)
            return 0;
    }
    if (b0 & 0x20) { /* padding: its last byte counts the padding, itself included */
        __u8 pad;
        if (bpf_skb_load_bytes(skb, p->payload_off + len - 1, &pad, 1) < 0)
            return 0;
        if (pad == 0 || pad > len - need)
            return 0;
    }
    return 1;
}

/* |D| of RFC 3550 for an RTP data packet, or -1 when it is not media. A
 * datagram of an RTP flow that is neither RTCP nor valid RTP of a configured
 * payload type is counted as rejected. */
static __always_inline __s64 rtp_deviation(struct __sk_buff *skb, const struct pkt *p,
                                           struct flow_info *fi, struct jitter_state *js,
                                           __u64 now)
{
    __u8 h[8] = {};
    if (p->payload_len >= 8) {
        if (bpf_skb_load_bytes(skb, p->payload_off, h, 8) < 0)
            return -1;
    } else if (p->payload_len < 2 || bpf_skb_load_bytes(skb, p->payload_off, h, 2) < 0) {
        count_rejected(REJECT_RTP_INVALID);
        return -1;
    }
    if (is_rtcp(h[0], h[1]))
        return -1;
    if ((h[0] >> 6) != 2 || p->payload_len < 12) {
        count_rejected(REJECT_RTP_INVALID);
        return -1;
    }
    __u32 pt = h[1] & 0x7f;
    struct rtp_pt_info *info = tc_rtp_payload_types.lookup(&pt);
    if (!info || !info->clock_hz) {
        count_rejected(REJECT_RTP_UNKNOWN_PT);
        return -1;
    }
    if (!rtp_lengths_valid(skb, p, h[0])) {
        count_rejected(REJECT_RTP_INVALID);
        return -1;
    }
    if (fi->mod_source < MOD_SRC_RTP) { /* RTCP came first (rtcp-mux) */
        fi->modality = info->modality;
        fi->mod_source = MOD_SRC_RTP;
    }
    __u32 ts = ((__u32)h[4] << 24) | ((__u32)h[5] << 16) | ((__u32)h[6] << 8) | h[7];
    __s64 dev = 0;
    if (js->seen) {
        /* D = arrival delta - timestamp delta (RTP clock → ns); only |D| is used. */
        __s32 dts = (__s32)(ts - js->last_rtp_ts);
        __u64 ts_ns = (__u64)(dts < 0 ? -(__s64)dts : (__s64)dts) * 1000000000ULL / info->clock_hz;
        __u64 arr_ns = now - js->last_arrival_ns;
        __u64 d = dts < 0 ? arr_ns + ts_ns : abs_diff(arr_ns, ts_ns);
        dev = (__s64)d;
        __u64 j = js->jitter_x16_ns;
        js->jitter_x16_ns = j + d - ((j + 8) >> 4);
    }
    js->last_rtp_ts = ts;
    js->last_arrival_ns = now;
    js->seen = 1;
    return dev;
}

/* |IPDV| (change of inter-arrival time) for non-RTP audio/video packets. */
static __always_inline __s64 ipdv_deviation(struct jitter_state *js, __u64 now)
{
    __s64 dev = 0;
    if (js->seen) {
        __u64 gap = now - js->last_arrival_ns;
        if (js->seen >= 2)
            dev = (__s64)abs_diff(gap, js->last_gap_ns);
        else
            js->seen = 2;
        js->last_gap_ns = gap;
    } else {
        js->seen = 1;
    }
    js->last_arrival_ns = now;
    return dev;
}

static __always_inline void media_packet(struct __sk_buff *skb, const struct pkt *p,
                                         struct flow_info *fi, int dir)
{
    int rtp = fi->proto == SPANLET_PROTO_RTP;
    if (!rtp && fi->modality != SPANLET_MOD_AUDIO && fi->modality != SPANLET_MOD_VIDEO)
        return;
    __u64 now = bpf_ktime_get_ns();
    struct jitter_state *js = &fi->jit[dir & 1];
    __s64 dev = rtp ? rtp_deviation(skb, p, fi, js, now) : ipdv_deviation(js, now);
    if (dev < 0)
        return;
    struct jitter_counters zero = {};
    struct jitter_counters *jc =
        spanlet_jitter_sensitivity_score.lookup_or_try_init((struct flow_key *)&p->key, &zero);
    if (!jc)
        return;
    jc->media_packets += 1;
    if ((__u64)dev > SPANLET_TC_LATE_NS)
        jc->late_packets += 1;
}

/* ---- entry points -------------------------------------------------------- */

/* A flow whose class is final and that is not media needs nothing per packet
 * but its counters: HTTP/1.x (every request is parsed), RTP and audio/video
 * (jitter) and TCP flows still waiting for payload do. */
static __always_inline int settled(const struct flow_info *fi)
{
    switch (fi->proto) {
    case SPANLET_PROTO_HTTP2:
    case SPANLET_PROTO_WEBSOCKET:
    case SPANLET_PROTO_TCP:
    case SPANLET_PROTO_UDP:
        return fi->modality != SPANLET_MOD_AUDIO && fi->modality != SPANLET_MOD_VIDEO;
    default:
        return 0;
    }
}

/* The flow's info, made on its first payload packet (a TCP handshake needs
 * none: its packets are counted and wait for the class in user space). */
static __always_inline struct flow_info *flow_lookup(struct __sk_buff *skb, struct pkt *p, int dir)
{
    struct flow_info *fi = flow_info.lookup(&p->key);
    if (fi)
        return fi;
    struct flow_info init = {};
    __u8 mapped = 0;
    init.modality = port_modality(&p->key, &mapped);
    init.mod_source = mapped ? MOD_SRC_PORT : MOD_SRC_NONE;
    if (p->key.l4proto == IPPROTO_UDP)
        classify_udp(skb, p, &init);
    if (flow_info.insert(&p->key, &init) == 0 && init.proto != SPANLET_PROTO_UNKNOWN)
        emit_flow_event(skb, p, &init, dir);
    return flow_info.lookup(&p->key);
}

static __always_inline int handle(struct __sk_buff *skb, int dir)
{
    struct pkt p = {};
    if (parse(skb, &p) < 0)
        return TC_PASS;
    struct flow_counters zero = {};
    struct flow_counters *c = spanlet_network_bytes_total.lookup_or_try_init(&p.key, &zero);
    if (c) {
        c->packets[dir] += 1;
        c->bytes[dir] += skb->len;
        if (c->settled)
            return TC_PASS;
    }
    if (p.payload_len == 0)
        return TC_PASS;
    struct flow_info *fi = flow_lookup(skb, &p, dir);
    if (!fi)
        return TC_PASS;
    media_packet(skb, &p, fi, dir);
    if (c && settled(fi))
        c->settled = 1;
    if (fi->proto == SPANLET_PROTO_HTTP1) {
        struct http_request *r = http_request_bytes.lookup(&p.key);
        if (r)
            __sync_fetch_and_add(&r->bytes[dir], skb->len);
    }
    /* Last: a request packet ends in a tail call that does not come back. */
    if (p.key.l4proto == IPPROTO_TCP)
        tcp_payload(skb, &p, fi, dir);
    return TC_PASS;
}

int tc_classify_in(struct __sk_buff *skb)
{
    return handle(skb, SPANLET_DIR_INGRESS);
}

int tc_classify_eg(struct __sk_buff *skb)
{
    return handle(skb, SPANLET_DIR_EGRESS);
}
