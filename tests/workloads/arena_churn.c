/*
 * arena_churn: glibc malloc under four threads, for the soak (scripts/soak.py, shape "churn").
 *
 * What it imitates: a multi-threaded native service or library (a database engine, an inference server's
 * C++ runtime, a Python extension with worker threads) whose threads allocate and free objects of every
 * size all the time. glibc gives each thread an arena of its own: a non-main arena is a heap reserved with
 * mmap(PROT_NONE) that grows by mprotect and shrinks by madvise/mprotect again; blocks above the mmap
 * threshold get a mapping each (munmap on free, mremap on realloc), and the main arena moves the brk. So
 * the process's mappings change shape at every step, from four threads at once: a lazy restore has to
 * serve pages into mappings that are growing, shrinking and moving while it streams.
 *
 * Each thread keeps a table of objects and, at each step, does a fixed number of operations chosen by
 * its own seeded generator: malloc (small, medium, and above the mmap threshold), free, realloc (the kept
 * prefix is checked by the digest, the new tail filled), and rewrites; it also hashes a few live objects
 * into its own running digest. The threads meet at a barrier at the end of every step, so nothing depends
 * on how they are scheduled. At the end the main thread folds every thread's digest and every live
 * object's size and content into the digest it prints: it depends only on the arguments, and memory that
 * came back wrong after a restore changes it.
 *
 *   gcc -O2 -pthread -o arena_churn arena_churn.c
 *   ./arena_churn --seed 1 --steps 100 --step-seconds 0.1
 *
 * Output: "start-up: ..." once, "step N/M" per step, "done digest=<16 hex>" last.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define THREADS 4
#define SLOTS 256
#define OPS 48   /* per thread per step */
#define READS 6  /* objects hashed per thread per step */

struct obj {
    uint8_t *p;
    size_t n;
};

struct worker {
    int id;
    uint64_t rng;
    uint64_t digest;
    struct obj slot[SLOTS];
};

static struct worker workers[THREADS];
static pthread_barrier_t go, done;
static long steps;
static volatile long step_now;

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t fold_bytes(uint64_t h, const uint8_t *p, size_t n) { /* FNV-1a, 8 bytes at a time */
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

static void fill(uint8_t *p, size_t n, uint64_t seed) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = splitmix(&seed);
        memcpy(p + i, &w, 8);
    }
    for (; i < n; i++) p[i] = (uint8_t)splitmix(&seed);
}

/* Sizes: most small, a quarter medium, one in sixteen above the default mmap threshold (128 KiB). */
static size_t pick_size(uint64_t *rng) {
    uint64_t r = splitmix(rng);
    unsigned k = r % 16;
    r >>= 8;
    if (k < 11) return 16 + r % 2048;
    if (k < 15) return 4096 + r % (120 << 10);
    return (192 << 10) + r % (3 << 20);
}

static void *oom(size_t n) {
    fprintf(stderr, "arena_churn: out of memory (%zu bytes)\n", n);
    exit(1);
}

static void step(struct worker *w, long s) {
    for (int k = 0; k < OPS; k++) {
        uint64_t r = splitmix(&w->rng);
        struct obj *o = &w->slot[r % SLOTS];
        unsigned op = (r >> 16) % 8;
        if (o->p == NULL) {  /* malloc */
            o->n = pick_size(&w->rng);
            if (!(o->p = malloc(o->n))) oom(o->n);
            fill(o->p, o->n, r);
        } else if (op < 3) {  /* free */
            free(o->p);
            o->p = NULL;
            o->n = 0;
        } else if (op < 6) {  /* realloc: the prefix stays, the tail is new */
            size_t n = pick_size(&w->rng);
            uint8_t *p = realloc(o->p, n);
            if (!p) oom(n);
            if (n > o->n) fill(p + o->n, n - o->n, r);
            o->p = p;
            o->n = n;
        } else {  /* rewrite a few words in place */
            for (int i = 0; i < 8; i++) {
                size_t at = splitmix(&w->rng) % o->n;
                o->p[at] ^= (uint8_t)(s + i + 1);
            }
        }
    }
    for (int k = 0; k < READS; k++) {
        struct obj *o = &w->slot[splitmix(&w->rng) % SLOTS];
        w->digest = (w->digest ^ o->n) * 0x100000001b3ULL;
        if (o->p) w->digest = fold_bytes(w->digest, o->p, o->n);
    }
}

static void *run(void *arg) {
    struct worker *w = arg;
    for (;;) {
        pthread_barrier_wait(&go);
        long s = step_now;
        if (s > steps) return NULL;
        step(w, s);
        pthread_barrier_wait(&done);
    }
}

static void pause_for(double seconds) {
    if (seconds <= 0) return;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

int main(int argc, char **argv) {
    uint64_t seed = 1;
    double step_seconds = 0.1;
    steps = 100;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--step-seconds")) step_seconds = atof(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--steps N] [--seed N] [--step-seconds S]\n", argv[0]);
            return 2;
        }
    }
    printf("start-up: %d threads churning glibc malloc (pid %d)\n", THREADS, getpid());
    fflush(stdout);

    pthread_barrier_init(&go, NULL, THREADS + 1);
    pthread_barrier_init(&done, NULL, THREADS + 1);
    pthread_t tid[THREADS];
    for (int t = 0; t < THREADS; t++) {
        workers[t].id = t;
        workers[t].rng = seed * 0x2545f4914f6cdd1dULL + (uint64_t)t;
        workers[t].digest = 0xcbf29ce484222325ULL ^ (uint64_t)t;
        if ((errno = pthread_create(&tid[t], NULL, run, &workers[t])) != 0) {
            perror("arena_churn: pthread_create");
            return 1;
        }
    }
    for (long s = 1; s <= steps; s++) {
        step_now = s;
        pthread_barrier_wait(&go);
        pthread_barrier_wait(&done);
        printf("step %ld/%ld\n", s, steps);
        fflush(stdout);
        pause_for(step_seconds);
    }
    step_now = steps + 1;
    pthread_barrier_wait(&go);
    for (int t = 0; t < THREADS; t++) pthread_join(tid[t], NULL);

    uint64_t digest = 0xcbf29ce484222325ULL ^ seed;
    size_t live = 0;
    for (int t = 0; t < THREADS; t++) {
        digest = (digest ^ workers[t].digest) * 0x100000001b3ULL;
        for (int i = 0; i < SLOTS; i++) {
            struct obj *o = &workers[t].slot[i];
            digest = (digest ^ o->n) * 0x100000001b3ULL;
            if (o->p) digest = fold_bytes(digest, o->p, o->n);
            live += o->n;
        }
    }
    fprintf(stderr, "arena_churn: %zu bytes live at the end\n", live);
    printf("done digest=%016llx\n", (unsigned long long)digest);
    fflush(stdout);
    return 0;
}
