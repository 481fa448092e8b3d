/* A CO-RE object for the loader's tests: a setting, a program left out, a
 * tp_btf program reading task_struct through CO-RE, a uprobe, a ring
 * buffer and a map pinned by name. */
#include "core.h"
#include "fixture.h"

char LICENSE[] SEC("license") = "GPL";

const volatile __u32 target_tgid = 0;
const volatile __u64 call_weight = 1;
const volatile __s32 signed_setting = -5;
SPANLET_BTF_TYPE(struct fixture_event, event);

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024);
    __type(key, __u32);
    __type(value, struct fixture_seen);
} seen SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct fixture_calls);
} calls SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 16);
    __type(key, __u32);
    __type(value, __s64);
    __uint(pinning, LIBBPF_PIN_BY_NAME);
} fixture_shared SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, __u64);
} per_cpu_calls SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_RINGBUF);
    __uint(max_entries, 64 * 4096);
} events SEC(".maps");

SEC("tp_btf/sched_switch")
int BPF_PROG(on_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
    if (BPF_CORE_READ(prev, tgid) != target_tgid)
        return 0;
    __u32 tid = BPF_CORE_READ(prev, pid);
    struct fixture_seen zero = {}, *s = bpf_map_lookup_elem(&seen, &tid);
    if (!s) {
        bpf_map_update_elem(&seen, &tid, &zero, BPF_NOEXIST);
        s = bpf_map_lookup_elem(&seen, &tid);
        if (!s)
            return 0;
    }
    s->switches_out += 1;
    s->sum_exec_runtime = BPF_CORE_READ(prev, se.sum_exec_runtime);
    s->tgid = BPF_CORE_READ(prev, tgid);
    s->kind = 7;
    s->last = bpf_ktime_get_ns();
    return 0;
}

SEC("uprobe")
int BPF_KPROBE(on_call, __u64 a, __u64 b)
{
    __u32 zero = 0;
    struct fixture_calls *c = bpf_map_lookup_elem(&calls, &zero);
    if (!c)
        return 0;
    __sync_fetch_and_add(&c->n, call_weight);
    __sync_fetch_and_add(&c->args_sum, a + b);
    __u64 *mine = bpf_map_lookup_elem(&per_cpu_calls, &zero);
    if (mine)
        *mine += 1;
    __s64 n = c->n;
    bpf_map_update_elem(&fixture_shared, &zero, &n, BPF_ANY);
    struct fixture_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
    if (!e)
        return 0;
    __u64 id = bpf_get_current_pid_tgid();
    e->tgid = id >> 32;
    e->tid = (__u32)id;
    e->a = a;
    e->small = signed_setting < 0 ? 1 : 2;
    __builtin_memset(e->bytes, 0xab, sizeof(e->bytes));
    bpf_ringbuf_submit(e, 0);
    return 0;
}

/* left out by the tests (autoload off): it must not be loaded */
SEC("tracepoint/syscalls/sys_enter_getppid")
int left_out(void *ctx)
{
    return 0;
}
