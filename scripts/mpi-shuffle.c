/* The OpenMPI baseline of `namdb bench shuffle` (the microbenchmark of Liu, Yin and
 * Blanas, TODS 2019, §7.1), run by scripts/mpi.sh under mpirun.
 *
 * Each rank generates its fragment of R(a, b): X tuples of two 8-byte columns, a
 * uniform (a SplitMix64 hash of b), b unique ((rank << 48) | i), exactly as
 * shuffle::testing::tuple(seed, rank, 0, i) does, then permutes it randomly. After a
 * barrier it measures memcpy (the fragment copied into another array, all ranks at
 * once), then shuffles, in rounds of one chunk of tuples per rank:
 *
 *   repartition: partition the chunk (N messages' worth, so each destination gets
 *                one message per round on average) into per-destination buffers
 *                by floor(a*N / 2^64), as shuffle::testing::partition does,
 *                MPI_Alltoall the counts, MPI_Alltoallv the data;
 *   broadcast:   each rank in turn is the root and MPI_Bcasts its chunk.
 *
 * Receivers consume every tuple into the checksum of shuffle::testing::Checksum (count,
 * wrapping sum and xor of a*K ^ b). Every rank also computes what every other
 * must receive from it; an MPI_Reduce of those per-destination checksums gives each
 * rank's expectation, and the run fails unless all ranks received exactly that.
 *
 * Rank 0 prints one JSON line per pattern on stdout:
 *   {"design":"mpi","pattern":"repartition","nodes":N,"threads":1,"message_bytes":B,
 *    "tuples":X,"gb_per_sec":..,"gb_per_sec_min":..,"memcpy_gb_per_sec":..,
 *    "setup_ms":..,"seconds":..,"received_bytes":..,"verified":true}
 * gb_per_sec is the median over ranks of bytes received per second (min alongside);
 * setup_ms the slowest rank's MPI_Init and first barrier; seconds the slowest rank's.
 *
 * Progress: with --progress-file FILE, rank 0 appends `progress STEP PHASE DONE TOTAL`
 * lines to FILE, STEP 0 for repartition and 1 for broadcast, PHASE one of preparing,
 * shuffling, verifying; while shuffling, DONE of TOTAL tuples sent (rank 0's own in
 * repartition, all roots' in broadcast). A line comes at each change of phase, outside
 * the timed exchange, and, with --progress-ms P above 0, between two rounds once P ms
 * have passed since the last, with rank 0's clock stopped around the write: a clock
 * read per round and a write to a file every P ms is what the exchange pays for it.
 * Not stderr: a write there goes down mpirun's pipe and wakes mpirun's output
 * forwarding, one more process wanting the cores the spinning ranks run on; a write to
 * a file wakes nobody.
 *
 * Usage: mpi-shuffle --tuples X [--pattern repartition|broadcast|both]
 *                    [--message-bytes B] [--seed S] [--progress-file FILE]
 *                    [--progress-ms P]
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

/* Timed copies of the fragment; the fastest is the memcpy reference. */
#define MEMCPY_TRIES 3

typedef struct {
    uint64_t count, sum, xor_;
} checksum;

static uint64_t mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Tuples ahead the partition loop prefetches: fabric::PREFETCH_AHEAD_BYTES / 16. */
#define PREFETCH_AHEAD 128

/* The same checksum and partition function as shuffle::testing. */
static inline void add(checksum *c, uint64_t a, uint64_t b) {
    uint64_t h = (a * 0x9e3779b97f4a7c15ULL) ^ b;
    c->count++;
    c->sum += h;
    c->xor_ ^= h;
}

static inline int partition(uint64_t a, int nodes) {
    return (int)(((unsigned __int128)a * (unsigned __int128)nodes) >> 64);
}

static void die(const char *msg) {
    fprintf(stderr, "mpi-shuffle: %s\n", msg);
    MPI_Abort(MPI_COMM_WORLD, 2);
    exit(2);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 8);
    if (!p) die("out of memory");
    return p;
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* Median and min over ranks of `mine`, on rank 0. */
static void spread(double mine, int rank, int nodes, double *median, double *min) {
    double *all = rank == 0 ? xmalloc(sizeof(double) * nodes) : NULL;
    MPI_Gather(&mine, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        qsort(all, nodes, sizeof(double), cmp_double);
        *median = nodes % 2 ? all[nodes / 2] : (all[nodes / 2 - 1] + all[nodes / 2]) / 2;
        *min = all[0];
        free(all);
    }
}

/* Reduces per-destination checksums (count, sum with wrapping add, xor) to what each
 * rank must receive; returns this rank's expectation. */
static checksum expectation(checksum *per_dest, int rank, int nodes) {
    uint64_t *counts = xmalloc(sizeof(uint64_t) * nodes), *sums = xmalloc(sizeof(uint64_t) * nodes),
             *xors = xmalloc(sizeof(uint64_t) * nodes);
    for (int d = 0; d < nodes; d++) {
        counts[d] = per_dest[d].count;
        sums[d] = per_dest[d].sum;
        xors[d] = per_dest[d].xor_;
    }
    uint64_t *rc = xmalloc(sizeof(uint64_t) * nodes), *rs = xmalloc(sizeof(uint64_t) * nodes),
             *rx = xmalloc(sizeof(uint64_t) * nodes);
    /* Unsigned 64-bit MPI_SUM wraps, as the checksum's sum does. */
    MPI_Allreduce(counts, rc, nodes, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(sums, rs, nodes, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(xors, rx, nodes, MPI_UINT64_T, MPI_BXOR, MPI_COMM_WORLD);
    checksum c = {rc[rank], rs[rank], rx[rank]};
    free(counts); free(sums); free(xors); free(rc); free(rs); free(rx);
    return c;
}

/* Rank 0's progress lines (see the top of the file); NULL: none. */
static FILE *progress_out;
static double progress_every_s, progress_last;

static void progress(int step, const char *phase, uint64_t done, uint64_t total) {
    if (!progress_out) return;
    fprintf(progress_out, "progress %d %s %llu %llu\n", step, phase, (unsigned long long)done,
            (unsigned long long)total);
    fflush(progress_out);
    progress_last = MPI_Wtime();
}

/* Between two rounds of the timed exchange that started at *start: a line if the
 * interval has passed, with the clock stopped (*start moved on by the write's time). */
static inline void progress_tick(double *start, int step, uint64_t done, uint64_t total) {
    if (!progress_out || progress_every_s <= 0) return;
    double now = MPI_Wtime();
    if (now - progress_last < progress_every_s) return;
    progress(step, "shuffling", done, total);
    *start += progress_last - now;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* A rank ends when mpirun does. mpirun stopped by a signal stops its ranks, but not
 * always one it is still launching: killed at that moment (the benchmark stopped as the
 * run began), it left a rank blocked for good, orphaned and waiting for a
 * peer that had gone. mpi.sh names mpirun's pid (the shell's, which execs it); a
 * rank whose parent is already another has lost mpirun before it could ask to follow. */
static void end_with_mpirun(void) {
    const char *mpirun = getenv("NAMDB_MPIRUN_PID");
    if (!mpirun) return;
    /* Before MPI_Init: die() would call MPI_Abort. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
        perror("mpi-shuffle: prctl(PR_SET_PDEATHSIG)");
        exit(2);
    }
    if (getppid() != (pid_t)atol(mpirun)) _exit(1);
}

int main(int argc, char **argv) {
    end_with_mpirun();
    /* Setup: MPI_Init and a first barrier (the connections the ranks need). */
    double init_start = now_ms();
    MPI_Init(&argc, &argv);
    MPI_Barrier(MPI_COMM_WORLD);
    double setup_ms = now_ms() - init_start;
    int rank, nodes;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nodes);

    uint64_t tuples = 0, seed = 7;
    long message_bytes = 128 << 10, progress_ms = 0;
    const char *progress_file = NULL;
    const char *pattern = "both";
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) die("every option takes a value");
        if (!strcmp(argv[i], "--tuples")) tuples = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--message-bytes")) message_bytes = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--pattern")) pattern = argv[++i];
        else if (!strcmp(argv[i], "--progress-ms")) progress_ms = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--progress-file")) progress_file = argv[++i];
        else die("unknown option (expected --tuples, --pattern, --message-bytes, --seed, "
                 "--progress-file, --progress-ms)");
    }
    if (tuples == 0) die("--tuples must be at least 1");
    if (message_bytes < 16) die("--message-bytes must be at least 16");
    int do_rep = !strcmp(pattern, "repartition") || !strcmp(pattern, "both");
    int do_bc = !strcmp(pattern, "broadcast") || !strcmp(pattern, "both");
    if (!do_rep && !do_bc) die("--pattern must be repartition, broadcast or both");
    if (progress_ms < 0) die("--progress-ms must be at least 0");
    if (rank == 0 && progress_file && !(progress_out = fopen(progress_file, "a")))
        die("cannot open --progress-file");
    progress_every_s = progress_ms / 1e3;
    progress(do_rep ? 0 : 1, "preparing", 0, 0);

    /* The fragment, then a Fisher-Yates permutation of it. */
    uint64_t *frag = xmalloc(tuples * 16), *copy = xmalloc(tuples * 16);
    for (uint64_t i = 0; i < tuples; i++) {
        uint64_t b = (uint64_t)rank << 48 | i;
        frag[2 * i] = mix(seed ^ b);
        frag[2 * i + 1] = b;
    }
    uint64_t rng = mix(seed + 1000003ULL * (uint64_t)(rank + 1));
    for (uint64_t i = tuples - 1; i > 0; i--) {
        rng = mix(rng);
        uint64_t j = rng % (i + 1);
        uint64_t a = frag[2 * i], b = frag[2 * i + 1];
        frag[2 * i] = frag[2 * j];
        frag[2 * i + 1] = frag[2 * j + 1];
        frag[2 * j] = a;
        frag[2 * j + 1] = b;
    }

    /* memcpy of the same bytes, every rank at once, into an array already touched (as
     * the Rust harness does): the best of MEMCPY_TRIES copies, so that one copy
     * descheduled on a busy machine does not lower the reference. */
    memcpy(copy, frag, tuples * 16);
    double memcpy_s = 1e30;
    for (int try = 0; try < MEMCPY_TRIES; try++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        memcpy(copy, frag, tuples * 16);
        double s = MPI_Wtime() - t0;
        if (s < memcpy_s) memcpy_s = s;
    }
    volatile uint64_t sink = copy[tuples - 1];
    (void)sink;
    double memcpy_med, memcpy_min, setup_med, setup_max;
    spread(-setup_ms, rank, nodes, &setup_med, &setup_max);
    setup_ms = -setup_max;
    spread(tuples * 16 / memcpy_s / 1e9, rank, nodes, &memcpy_med, &memcpy_min);
    free(copy);

    /* The tuples of one message. */
    uint64_t message_tuples = message_bytes / 16;
    if (message_tuples == 0) message_tuples = 1;

    for (int p = 0; p < 2; p++) {
        int rep = p == 0;
        if ((rep && !do_rep) || (!rep && !do_bc)) continue;
        /* A round: a message per destination on average (repartition), or one message
         * from the root (broadcast). */
        uint64_t chunk = message_tuples * (rep ? (uint64_t)nodes : 1);
        progress(p, "preparing", 0, 0);
        checksum *per_dest = xmalloc(sizeof(checksum) * nodes);
        memset(per_dest, 0, sizeof(checksum) * nodes);
        for (uint64_t i = 0; i < tuples; i++) {
            uint64_t a = frag[2 * i], b = frag[2 * i + 1];
            if (rep) add(&per_dest[partition(a, nodes)], a, b);
            else
                for (int d = 0; d < nodes; d++)
                    if (d != rank) add(&per_dest[d], a, b);
        }
        checksum want = expectation(per_dest, rank, nodes), got = {0, 0, 0};
        free(per_dest);
        uint64_t received_bytes = 0;

        /* Every rank runs the same number of rounds. */
        uint64_t my_rounds = (tuples + chunk - 1) / chunk, rounds;
        MPI_Allreduce(&my_rounds, &rounds, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
        /* Tuples rank 0 sends: its fragment, or every root's in turn. */
        uint64_t to_send = rep ? tuples : tuples * (uint64_t)nodes;
        progress(p, "shuffling", 0, to_send);

        MPI_Barrier(MPI_COMM_WORLD);
        double start = MPI_Wtime();
        if (rep) {
            /* Per-destination buffers hold at most a chunk each. */
            uint64_t *out = xmalloc(chunk * 16 * nodes), *in = xmalloc(chunk * 16 * nodes);
            int *scount = xmalloc(sizeof(int) * nodes), *rcount = xmalloc(sizeof(int) * nodes),
                *sdispl = xmalloc(sizeof(int) * nodes), *rdispl = xmalloc(sizeof(int) * nodes);
            for (uint64_t r = 0; r < rounds; r++) {
                uint64_t lo = r * chunk, hi = lo + chunk;
                if (lo > tuples) lo = tuples;
                if (hi > tuples) hi = tuples;
                for (int d = 0; d < nodes; d++) {
                    scount[d] = 0;
                    sdispl[d] = (int)(d * chunk * 2);
                }
                for (uint64_t i = lo; i < hi; i++) {
                    /* The same read-ahead as the Rust partition loop (2 KiB ahead,
                     * once per cache line): these cores prefetch little by
                     * themselves. */
                    if (i % 4 == 0) __builtin_prefetch(frag + 2 * (i + PREFETCH_AHEAD));
                    uint64_t a = frag[2 * i];
                    int d = partition(a, nodes);
                    uint64_t *slot = out + sdispl[d] + scount[d];
                    slot[0] = a;
                    slot[1] = frag[2 * i + 1];
                    scount[d] += 2;
                }
                MPI_Alltoall(scount, 1, MPI_INT, rcount, 1, MPI_INT, MPI_COMM_WORLD);
                int at = 0;
                for (int d = 0; d < nodes; d++) {
                    rdispl[d] = at;
                    at += rcount[d];
                }
                MPI_Alltoallv(out, scount, sdispl, MPI_UINT64_T, in, rcount, rdispl,
                              MPI_UINT64_T, MPI_COMM_WORLD);
                for (int w = 0; w < at; w += 2) add(&got, in[w], in[w + 1]);
                /* Every tuple a rank consumes counts, its own partition included, as
                 * in the Rust harness (whose endpoints deliver it like any other). */
                received_bytes += (uint64_t)at * 8;
                progress_tick(&start, p, hi, to_send);
            }
            free(out); free(in); free(scount); free(rcount); free(sdispl); free(rdispl);
        } else {
            uint64_t *buf = xmalloc(chunk * 16);
            for (int root = 0; root < nodes; root++) {
                for (uint64_t r = 0; r < rounds; r++) {
                    uint64_t lo = r * chunk, hi = lo + chunk;
                    if (lo > tuples) lo = tuples;
                    if (hi > tuples) hi = tuples;
                    int n = (int)(hi - lo) * 2;
                    if (root == rank) memcpy(buf, frag + 2 * lo, (size_t)n * 8);
                    /* Everybody has the same X, so every rank knows n. */
                    MPI_Bcast(buf, n, MPI_UINT64_T, root, MPI_COMM_WORLD);
                    if (root != rank) {
                        for (int w = 0; w < n; w += 2) add(&got, buf[w], buf[w + 1]);
                        received_bytes += (uint64_t)n * 8;
                    }
                    progress_tick(&start, p, (uint64_t)root * tuples + hi, to_send);
                }
            }
            free(buf);
        }
        double seconds = MPI_Wtime() - start;
        progress(p, "verifying", 0, 0);
        MPI_Barrier(MPI_COMM_WORLD);
        double all_seconds;
        MPI_Allreduce(&seconds, &all_seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

        int ok = got.count == want.count && got.sum == want.sum && got.xor_ == want.xor_, all_ok;
        if (!ok)
            fprintf(stderr,
                    "mpi-shuffle: rank %d received count %llu sum %llu xor %llu, expected "
                    "count %llu sum %llu xor %llu\n",
                    rank, (unsigned long long)got.count, (unsigned long long)got.sum,
                    (unsigned long long)got.xor_, (unsigned long long)want.count,
                    (unsigned long long)want.sum, (unsigned long long)want.xor_);
        MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
        double med, min;
        spread(received_bytes / seconds / 1e9, rank, nodes, &med, &min);
        uint64_t total_received;
        MPI_Reduce(&received_bytes, &total_received, 1, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("{\"design\":\"mpi\",\"pattern\":\"%s\",\"nodes\":%d,\"threads\":1,"
                   "\"message_bytes\":%ld,\"tuples\":%llu,\"gb_per_sec\":%.6f,"
                   "\"gb_per_sec_min\":%.6f,\"memcpy_gb_per_sec\":%.6f,\"setup_ms\":%.3f,"
                   "\"seconds\":%.6f,\"received_bytes\":%llu,\"verified\":%s}\n",
                   rep ? "repartition" : "broadcast", nodes, message_bytes,
                   (unsigned long long)tuples, med, min, memcpy_med, setup_ms, all_seconds,
                   (unsigned long long)total_received, all_ok ? "true" : "false");
            fflush(stdout);
        }
        if (!all_ok) {
            MPI_Finalize();
            return 1;
        }
    }
    free(frag);
    if (progress_out) fclose(progress_out);
    MPI_Finalize();
    return 0;
}
