/* random.h -- Per-process random 64-bit values for seeds and ids that must differ between
 * processes and across restarts (sampling seeds of unseeded requests): a splitmix64 stream
 * whose state starts from the OS (getrandom). Not for cryptography. */
#ifndef PD_RANDOM_H
#define PD_RANDOM_H

#include <stdint.h>

/* The next value of the process's stream. The first call seeds it from getrandom (falling
 * back to the clock, pid and an address where getrandom fails). Thread-safe, lock-free. */
uint64_t pd_random_u64(void);

#endif
