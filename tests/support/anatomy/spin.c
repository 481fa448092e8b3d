/* The anatomy tests' CPU work: spin until the calling thread has run `ns`
 * nanoseconds on a CPU (its own CPU clock), called through ctypes (which
 * lets go of the GIL, so that threads of one process compete for the CPU as
 * the kernel schedules them, not for the GIL). */
#include <time.h>

static long long thread_cpu_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

void spin_cpu_ns(long long ns)
{
	long long end = thread_cpu_ns() + ns;
	volatile unsigned long x = 0;
	while (thread_cpu_ns() < end)
		for (int i = 0; i < 1000; i++)
			x += i;
}
