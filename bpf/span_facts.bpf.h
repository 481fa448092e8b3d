/* span_facts.bpf.h: the span context and span facts maps and their helpers,
 * for CO-RE programs (libbpf C; spanlet.h is their BCC form, for the
 * programs BCC still compiles). The maps are pinned by name in the agent's
 * pin folder (the object's pin root): span_ctx.bpf.c makes them, every other
 * program of the agent opens them there. Their sizes are set by the agent
 * before load; the bound on one cgroup's live rows is a setting. */
#ifndef SPANLET_SPAN_FACTS_BPF_H
#define SPANLET_SPAN_FACTS_BPF_H

#include "spanlet_types.h"

const volatile __u64 span_facts_max_per_cgroup = SPANLET_SPAN_FACTS_MAX_PER_CGROUP;

/* A BTF-defined map; what follows the bound (`...`) goes into its definition. */
#define SPANLET_MAP(kind, name, key_t, value_t, entries, ...) \
    struct {                                                  \
        __uint(type, kind);                                   \
        __uint(max_entries, entries);                         \
        __type(key, key_t);                                   \
        __type(value, value_t);                               \
        __VA_ARGS__                                           \
    } name SEC(".maps")
/* The same, pinned by name in the object's pin root (the agent's pin folder). */
#define SPANLET_PINNED_MAP(kind, name, key_t, value_t, entries) \
    SPANLET_MAP(kind, name, key_t, value_t, entries, __uint(pinning, LIBBPF_PIN_BY_NAME);)

SPANLET_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, span_ctx, __u32, struct span_ctx_val, SPANLET_SPAN_CTX_MAX);
SPANLET_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, span_facts, struct span_facts_key, struct span_facts_val,
                   SPANLET_SPAN_FACTS_MAX);
SPANLET_PINNED_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, span_facts_created, __u32, __u64, 1);
SPANLET_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, span_facts_index, struct span_facts_index_key,
                   struct span_facts_index_val, SPANLET_SPAN_FACTS_MAX);
SPANLET_PINNED_MAP(BPF_MAP_TYPE_HASH, span_facts_cg_created, __u64, __u64, SPANLET_FACTS_CGROUPS);
SPANLET_PINNED_MAP(BPF_MAP_TYPE_HASH, span_facts_cg_released, __u64, __u64, SPANLET_FACTS_CGROUPS);
SPANLET_PINNED_MAP(BPF_MAP_TYPE_LRU_HASH, span_facts_cg_refused, __u64, __u64, SPANLET_FACTS_CGROUPS);
/* [0] events refused a row by the per-cgroup bound, [1] rows of cgroups past
 * SPANLET_FACTS_CGROUPS (made, bounded by the total only) */
SPANLET_PINNED_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, span_facts_refused, __u32, __u64, 2);
#define SPANLET_FACTS_REFUSED 0
#define SPANLET_FACTS_CGROUPS_FULL 1
/* Never written: the zero value new facts rows start from. */
SPANLET_MAP(BPF_MAP_TYPE_ARRAY, span_facts_zero, __u32, struct span_facts_val, 1);

/* Each program has its own ring buffer (sized by the agent) and a count of
 * records it could not reserve there (read by the agent as events dropped). */
struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, SPANLET_RINGBUF_PAGES * 4096);
} events SEC(".maps");
SPANLET_MAP(BPF_MAP_TYPE_PERCPU_ARRAY, spanlet_events_dropped_total, __u32, __u64, 1);

/* The calling thread's span context, NULL outside spans. */
static __always_inline struct span_ctx_val *spanlet_current_span(void)
{
    __u32 tid = (__u32)bpf_get_current_pid_tgid();
    return bpf_map_lookup_elem(&span_ctx, &tid);
}

static __always_inline void spanlet_facts_count(__u32 slot)
{
    __u64 *n = bpf_map_lookup_elem(&span_facts_refused, &slot);
    if (n)
        __sync_fetch_and_add(n, 1);
}

/* Whether cgroup `cg` may make another row: live rows (rows made, counted
 * here, less rows gone, written by the agent's sweep and join) under
 * span_facts_max_per_cgroup. A refusal is counted for the cgroup, once per
 * event that gets no row. */
static __always_inline int spanlet_facts_room(__u64 cg)
{
    __u64 *made = bpf_map_lookup_elem(&span_facts_cg_created, &cg);
    if (!made)
        return 1;
    __u64 *gone = bpf_map_lookup_elem(&span_facts_cg_released, &cg);
    __u64 live = *made, released = gone ? *gone : 0;
    live = live > released ? live - released : 0;
    if (live < span_facts_max_per_cgroup)
        return 1;
    spanlet_facts_count(SPANLET_FACTS_REFUSED);
    __u64 one = 1;
    __u64 *refused = bpf_map_lookup_elem(&span_facts_cg_refused, &cg);
    if (refused)
        __sync_fetch_and_add(refused, 1);
    else if (bpf_map_update_elem(&span_facts_cg_refused, &cg, &one, BPF_NOEXIST) != 0 &&
             (refused = bpf_map_lookup_elem(&span_facts_cg_refused, &cg)))
        __sync_fetch_and_add(refused, 1);
    return 0;
}

/* A row was made for cgroup `cg` and span `k`: counted (in total and for the
 * cgroup) and the cgroup listed in the span's index entry. */
static __always_inline void spanlet_facts_made(struct span_facts_key *k)
{
    __u32 zero = 0;
    __u64 *created = bpf_map_lookup_elem(&span_facts_created, &zero);
    if (created)
        __sync_fetch_and_add(created, 1);
    __u64 cg = k->cgroup_id, one = 1;
    __u64 *made = bpf_map_lookup_elem(&span_facts_cg_created, &cg);
    if (made)
        __sync_fetch_and_add(made, 1);
    else if (bpf_map_update_elem(&span_facts_cg_created, &cg, &one, BPF_NOEXIST) != 0) {
        made = bpf_map_lookup_elem(&span_facts_cg_created, &cg);  /* another CPU made it, or the map is full */
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
    if (bpf_map_update_elem(&span_facts_index, &ik, &iv, BPF_NOEXIST) == 0)
        return;
    struct span_facts_index_val *v = bpf_map_lookup_elem(&span_facts_index, &ik);
    if (!v)
        return;
    /* The slot is taken atomically: two CPUs that add a cgroup at once write
     * two slots (the BCC form cannot, spanlet.h). */
    __u32 idx = __sync_fetch_and_add(&v->n, 1);
    if (idx < SPANLET_FACTS_INDEX_CGROUPS)
        v->cgroups[idx & (SPANLET_FACTS_INDEX_CGROUPS - 1)] = cg;
}

/* The facts row of span `k` for its cgroup, created (cgroup, pid and time of
 * this first event) when absent and the cgroup is under its bound. Another
 * CPU may create it between our lookup and our insert: BPF_NOEXIST then
 * fails and the row it made is looked up again. Rows created are counted so
 * that the agent can tell LRU evictions. NULL when the row is refused (the
 * cgroup's bound) or the map refuses it. Inserted from a zero value (too big
 * for the stack), then stamped: a reader that takes the row in between sees
 * cgroup 0 and time 0 on a row its key still names. */
static __always_inline struct span_facts_val *spanlet_span_row_key(struct span_facts_key *k, __u32 pid)
{
    struct span_facts_val *row = bpf_map_lookup_elem(&span_facts, k);
    if (row)
        return row;
    if (!spanlet_facts_room(k->cgroup_id))
        return 0;
    __u32 zero = 0;
    struct span_facts_val *init = bpf_map_lookup_elem(&span_facts_zero, &zero);
    if (!init)
        return 0;
    if (bpf_map_update_elem(&span_facts, k, init, BPF_NOEXIST) != 0)
        return bpf_map_lookup_elem(&span_facts, k);
    spanlet_facts_made(k);
    row = bpf_map_lookup_elem(&span_facts, k);
    if (row) {
        row->cgroup_id = k->cgroup_id;
        row->first_ns = bpf_ktime_get_ns();
        row->pid = pid;
    }
    return row;
}

#endif
