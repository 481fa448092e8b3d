/* tc_classify.bpf.c: TC clsact classifier (ingress and egress). Per flow: protocol
 * class, modality, packets/bytes per direction, RTP/IPDV jitter for the Jitter
 * Sensitivity Score, and the W3C traceparent of plain HTTP/1.x requests. Per
 * class (protocol, modality): the same counts, kept as each packet is
 * counted, so that a scrape reads a few dozen slots, never every flow.
 * Never drops or alters a packet: every path returns TC_PASS. */
#include <uapi/linux/bpf.h>
/* uapi/linux/in.h and tcp.h include <linux/socket.h>, which with kernel
 * headers is the kernel's own (uio, mm...: 0.65 s of CPU of this file's
 * compile, as BCC parses everything three times). They only need its UAPI half: include
 * that and mark the other as read. Were the guard renamed, the kernel header
 * would be parsed again: slower, the same program. */
#include <uapi/linux/socket.h>
#define _LINUX_SOCKET_H
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include "spanlet.h"
#include "tc_classify.h"

/* The verdict of every path. TC_ACT_UNSPEC passes the packet untouched, as
 * TC_ACT_OK does, but also lets the filters after ours run: TC_ACT_OK would
 * end the clsact chain and silently disable another tool's filter with a
 * higher pref (tests/kernel/test_tc.py checks a later filter still runs). */
#define TC_PASS TC_ACT_UNSPEC

/* Metric 3 (spanlet_network_bytes_total, _packets_total): packets and bytes
 * per class (class_of()) and direction. */
BPF_PERCPU_ARRAY(spanlet_network_bytes_total, struct class_traffic, TC_CLASSES);
/* Metric 4 (spanlet_jitter_sensitivity_score): media and late packets per class. */
BPF_PERCPU_ARRAY(spanlet_jitter_sensitivity_score, struct jitter_counters, TC_CLASSES);
/* Metric 3 per flow, for inspection (spanlet inspect flows) and idle flows.
 * (Media and late packets are kept per class only: nothing reads them per
 * flow, and a per-CPU map of max_flows rows for them was 1 MiB of kernel
 * memory per possible CPU.) */
BPF_TABLE("lru_percpu_hash", struct flow_key, struct flow_counters,
          tc_flow_counters, SPANLET_TC_MAX_FLOWS);
BPF_TABLE("lru_hash", struct flow_key, struct flow_info, flow_info, SPANLET_TC_MAX_FLOWS);
/* TCP flows counted before their class is known (struct pending_traffic). */
BPF_TABLE("lru_hash", struct flow_key, struct pending_traffic, tc_pending,
          SPANLET_TC_MAX_FLOWS);

/* The request in progress on each HTTP/1.x connection that carried a
 * traceparent, and its wire bytes so far (kernel.net.rx_bytes/tx_bytes of
 * the server span): replaced, and sent as an http_bytes_event, when the next
 * request on the connection starts. */
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

/* ---- class totals -------------------------------------------------------- */

static __always_inline __u32 class_of(__u8 proto, __u8 modality)
{
    __u32 m = modality < TC_MOD_N ? modality : SPANLET_MOD_OTHER;
    return (proto & (TC_PROTO_N - 1)) * TC_MOD_N + m;
}

static __always_inline void class_add(__u32 cls, int dir, __u64 packets, __u64 bytes)
{
    struct class_traffic *t = spanlet_network_bytes_total.lookup(&cls);
    if (!t)
        return;
    t->packets[dir & 1] += packets;
    t->bytes[dir & 1] += bytes;
}

static __always_inline void class_media(__u32 cls, int media)
{
    if (media == MEDIA_NONE)
        return;
    struct jitter_counters *j = spanlet_jitter_sensitivity_score.lookup(&cls);
    if (!j)
        return;
    j->media_packets += 1;
    if (media == MEDIA_LATE)
        j->late_packets += 1;
}

/* A packet of a TCP flow with no class yet: held in tc_pending. */
static __always_inline void pending_add(const struct flow_key *k, int dir, __u64 bytes)
{
    struct pending_traffic init = {};
    init.first_ns = bpf_ktime_get_ns();
    struct pending_traffic *pt = tc_pending.lookup_or_try_init((struct flow_key *)k, &init);
    if (!pt)
        return;
    __sync_fetch_and_add(&pt->packets[dir & 1], 1);
    __sync_fetch_and_add(&pt->bytes[dir & 1], bytes);
}

/* The flow got its class: what it held in tc_pending goes there. Only the
 * one that deletes the entry adds it (the agent's sweep of old entries too). */
static __always_inline void pending_flush(const struct flow_key *k, __u32 cls)
{
    struct pending_traffic *pt = tc_pending.lookup((struct flow_key *)k);
    if (!pt)
        return;
    __u64 p0 = pt->packets[0], p1 = pt->packets[1], b0 = pt->bytes[0], b1 = pt->bytes[1];
    if (tc_pending.delete((struct flow_key *)k) != 0)
        return;
    class_add(cls, 0, p0, b0);
    class_add(cls, 1, p1, b1);
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
        p->tcp_end = (th->fin | th->rst) != 0;
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

/* ---- class totals of a packet ------------------------------------------- */

/* Add the packet to its flow's class, once its processing has found the
 * class: at the end of handle(), or of tc_classify_req for a request. */
static __always_inline void account(struct __sk_buff *skb, const struct pkt *p,
                                    struct flow_info *fi, int dir, int media, int was_pending)
{
    __u64 len = skb->len;
    if (fi && fi->proto != SPANLET_PROTO_UNKNOWN) {
        __u32 cls = class_of(fi->proto, fi->modality);
        class_add(cls, dir, 1, len);
        class_media(cls, media);
        if (was_pending && p->key.l4proto == IPPROTO_TCP)
            pending_flush(&p->key, cls);
        return;
    }
    if (p->key.l4proto == IPPROTO_TCP && !p->tcp_end) {
        pending_add(&p->key, dir, len);
        return;
    }
    __u8 mapped = 0;
    __u8 mod = fi ? fi->modality : port_modality(&p->key, &mapped);
    if (p->key.l4proto == IPPROTO_UDP) {
        /* a UDP flow has its class from its first datagram; one with no
         * payload yet (or no room for its flow_info) is plain udp */
        class_add(class_of(SPANLET_PROTO_UDP, mod), dir, 1, len);
        return;
    }
    /* a TCP flow ending (FIN, RST) before any payload: tcp, handshake
     * included, and so are the packets after this one */
    __u32 cls = class_of(SPANLET_PROTO_TCP, mod);
    class_add(cls, dir, 1, len);
    pending_flush(&p->key, cls);
    if (fi) {
        fi->proto = SPANLET_PROTO_TCP;
    } else {
        struct flow_info init = {};
        init.proto = SPANLET_PROTO_TCP;
        init.modality = mod;
        init.mod_source = mapped ? MOD_SRC_PORT : MOD_SRC_NONE;
        flow_info.insert((struct flow_key *)&p->key, &init);
    }
}

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

/* Remember the flow's class in this CPU's counters: for every later packet
 * once the flow is settled, else for the packets without payload (ACKs)
 * until the next payload packet, which looks the class up again. */
static __always_inline void cache_class(struct flow_counters *c, const struct flow_info *fi)
{
    if (!c || fi->proto == SPANLET_PROTO_UNKNOWN)
        return;
    c->cls = class_of(fi->proto, fi->modality);
    c->settled = settled(fi) ? CLS_FINAL : CLS_LAST;
}

/* ---- HTTP/1.x ------------------------------------------------------------ */

#include "tc_http.bpf.h"
#include "tc_traceparent.bpf.h"

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

/* A packet that starts an HTTP/1.x request: emit its http_event, learn the
 * modality from Content-Type and the class (websocket) from Upgrade. */
static __always_inline void parse_request(struct __sk_buff *skb, struct tc_scratch *s,
                                          const struct pkt *pp, struct flow_info *fi, int dir)
{
    struct pkt p = *pp;
    __u32 len = p.payload_len < SPANLET_TC_SCAN_BYTES ? p.payload_len : SPANLET_TC_SCAN_BYTES;
    *(volatile __u32 *)&s->scan_len = len;
    /* n is re-read from memory wherever a loop may have narrowed it to a
     * constant, so that what follows is verified once, not once per value. */
    __u64 n = scan_len(s);
    if (n < 16 || bpf_skb_load_bytes(skb, p.payload_off, s->buf, n) < 0)
        return;
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
        return;
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
}

/* The request parser (tail call from handle()): context comes in the per-CPU
 * scratch; the packet is added to the class totals here, once classified. */
int tc_classify_req(struct __sk_buff *skb)
{
    int zero = 0;
    struct tc_scratch *s = tc_scratch.lookup(&zero);
    if (!s)
        return TC_PASS;
    struct pkt p = s->pkt;
    int dir = s->dir & 1;
    int media = s->media;
    int was_pending = s->was_pending;
    struct flow_info *fi = flow_info.lookup(&p.key);
    if (fi)
        parse_request(skb, s, &p, fi, dir);
    account(skb, &p, fi, dir, media, was_pending);
    if (fi)
        cache_class(tc_flow_counters.lookup(&p.key), fi);
    return TC_PASS;
}

/* The HTTP/2 connection preface "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" in three words. */
#define H2_PREFACE_0 C8('P', 'R', 'I', ' ', '*', ' ', 'H', 'T')
#define H2_PREFACE_1 C8('T', 'P', '/', '2', '.', '0', '\r', '\n')
#define H2_PREFACE_2 C8('\r', '\n', 'S', 'M', '\r', '\n', '\r', '\n')

/* A TCP payload packet: classify the flow on its first one; on HTTP/1.x
 * flows look at every packet that starts a request (keep-alive). */
static __always_inline void tcp_payload(struct __sk_buff *skb, const struct pkt *p,
                                        struct flow_info *fi, int dir, int media,
                                        int was_pending)
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
        s->media = media;
        s->was_pending = was_pending;
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

#include "tc_rtp.bpf.h"

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

/* MEDIA_*: whether the packet is media, and late; its class's counters get
 * it in account(). */
static __always_inline int media_packet(struct __sk_buff *skb, const struct pkt *p,
                                        struct flow_info *fi, int dir)
{
    int rtp = fi->proto == SPANLET_PROTO_RTP;
    if (!rtp && fi->modality != SPANLET_MOD_AUDIO && fi->modality != SPANLET_MOD_VIDEO)
        return MEDIA_NONE;
    __u64 now = bpf_ktime_get_ns();
    struct jitter_state *js = &fi->jit[dir & 1];
    __s64 dev = rtp ? rtp_deviation(skb, p, fi, js, now) : ipdv_deviation(js, now);
    if (dev < 0)
        return MEDIA_NONE;
    return (__u64)dev > SPANLET_TC_LATE_NS ? MEDIA_LATE : MEDIA_ON_TIME;
}

/* ---- entry points -------------------------------------------------------- */

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
    struct flow_counters *c = tc_flow_counters.lookup_or_try_init(&p.key, &zero);
    if (c) {
        c->packets[dir] += 1;
        c->bytes[dir] += skb->len;
        c->last_ns = bpf_ktime_get_coarse_ns();
        if (c->settled == CLS_FINAL || (c->settled == CLS_LAST && p.payload_len == 0)) {
            class_add(c->cls, dir, 1, skb->len);
            return TC_PASS;
        }
    }
    struct flow_info *fi;
    if (p.payload_len == 0) {
        fi = flow_info.lookup(&p.key);
        account(skb, &p, fi, dir, MEDIA_NONE, 0);
        return TC_PASS;
    }
    fi = flow_lookup(skb, &p, dir);
    if (!fi) {
        account(skb, &p, 0, dir, MEDIA_NONE, 0);
        return TC_PASS;
    }
    int was_pending = fi->proto == SPANLET_PROTO_UNKNOWN;
    int media = media_packet(skb, &p, fi, dir);
    if (fi->proto == SPANLET_PROTO_HTTP1) {
        struct http_request *r = http_request_bytes.lookup(&p.key);
        if (r)
            __sync_fetch_and_add(&r->bytes[dir], skb->len);
    }
    /* A request packet ends in a tail call that does not come back: the
     * request parser accounts for it. */
    if (p.key.l4proto == IPPROTO_TCP)
        tcp_payload(skb, &p, fi, dir, media, was_pending);
    account(skb, &p, fi, dir, media, was_pending);
    cache_class(c, fi);
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
