/* spanlet.h: the structs that cross from spanlet's kernel programs into the
 * agent (mirrored once, in agent/events.py), and the helpers every program
 * uses to stamp and emit them. UAPI types and BPF helpers only. */
#ifndef SPANLET_H
#define SPANLET_H

#include <uapi/linux/bpf.h>

#include "spanlet_types.h"

/* The per-thread span context map, the span facts map and the count of
 * facts rows created are made by span_ctx.bpf.c and pinned in
 * SPANLET_PIN_DIR (a folder unique to one agent, removed at its stop);
 * every other program of that agent opens the same maps there. A program
 * compiled without the flag gets private, empty copies. (BCC's own shared
 * tables are not used: its process-wide registry keeps a table's fd after
 * the table is gone, and a reused fd number then names another map.) */
#ifdef SPANLET_PIN_DIR
BPF_TABLE_PINNED("lru_hash", __u32, struct span_ctx_val, span_ctx, SPANLET_SPAN_CTX_MAX,
                 SPANLET_PIN_DIR "/span_ctx");
BPF_TABLE_PINNED("lru_hash", struct span_facts_key, struct span_facts_val, span_facts,
                 SPANLET_SPAN_FACTS_MAX, SPANLET_PIN_DIR "/span_facts");
BPF_TABLE_PINNED("percpu_array", int, __u64, span_facts_created, 1,
                 SPANLET_PIN_DIR "/span_facts_created");
BPF_TABLE_PINNED("lru_hash", struct span_facts_index_key, struct span_facts_index_val,
                 span_facts_index, SPANLET_SPAN_FACTS_MAX, SPANLET_PIN_DIR "/span_facts_index");
BPF_TABLE_PINNED("hash", __u64, __u64, span_facts_cg_created, SPANLET_FACTS_CGROUPS,
                 SPANLET_PIN_DIR "/span_facts_cg_created");
BPF_TABLE_PINNED("hash", __u64, __u64, span_facts_cg_released, SPANLET_FACTS_CGROUPS,
                 SPANLET_PIN_DIR "/span_facts_cg_released");
BPF_TABLE_PINNED("lru_hash", __u64, __u64, span_facts_cg_refused, SPANLET_FACTS_CGROUPS,
                 SPANLET_PIN_DIR "/span_facts_cg_refused");
BPF_TABLE_PINNED("percpu_array", int, __u64, span_facts_refused, 2,
                 SPANLET_PIN_DIR "/span_facts_refused");
#else
BPF_TABLE("lru_hash", __u32, struct span_ctx_val, span_ctx, 1);
BPF_TABLE("lru_hash", struct span_facts_key, struct span_facts_val, span_facts, 1);
BPF_PERCPU_ARRAY(span_facts_created, __u64, 1);
BPF_TABLE("lru_hash", struct span_facts_index_key, struct span_facts_index_val,
          span_facts_index, 1);
BPF_TABLE("hash", __u64, __u64, span_facts_cg_created, 1);
BPF_TABLE("hash", __u64, __u64, span_facts_cg_released, 1);
BPF_TABLE("lru_hash", __u64, __u64, span_facts_cg_refused, 1);
BPF_PERCPU_ARRAY(span_facts_refused, __u64, 2);
#endif
/* span_facts_refused: [0] events refused a row by the per-cgroup bound, [1] rows of
 * cgroups past SPANLET_FACTS_CGROUPS (made, bounded by the total only) */
#define SPANLET_FACTS_REFUSED 0
#define SPANLET_FACTS_CGROUPS_FULL 1

/* The calling thread's span context, NULL outside spans. */
static __always_inline struct span_ctx_val *spanlet_current_span(void)
{
    __u32 tid = (__u32)bpf_get_current_pid_tgid();
    return span_ctx.lookup(&tid);
}

static __always_inline void spanlet_facts_count(int slot)
{
    __u64 *n = span_facts_refused.lookup(&slot);
    if (n)
        __sync_fetch_and_add(n, 1);
}

/* Whether cgroup `cg` may make another row: live rows (rows made, counted
 * here, less rows gone, written by the agent's sweep and join) under
 * SPANLET_SPAN_FACTS_MAX_PER_CGROUP. A refusal is counted for the cgroup,
 * once per event (launch, sync, violation) that gets no row. */
static __always_inline int spanlet_facts_room(__u64 cg)
{
    __u64 *made = span_facts_cg_created.lookup(&cg);
    if (!made)
        return 1;
    __u64 *gone = span_facts_cg_released.lookup(&cg);
    __u64 live = *made, released = gone ? *gone : 0;
    live = live > released ? live - released : 0;
    if (live < SPANLET_SPAN_FACTS_MAX_PER_CGROUP)
        return 1;
    spanlet_facts_count(SPANLET_FACTS_REFUSED);
    __u64 one = 1;
    __u64 *refused = span_facts_cg_refused.lookup(&cg);
    if (refused)
        __sync_fetch_and_add(refused, 1);
    else if (span_facts_cg_refused.insert(&cg, &one) != 0 &&
             (refused = span_facts_cg_refused.lookup(&cg)))
        __sync_fetch_and_add(refused, 1);
    return 0;
}

/* A row was made for cgroup `cg` and span `k`: counted (in total and for the
 * cgroup) and the cgroup listed in the span's index entry. */
static __always_inline void spanlet_facts_made(struct span_facts_key *k)
{
    int zero = 0;
    __u64 *created = span_facts_created.lookup(&zero);
    if (created)
        __sync_fetch_and_add(created, 1);
    __u64 cg = k->cgroup_id, one = 1;
    __u64 *made = span_facts_cg_created.lookup(&cg);
    if (made)
        __sync_fetch_and_add(made, 1);
    else if (span_facts_cg_created.insert(&cg, &one) != 0) {
        made = span_facts_cg_created.lookup(&cg);    /* another CPU made it, or the map is full */
        if (made)
            __sync_fetch_and_add(made, 1);
        else
            spanlet_facts_count(SPANLET_FACTS_CGROUPS_FULL);
    }
    struct span_facts_index_key ik = {};
    __builtin_memcpy(ik.trace_id, k->trace_id, 16);
    ik.span_id = k->span_id;
    struct span_facts_index_val iv = {};
    iv.cgroups[0] = cg;
    iv.n = 1;
    if (span_facts_index.insert(&ik, &iv) == 0)
        return;
    struct span_facts_index_val *v = span_facts_index.lookup(&ik);
    if (!v)
        return;
    /* BCC's target has no atomic that returns the old value: two CPUs that
     * read the same n write the same slot, one cgroup is lost from the list
     * and n (added atomically) is larger than the cgroups listed, which the
     * agent reads as an incomplete entry (as past SPANLET_FACTS_INDEX_CGROUPS):
     * it then also looks up the sender's own cgroups' rows, and any other
     * row waits for the sweep. */
    __u32 idx = *(volatile __u32 *)&v->n;
    __sync_fetch_and_add(&v->n, 1);
    if (idx < SPANLET_FACTS_INDEX_CGROUPS)
        v->cgroups[idx & (SPANLET_FACTS_INDEX_CGROUPS - 1)] = cg;
}

/* Never written: the zero value new facts rows start from. */
BPF_ARRAY(span_facts_zero, struct span_facts_val, 1);

/* The facts row of span `c` for the calling task's cgroup (`cgroup_id`), created (cgroup,
 * pid and time of this first event) when absent and the cgroup is under its
 * bound. Another CPU may create it between our lookup and our insert:
 * BPF_NOEXIST then fails and the row it made is looked up again. Rows
 * created are counted so that the agent can tell LRU evictions (created -
 * taken - swept - present). NULL when the row is refused (the cgroup's bound)
 * or the map refuses it. */
static __always_inline struct span_facts_val *spanlet_span_row_key(struct span_facts_key *k, __u32 pid)
{
    struct span_facts_val *row = span_facts.lookup(k);
    if (row)
        return row;
    if (!spanlet_facts_room(k->cgroup_id))
        return 0;
    /* Inserted from a zero value (the row is too big for the stack of the
     * programs that make rows), then stamped: a reader that takes the row in
     * between (the span exported while a thread makes its first fact) sees
     * cgroup 0 and time 0 on a row its key still names. */
    int zero = 0;
    struct span_facts_val *init = span_facts_zero.lookup(&zero);
    if (!init)
        return 0;
    if (span_facts.insert(k, init) != 0)
        return span_facts.lookup(k);
    spanlet_facts_made(k);
    row = span_facts.lookup(k);
    if (row) {
        row->cgroup_id = k->cgroup_id;
        row->first_ns = bpf_ktime_get_ns();
        row->pid = pid;
    }
    return row;
}

static __always_inline struct span_facts_val *spanlet_span_row_of(struct span_ctx_val *c, __u64 cgroup_id)
{
    struct span_facts_key k = {};
    __builtin_memcpy(k.trace_id, c->trace_id, 16);
    k.span_id = c->span_id;
    k.cgroup_id = cgroup_id;
    return spanlet_span_row_key(&k, (__u32)(bpf_get_current_pid_tgid() >> 32));
}

/* The same for the calling task's cgroup, where the caller has not read it. */
static __always_inline struct span_facts_val *spanlet_span_row(struct span_ctx_val *c)
{
    return spanlet_span_row_of(c, bpf_get_current_cgroup_id());
}

/* Each program has its own ring buffer and a count of records it could not
 * reserve there (read by the agent as events dropped). */
BPF_RINGBUF_OUTPUT(events, SPANLET_RINGBUF_PAGES);
BPF_PERCPU_ARRAY(spanlet_events_dropped_total, __u64, 1);

static __always_inline void spanlet_count_drop(void)
{
    int zero = 0;
    __u64 *n = spanlet_events_dropped_total.lookup(&zero);
    if (n)
        *n += 1;
}

/* A bound per cgroup on the records a process-context program sends (the
 * sampled GPU stream, sandbox records): SPANLET_RECORDS_PER_CGROUP_S a
 * second for each cgroup, so one pod that floods its own spans or pools
 * cannot fill the ring the others' records go through. 0: no bound. Records
 * refused are counted for their cgroup (the agent reads the map and keeps
 * the totals of cgroups the LRU forgets). Window start and count are reset
 * without a lock: two CPUs racing at a window's edge may each let one more
 * record through. */
#ifndef SPANLET_RECORDS_PER_CGROUP_S
#define SPANLET_RECORDS_PER_CGROUP_S 0
#endif
struct spanlet_cgroup_budget_val {
    __u64 window_ns;     /* CLOCK_MONOTONIC start of this one-second window */
    __u64 sent;          /* records sent in it */
    __u64 limited;       /* records refused since the entry was made */
};
BPF_TABLE("lru_hash", __u64, struct spanlet_cgroup_budget_val, cgroup_record_budget, 4096);

static __always_inline int spanlet_cgroup_may_send(void)
{
    if (SPANLET_RECORDS_PER_CGROUP_S == 0)
        return 1;
    __u64 cg = bpf_get_current_cgroup_id();
    __u64 now = bpf_ktime_get_ns();
    struct spanlet_cgroup_budget_val *b = cgroup_record_budget.lookup(&cg);
    if (!b) {
        struct spanlet_cgroup_budget_val init = {.window_ns = now, .sent = 1, .limited = 0};
        cgroup_record_budget.update(&cg, &init);
        return 1;
    }
    if (now - b->window_ns >= 1000000000ULL) {
        b->window_ns = now;
        b->sent = 0;
    }
    if (b->sent >= SPANLET_RECORDS_PER_CGROUP_S) {
        __sync_fetch_and_add(&b->limited, 1);
        return 0;
    }
    __sync_fetch_and_add(&b->sent, 1);
    return 1;
}

/* Fill the header for the current task: ids, cgroup, and the span context
 * of the calling thread when the marker has set one. */
static __always_inline void spanlet_fill_task_hdr(struct spanlet_hdr *h, __u16 kind)
{
    __u64 pid_tgid = bpf_get_current_pid_tgid();
    __u32 tid = (__u32)pid_tgid;
    h->ts_ns = bpf_ktime_get_ns();
    h->pid = pid_tgid >> 32;
    h->tid = tid;
    h->cgroup_id = bpf_get_current_cgroup_id();
    h->kind = kind;
    h->flags = 0;
    h->_pad = 0;
    struct span_ctx_val *c = span_ctx.lookup(&tid);
    if (c) {
        __builtin_memcpy(h->trace_id, c->trace_id, 16);
        h->span_id = c->span_id;
        h->modality = c->modality;
    } else {
        __builtin_memset(h->trace_id, 0, 16);
        h->span_id = 0;
        h->modality = SPANLET_MOD_OTHER;
    }
}

/* Span-context modality of the calling thread (OTHER when none). */
static __always_inline __u8 spanlet_current_modality(void)
{
    __u32 tid = (__u32)bpf_get_current_pid_tgid();
    struct span_ctx_val *c = span_ctx.lookup(&tid);
    return c ? c->modality : SPANLET_MOD_OTHER;
}

#endif
