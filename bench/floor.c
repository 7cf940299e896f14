/* The floor for the end-to-end mode of bench/handoff.py: the want/token protocol of
 * docs/protocol.md between two bare C processes, with nothing else in the path (no wrapper,
 * no records, no control channel). bench/handoff.py compiles it with gcc into a temporary
 * directory and runs it in the same run as the wrappers.
 *
 *     floor ARENA ROUNDS GAP_MIN_US GAP_MAX_US
 *
 * ARENA holds token.lock and want.lock already. Two processes take turns: in each round one
 * holds the token and the other, after a random gap, wants it.
 *
 * Holder: probe want.lock with LOCK_EX|LOCK_NB on an open file description of its own (a
 *   second open(), as a vramlock holder does); while nobody waits, sleep in poll() on an
 *   inotify descriptor (IN_OPEN on the arena directory) for at most 250 ms and probe again.
 *   When somebody waits, release at once: there is no memory to free.
 * Waiter: want.lock LOCK_SH (blocking), open and close token.lock (the ring that wakes the
 *   holder), flock(token, LOCK_EX) blocking in the kernel, check token.lock is still linked,
 *   drop want.lock. Then it tells the other process over a pipe that it owns the token, and
 *   the other one re-queues only after that: nobody barges.
 *
 * Output, one line per round, CLOCK_MONOTONIC nanoseconds (the clock of Python's
 * time.monotonic_ns()):  t0 t1 t2 t3
 *   t0  the waiter wants the token (just before its want.lock LOCK_SH)
 *   t1  the holder's probe saw it
 *   t2  just before the holder's LOCK_UN of the token (t2 - t1: the release, about 0 here)
 *   t3  the waiter owns the token and has dropped want.lock
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define OFLAGS (O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY)
#define PROBE_INTERVAL_MS 250 /* as vramlock/run/scheduler.py's PROBE_INTERVAL */

struct stamps {
    int64_t t0, t1, t2, t3;
};

struct member {
    int dir, want, probe, token, hint;
    int from_peer, to_peer; /* "the other one owns the token now" */
    unsigned seed;
};

static int64_t now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static int lock(int fd, int op) { /* blocking: keeps the kernel's queue order */
    int r;
    while ((r = flock(fd, op)) < 0 && errno == EINTR) {
    }
    return r;
}

static int open_lock(int dir, const char *name) {
    int fd = openat(dir, name, OFLAGS | O_RDWR);
    if (fd < 0)
        die(name);
    return fd;
}

static int wanted(int probe) {
    if (flock(probe, LOCK_EX | LOCK_NB) == 0) {
        flock(probe, LOCK_UN);
        return 0;
    }
    if (errno != EWOULDBLOCK)
        die("probe want.lock");
    return 1;
}

static void hold(struct member *m, struct stamps *s) {
    struct pollfd p = {.fd = m->hint, .events = POLLIN};
    char buf[4096];
    while (!wanted(m->probe)) {
        if (poll(&p, 1, PROBE_INTERVAL_MS) < 0 && errno != EINTR)
            die("poll");
        while (read(m->hint, buf, sizeof buf) > 0) {
        }
    }
    s->t1 = now();
    s->t2 = now(); /* nothing to free */
    if (flock(m->token, LOCK_UN) < 0)
        die("unlock token.lock");
}

static void wait_turn(struct member *m, struct stamps *s, unsigned gap_min, unsigned gap_max) {
    struct stat a, b;
    char c;
    if (read(m->from_peer, &c, 1) != 1) /* the other one owns the token: no barging */
        die("read from peer");
    usleep(gap_min + rand_r(&m->seed) % (gap_max - gap_min + 1));
    s->t0 = now();
    if (lock(m->want, LOCK_SH) < 0)
        die("lock want.lock");
    int ring = openat(m->dir, "token.lock", OFLAGS | O_RDONLY); /* IN_OPEN wakes the holder */
    if (ring >= 0)
        close(ring);
    if (lock(m->token, LOCK_EX) < 0)
        die("lock token.lock");
    if (fstat(m->token, &a) < 0 || a.st_nlink == 0 ||
        fstatat(m->dir, "token.lock", &b, AT_SYMLINK_NOFOLLOW) < 0 || a.st_ino != b.st_ino ||
        a.st_dev != b.st_dev)
        die("token.lock is no longer linked");
    flock(m->want, LOCK_UN);
    s->t3 = now();
    if (write(m->to_peer, "o", 1) != 1)
        die("write to peer");
}

static void member_main(int me, const char *arena, int rounds, struct stamps *stamps,
                        int from_peer, int to_peer, unsigned gap_min, unsigned gap_max) {
    struct member m = {.from_peer = from_peer, .to_peer = to_peer, .seed = 12345u + me};
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() == 1)
        die("parent gone");
    m.dir = open(arena, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (m.dir < 0)
        die(arena);
    m.want = open_lock(m.dir, "want.lock");
    m.probe = open_lock(m.dir, "want.lock"); /* an open file description of its own */
    m.token = open_lock(m.dir, "token.lock");
    m.hint = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (m.hint < 0 || inotify_add_watch(m.hint, arena, IN_OPEN) < 0)
        die("inotify");
    if (me == 0) { /* the first holder */
        if (lock(m.token, LOCK_EX) < 0)
            die("lock token.lock");
        if (write(m.to_peer, "o", 1) != 1)
            die("write to peer");
    }
    for (int i = 0; i < rounds; i++) {
        if (i % 2 == me)
            hold(&m, &stamps[i]);
        else
            wait_turn(&m, &stamps[i], gap_min, gap_max);
    }
    _exit(0); /* closing the descriptors drops whatever is still held */
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s ARENA ROUNDS GAP_MIN_US GAP_MAX_US\n", argv[0]);
        return 2;
    }
    int rounds = atoi(argv[2]);
    unsigned gap_min = (unsigned)atoi(argv[3]), gap_max = (unsigned)atoi(argv[4]);
    if (rounds < 1 || gap_max < gap_min) {
        fprintf(stderr, "%s: bad arguments\n", argv[0]);
        return 2;
    }
    struct stamps *stamps = mmap(NULL, sizeof *stamps * (size_t)rounds, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int a_to_b[2], b_to_a[2];
    if (stamps == MAP_FAILED || pipe2(a_to_b, O_CLOEXEC) < 0 || pipe2(b_to_a, O_CLOEXEC) < 0)
        die("setup");
    pid_t pids[2];
    for (int me = 0; me < 2; me++) {
        pids[me] = fork();
        if (pids[me] < 0)
            die("fork");
        if (pids[me] == 0) {
            if (me == 0)
                member_main(0, argv[1], rounds, stamps, b_to_a[0], a_to_b[1], gap_min, gap_max);
            else
                member_main(1, argv[1], rounds, stamps, a_to_b[0], b_to_a[1], gap_min, gap_max);
        }
    }
    int failed = 0;
    for (int me = 0; me < 2; me++) {
        int status;
        if (waitpid(pids[me], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
            failed = 1;
    }
    if (failed) {
        fprintf(stderr, "%s: a member failed\n", argv[0]);
        return 1;
    }
    for (int i = 0; i < rounds; i++)
        printf("%lld %lld %lld %lld\n", (long long)stamps[i].t0, (long long)stamps[i].t1,
               (long long)stamps[i].t2, (long long)stamps[i].t3);
    return 0;
}
