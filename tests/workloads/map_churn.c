/*
 * map_churn: a process that keeps changing the mappings of its memory, for the soak (scripts/soak.py,
 * shape "maps"). It reproduces the bug report of a lazy restore that came back wrong under a
 * memory-hungry native program.
 *
 * What it imitates: a big native heap that is not one mapping for long. glibc's thread arenas grow and
 * shrink their heaps with mprotect, the JVM commits and uncommits parts of its reserved heap with
 * mprotect/madvise, Go's runtime returns spans with madvise(MADV_DONTNEED) and sets guard pages, and
 * allocators give big free blocks back with munmap. A program of that kind also forks (a shell-out, a
 * helper, a pre-fork server's worker) while its heap is big, so a child shares the heap copy-on-write.
 * All of that splits the one big mapping a checkpoint saw into many VMAs, or removes parts of it, while a
 * lazy restore is still streaming the pages in: whoever serves the page faults must follow the VMA
 * changes (and the child's copy) without dropping or misplacing a page.
 *
 * It holds --mb MiB of seeded content in one private anonymous mapping, and at each step:
 *   - writes a few pages (so every checkpoint has changed pages);
 *   - makes a 256 KiB island read-only with mprotect, a different place each step, and makes about half
 *     of them writable again 2 to 5 steps later;
 *   - reads a 4 MiB window page by page, folding it into a running digest;
 *   - forks a child that reads another 4 MiB window, waits a little (so a checkpoint can catch it), and
 *     sends its hash back over a pipe; the parent folds it in;
 *   - every 10th step, purges a 1 MiB slice (madvise(MADV_DONTNEED), then munmap) and records it as gone:
 *     later windows fold a fixed marker for its pages instead of reading them.
 * At the end it folds all remaining memory into the digest and prints it. Everything is derived from
 * --seed and the step number: the digest depends only on the arguments, and any page that came back
 * wrong (zeros, another page's content, an old version) after a restore changes it.
 *
 *   gcc -O2 -o map_churn map_churn.c
 *   ./map_churn --mb 64 --steps 40 --seed 1 --step-seconds 0.1
 *
 * Output: "start-up: ..." once, "step N/M" per step, "done digest=<16 hex>" last.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1UL << 20)
#define ISLAND (256UL << 10)
#define WINDOW (4UL << 20)
#define SLICE MIB

static uint8_t *base;
static size_t size, page;
static size_t n_islands;   /* 256 KiB units of the mapping */
static int *ro_until;      /* per unit: 0 writable, -1 read-only for good, s > 0: read-only until step s */
static uint8_t *gone;      /* per 1 MiB slice: unmapped */

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t fold(uint64_t h, uint64_t w) { /* FNV-1a over 64-bit words */
    return (h ^ w) * 0x100000001b3ULL;
}

static int is_gone(size_t off) { return gone[off / SLICE]; }
static int is_ro(size_t off) { return ro_until[off / ISLAND] != 0; }

/* The hash of [off, off + len) page by page; a page of a gone slice folds a marker instead. */
static uint64_t hash_range(uint64_t h, size_t off, size_t len) {
    for (size_t p = off; p < off + len; p += page) {
        if (is_gone(p)) {
            h = fold(h, 0xdeadbeefULL ^ p);
            continue;
        }
        const uint64_t *w = (const uint64_t *)(base + p);
        for (size_t i = 0; i < page / 8; i++) h = fold(h, w[i]);
    }
    return h;
}

static void die(const char *what) {
    fprintf(stderr, "map_churn: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void pause_for(double seconds) {
    if (seconds <= 0) return;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

int main(int argc, char **argv) {
    long mb = 1024, steps = 100;
    uint64_t seed = 1;
    double step_seconds = 0.1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--mb")) mb = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps")) steps = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--step-seconds")) step_seconds = atof(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--mb N] [--steps N] [--seed N] [--step-seconds S]\n", argv[0]);
            return 2;
        }
    }
    if (mb < 16) {
        fprintf(stderr, "map_churn: --mb must be at least 16\n");
        return 2;
    }
    printf("start-up: mapping %ld MiB (pid %d)\n", mb, getpid());
    fflush(stdout);

    page = (size_t)sysconf(_SC_PAGESIZE);
    size = (size_t)mb * MIB;
    base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) die("mmap");
    n_islands = size / ISLAND;
    ro_until = calloc(n_islands, sizeof *ro_until);
    gone = calloc(size / SLICE, 1);
    if (!ro_until || !gone) die("calloc");
    uint64_t x = seed;
    for (size_t i = 0; i < size / 8; i++) ((uint64_t *)base)[i] = splitmix(&x);

    uint64_t digest = fold(0xcbf29ce484222325ULL, seed);
    for (long s = 1; s <= steps; s++) {
        uint64_t r = seed * 1000003ULL + (uint64_t)s;  /* this step's choices */
        splitmix(&r);

        /* islands whose time is up become writable again */
        for (size_t u = 0; u < n_islands; u++)
            if (ro_until[u] > 0 && ro_until[u] <= s && !is_gone(u * ISLAND)) {
                if (mprotect(base + u * ISLAND, ISLAND, PROT_READ | PROT_WRITE) != 0) die("mprotect rw");
                ro_until[u] = 0;
            }

        /* a few writes: 16 pages, each gets a step-stamped word every 512 bytes */
        for (int k = 0; k < 16; k++) {
            size_t off = (splitmix(&r) % (size / page)) * page;
            if (is_gone(off) || is_ro(off)) continue;
            for (size_t i = 0; i < page; i += 512) *(uint64_t *)(base + off + i) ^= (uint64_t)s * 0x5bd1e995ULL + i;
        }

        /* a read-only island (never twice on the same unit, never in a gone slice) */
        for (int tries = 0; tries < 8; tries++) {
            size_t u = splitmix(&r) % n_islands;
            if (ro_until[u] || is_gone(u * ISLAND)) continue;
            if (mprotect(base + u * ISLAND, ISLAND, PROT_READ) != 0) die("mprotect ro");
            ro_until[u] = (splitmix(&r) & 1) ? (int)(s + 2 + splitmix(&r) % 4) : -1;
            break;
        }

        /* a 4 MiB window, page by page */
        size_t w = (splitmix(&r) % ((size - WINDOW) / page + 1)) * page;
        digest = hash_range(digest, w, WINDOW);

        /* a child reads another window, copy-on-write, and sends its hash back */
        size_t cw = (splitmix(&r) % ((size - WINDOW) / page + 1)) * page;
        int fds[2];
        if (pipe(fds) != 0) die("pipe");
        pid_t child = fork();
        if (child < 0) die("fork");
        if (child == 0) {
            close(fds[0]);
            uint64_t ch = hash_range(fold(0x84222325cbf29ce4ULL, (uint64_t)s), cw, WINDOW);
            pause_for(step_seconds / 2);
            if (write(fds[1], &ch, sizeof ch) != sizeof ch) _exit(1);
            _exit(0);
        }
        close(fds[1]);
        uint64_t ch;
        size_t got = 0;
        while (got < sizeof ch) {
            ssize_t n = read(fds[0], (char *)&ch + got, sizeof ch - got);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                fprintf(stderr, "map_churn: step %ld: the child sent %zu bytes of its hash\n", s, got);
                return 1;
            }
            got += (size_t)n;
        }
        close(fds[0]);
        int status;
        while (waitpid(child, &status, 0) < 0)
            if (errno != EINTR) die("waitpid");
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "map_churn: step %ld: the child ended with status %#x\n", s, status);
            return 1;
        }
        digest = fold(digest, ch);

        /* every 10th step: purge and unmap a 1 MiB slice */
        if (s % 10 == 0) {
            for (int tries = 0; tries < 16; tries++) {
                size_t sl = splitmix(&r) % (size / SLICE);
                if (gone[sl]) continue;
                if (madvise(base + sl * SLICE, SLICE, MADV_DONTNEED) != 0) die("madvise");
                if (munmap(base + sl * SLICE, SLICE) != 0) die("munmap");
                gone[sl] = 1;
                for (size_t u = sl * SLICE / ISLAND; u < (sl + 1) * SLICE / ISLAND; u++) ro_until[u] = 0;
                break;
            }
        }

        printf("step %ld/%ld\n", s, steps);
        fflush(stdout);
        pause_for(step_seconds);
    }
    digest = hash_range(digest, 0, size);
    printf("done digest=%016llx\n", (unsigned long long)digest);
    fflush(stdout);
    return 0;
}
