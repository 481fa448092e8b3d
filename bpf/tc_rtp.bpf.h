/* tc_rtp.bpf.h: RTP and RTCP (RFC 3550) of tc_classify.bpf.c: a UDP flow's
 * class from its first datagram, and |D| of every RTP data packet. Inlined
 * after its maps: tc_rtp_payload_types and count_rejected() are there. */
#ifndef TC_RTP_BPF_H
#define TC_RTP_BPF_H

#include "tc_classify.h"

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

#endif /* TC_RTP_BPF_H */
