/*
 * dsec-agent: the in-sandbox agent (PID 1 of a sandbox). Wire protocol and semantics are in
 * docs/AGENT_PROTOCOL.md. Single-threaded: one poll() loop over the listening socket, a
 * signalfd (SIGCHLD, SIGTERM, SIGINT), client connections, child pipes and "sinks" (pipes still
 * held open by descendants of finished processes, drained and dropped until EOF).
 *
 * Objects are never freed while a poll round is being handled: they are marked dead and
 * swept at the end of the round, so every pollfd entry can be checked against its object.
 *
 * A background process may keep its stdin open for `I` (input) frames, bounded by STDIN_CAP
 * bytes not yet written (more is refused with EAGAIN: the client waits or gives up), or run on
 * a pseudo-terminal (`P`), whose output log keeps the most recent max_output bytes.
 *
 * Build: gcc -O2 -static -Wall -Wextra -o dsec-agent agent.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <linux/random.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/syscall.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define MAX_FRAME (64u << 20)
#define PIPE_CHUNK (64 << 10)      /* one read from a child pipe */
#define FILE_CHUNK (1 << 20)       /* one `D` frame */
#define ATTACH_CHUNK (256 << 10)   /* log bytes copied to an attacher per refill */
#define HIGH_WATER (256 << 10)     /* wait mode: stop reading pipes above this much unsent */
#define KEEP_FINISHED 256
#define DEFAULT_MAX_OUTPUT (16 << 20)
#define STDIN_CAP (1 << 20)        /* input accepted but not yet written to a process */
#define WINSIZE_MAX 10000          /* a terminal's columns and rows */
#define TTY_IDLE_MS 50             /* a terminal whose process exited: read on while output comes */
#define TTY_DRAIN_MS 2000          /* ... but for this long at most */

/* ---------- buffers and frames ---------- */

struct buf {
    char *p;
    size_t len, cap, off; /* off: bytes already sent/consumed */
};

/* Allocation failures abort: the agent has no sensible way to continue without memory. */
static void *xrealloc(void *p, size_t n)
{
    if (!(p = realloc(p, n ? n : 1)))
        abort();
    return p;
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (!p)
        abort();
    return p;
}

static void buf_reserve(struct buf *b, size_t n)
{
    if (b->len + n <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n)
        cap *= 2;
    b->p = xrealloc(b->p, cap);
    b->cap = cap;
}

static void buf_put(struct buf *b, const void *d, size_t n)
{
    buf_reserve(b, n);
    memcpy(b->p + b->len, d, n);
    b->len += n;
}

static size_t buf_pending(const struct buf *b) { return b->len - b->off; }

static void buf_free(struct buf *b)
{
    free(b->p);
    *b = (struct buf){0};
}

static void put_u32(struct buf *b, uint32_t v)
{
    unsigned char x[4] = {v >> 24, v >> 16, v >> 8, v};
    buf_put(b, x, 4);
}

static uint32_t get_u32(const char *p)
{
    const unsigned char *x = (const unsigned char *)p;
    return (uint32_t)x[0] << 24 | (uint32_t)x[1] << 16 | (uint32_t)x[2] << 8 | x[3];
}

/* A frame is built in place: reserve the length, append fields, then patch the length. */
static size_t frame_begin(struct buf *b, char type)
{
    size_t at = b->len;
    put_u32(b, 0);
    buf_put(b, &type, 1);
    return at;
}

static void frame_end(struct buf *b, size_t at)
{
    uint32_t n = b->len - at - 4;
    unsigned char *x = (unsigned char *)b->p + at;
    x[0] = n >> 24, x[1] = n >> 16, x[2] = n >> 8, x[3] = n;
}

static void field(struct buf *b, const char *k, const void *v, size_t n)
{
    unsigned char kl = strlen(k);
    buf_put(b, &kl, 1);
    buf_put(b, k, kl);
    put_u32(b, n);
    buf_put(b, v, n);
}

static void field_str(struct buf *b, const char *k, const char *v) { field(b, k, v, strlen(v)); }

static void field_fmt(struct buf *b, const char *k, const char *fmt, long long v)
{
    char s[32];
    field(b, k, s, snprintf(s, sizeof s, fmt, v));
}

static void field_int(struct buf *b, const char *k, long long v) { field_fmt(b, k, "%lld", v); }

static void reply_ok(struct buf *b) { frame_end(b, frame_begin(b, 'O')); }

static void reply_err(struct buf *b, int e, const char *msg)
{
    const char *name = strerrorname_np(e);
    size_t at = frame_begin(b, 'X');
    field_str(b, "errno", name ? name : "EIO");
    field_str(b, "message", msg);
    frame_end(b, at);
}

/* "<what>: <strerror(e)>" as an X reply. */
static void reply_errno(struct buf *b, int e, const char *what)
{
    char msg[4200];
    snprintf(msg, sizeof msg, "%s: %s", what, strerror(e));
    reply_err(b, e, msg);
}

/* ---------- requests ---------- */

struct field {
    const char *k;
    char *v; /* NUL-terminated in place; n excludes the NUL */
    uint32_t n;
};

struct req {
    char type;
    struct field *f;
    int nf;
};

/* Parses body[0..len) (which has one spare byte after it) and NUL-terminates keys and values in
 * place: the byte after a key or value belongs to the next length field, read before. */
static int parse(char *body, uint32_t len, struct req *r)
{
    char *q = body + 1, *end = body + len;
    int cap = 0;
    r->type = body[0];
    r->f = NULL;
    r->nf = 0;
    while (q < end) {
        uint32_t kl = (unsigned char)*q, n;
        if ((size_t)(end - q) < 5 + kl)
            return -1;
        n = get_u32(q + 1 + kl);
        if ((size_t)(end - q) - 5 - kl < n)
            return -1;
        if (r->nf == cap)
            r->f = xrealloc(r->f, (cap = cap ? 2 * cap : 16) * sizeof *r->f);
        r->f[r->nf++] = (struct field){q + 1, q + 5 + kl, n};
        q += 5 + kl + n;
    }
    for (int i = 0; i < r->nf; i++) {
        ((char *)r->f[i].k)[r->f[i].v - r->f[i].k - 4] = 0;
        r->f[i].v[r->f[i].n] = 0;
    }
    return 0;
}

static struct field *get(const struct req *r, const char *k)
{
    for (int i = 0; i < r->nf; i++)
        if (!strcmp(r->f[i].k, k))
            return &r->f[i];
    return NULL;
}

static int is_text(const struct field *f) { return strlen(f->v) == f->n; }

/* Optional string field: 0 and *out = NULL if absent, -1 if it contains a NUL. */
static int get_str(const struct req *r, const char *k, char **out)
{
    struct field *f = get(r, k);
    *out = f ? f->v : NULL;
    return f && !is_text(f) ? -1 : 0;
}

static int get_num(const struct req *r, const char *k, int base, long long lo, long long hi,
                   long long dflt, long long *out)
{
    struct field *f = get(r, k);
    char *end;
    if (!f) {
        *out = dflt;
        return 0;
    }
    errno = 0;
    *out = strtoll(f->v, &end, base);
    return errno || !f->n || end != f->v + f->n || *out < lo || *out > hi ? -1 : 0;
}

static int get_flag(const struct req *r, const char *k, int *out)
{
    long long v;
    int rc = get_num(r, k, 10, 0, 1, 0, &v);
    *out = v;
    return rc;
}

/* ---------- state ---------- */

struct proc;

struct conn {
    struct conn *next;
    int fd, dead, dispatched;
    struct buf in, out;
    struct proc *proc;   /* wait-mode exec streaming to this connection */
    struct proc *attach; /* background process this connection is attached to */
    size_t off;          /* attach: absolute offset of the next log frame to send */
    int file_fd;         /* file read in progress */
    /* `N`: a TCP connection to a port inside the sandbox, piped raw once `O` is sent.
     * tun_state: 0 none, 1 connecting, 2 open. up: bytes from the client not yet written to
     * the port (read only while empty: one PIPE_CHUNK at most); the port's bytes go to out
     * (read only while out is empty), so the agent holds at most two chunks per tunnel. */
    int tun, tun_state, tun_eof;
    struct buf up;
};

struct proc {
    struct proc *next;
    long id; /* background only; 0 for wait mode */
    pid_t pid;
    char *cmd;
    int background, running, dead, nattach;
    int exited; /* reaped; running until its terminal's output is read (see proc_exited) */
    int out[2]; /* stdout/stderr read ends; -1 once closed or handed to the sinks */
    int in;     /* stdin write end (a terminal's: a dup of its master) while open */
    int stdin_open; /* takes `I` frames; 0: closed once stdin_data is written */
    int tty;        /* on a pseudo-terminal: out[0] is its master, out[1] unused */
    struct buf stdin_data;
    size_t max_output, kept[2];
    int truncated[2], timed_out, status;
    /* background: `o` frames, replayed to each attacher. A terminal keeps the last max_output
     * bytes: log.off is where its live frames start, log_base the absolute offset of log.p[0]
     * (attachers count in absolute offsets, so dropping old frames moves nobody). */
    struct buf log;
    size_t log_base;
    struct conn *waiter;
    long long start, deadline, duration;
    long long drain_idle, drain_end; /* an exited terminal: when reading its master stops */
};

static struct conn *conns;
static struct proc *procs, **procs_tail = &procs;
static int *sinks, nsinks;
static long next_id = 1;
static int sig_fd;
static struct rlimit nofile; /* as inherited; restored for children */

static long long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000LL + t.tv_nsec / 1000000;
}

static void sink_add(int fd)
{
    sinks = xrealloc(sinks, (nsinks + 1) * sizeof *sinks);
    sinks[nsinks++] = fd;
}

static void conn_close(struct conn *c)
{
    close(c->fd);
    c->fd = -1;
    c->dead = 1;
    if (c->file_fd >= 0)
        close(c->file_fd);
    if (c->tun >= 0)
        close(c->tun);
    c->tun = -1;
    if (c->proc)
        c->proc->waiter = NULL; /* the process keeps running; its output is dropped */
    if (c->attach)
        c->attach->nattach--;
}

/* ---------- processes ---------- */

static void put_status(struct buf *b, int status)
{
    field_int(b, "exit_code", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    field_int(b, "signal", WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

static void put_exit(struct buf *b, const struct proc *p)
{
    size_t at = frame_begin(b, 'x');
    put_status(b, p->status);
    field_int(b, "timed_out", p->timed_out);
    field_int(b, "stdout_truncated", p->truncated[0]);
    field_int(b, "stderr_truncated", p->truncated[1]);
    field_int(b, "duration_ms", p->duration);
    frame_end(b, at);
}

/* A terminal's log: drop whole frames from the front while it holds more than max_output
 * bytes (and flag the loss as truncation); the dead prefix is reclaimed once it is half the
 * buffer, so the memory stays under twice the cap and each byte is moved at most once. */
static void log_trim(struct proc *p)
{
    struct buf *b = &p->log;
    while (b->len - b->off > p->max_output) {
        b->off += 4 + get_u32(b->p + b->off);
        p->truncated[0] = 1;
    }
    if (b->off && b->off >= b->len / 2) {
        memmove(b->p, b->p + b->off, b->len - b->off);
        p->log_base += b->off;
        b->len -= b->off;
        b->off = 0;
    }
}

/* One read from pipe i; keeps up to max_output bytes per stream. Returns bytes read, 0 at EOF
 * (pipe closed) or -1 if nothing is available. */
static ssize_t proc_read(struct proc *p, int i)
{
    static char chunk[PIPE_CHUNK];
    ssize_t n = read(p->out[i], chunk, sizeof chunk);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return -1;
    if (n <= 0) {
        close(p->out[i]);
        p->out[i] = -1;
        return 0;
    }
    size_t keep = p->tty ? (size_t)n : p->max_output - p->kept[i];
    if ((size_t)n > keep)
        p->truncated[i] = 1;
    else
        keep = n;
    struct buf *dst = p->background ? &p->log : p->waiter ? &p->waiter->out : NULL;
    p->kept[i] += keep;
    if (p->exited)
        p->drain_idle = now_ms() + TTY_IDLE_MS;
    if (keep && dst) {
        size_t at = frame_begin(dst, 'o');
        field(dst, "fd", i ? "2" : "1", 1);
        field(dst, "data", chunk, keep);
        frame_end(dst, at);
    }
    if (p->tty)
        log_trim(p);
    return n;
}

static int want_read(const struct proc *p, int i)
{
    return p->out[i] >= 0 && (p->background || !p->waiter || p->truncated[i] ||
                              buf_pending(&p->waiter->out) < HIGH_WATER);
}

static void evict_finished(void)
{
    int n = 0;
    for (struct proc *p = procs; p; p = p->next)
        n += p->background && !p->running && !p->dead;
    for (struct proc *p = procs; p && n > KEEP_FINISHED; p = p->next)
        if (p->background && !p->running && !p->dead && !p->nattach)
            p->dead = 1, n--;
}

/* A process whose output is read to its end: it is reported exited. */
static void proc_finish(struct proc *p)
{
    p->running = 0;
    /* The exec ends when its main process exits. Everything it wrote is in the pipe buffer
     * now, so read at most a pipe's worth; whatever descendants still write is dropped by a
     * sink (so they never get SIGPIPE). A terminal's master was read on from the loop. */
    for (int i = 0; i < 2; i++) {
        long long left = p->out[i] < 0 || p->tty ? 0 : fcntl(p->out[i], F_GETPIPE_SZ);
        ssize_t n;
        while (left > 0 && (n = proc_read(p, i)) > 0)
            left -= n;
        if (p->out[i] >= 0)
            sink_add(p->out[i]);
        p->out[i] = -1;
    }
    if (p->in >= 0)
        close(p->in);
    p->in = -1;
    p->stdin_open = 0;
    buf_free(&p->stdin_data);
    if (p->background) {
        evict_finished();
        return;
    }
    if (p->waiter) {
        put_exit(&p->waiter->out, p);
        p->waiter->proc = NULL;
    }
    p->dead = 1;
}

/* Its main process was reaped: status and duration are final. A terminal's line discipline
 * may still hold much of what it wrote (gVisor's takes writes without bound), so its master
 * is read on from the loop until the slave hangs up (EIO), TTY_IDLE_MS pass with nothing new
 * or TTY_DRAIN_MS in all; only then is the process reported exited. */
static void proc_exited(struct proc *p, int status)
{
    p->exited = 1;
    p->status = status;
    p->duration = now_ms() - p->start;
    if (!p->tty || p->out[0] < 0)
        return proc_finish(p);
    p->drain_idle = now_ms() + TTY_IDLE_MS;
    p->drain_end = now_ms() + TTY_DRAIN_MS;
}

static long long drain_deadline(const struct proc *p)
{
    return p->drain_idle < p->drain_end ? p->drain_idle : p->drain_end;
}

/* Exited terminals whose output ended or whose reading time is up. */
static void finish_drained(void)
{
    long long now = now_ms();
    for (struct proc *p = procs; p; p = p->next)
        if (p->running && p->exited && (p->out[0] < 0 || now >= drain_deadline(p)))
            proc_finish(p);
}

static void reap(void)
{
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
        for (struct proc *p = procs; p; p = p->next)
            if (p->running && !p->exited && p->pid == pid) {
                proc_exited(p, status);
                break;
            }
}

/* Writes pending input without blocking. Once it is all written, stdin is closed unless it
 * stays open for `I` frames; a child that stopped reading (EPIPE) closes it for good. */
static void write_stdin(struct proc *p)
{
    struct buf *b = &p->stdin_data;
    while (buf_pending(b)) {
        ssize_t n = write(p->in, b->p + b->off, buf_pending(b));
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        if (n < 0) { /* EPIPE: the child does not read its stdin (EIO: nor its terminal) */
            p->stdin_open = 0;
            break;
        }
        b->off += n;
    }
    if (p->stdin_open) {
        b->len = b->off = 0;
        return;
    }
    close(p->in);
    p->in = -1;
    buf_free(b);
}

/* --confine (a VM guest, where commands run as root of the guest's kernel): what a command
 * must not do to dsec's own path. Remounting or mounting over /.dsec, ptrace or /proc/1/mem of
 * the agent, loading kernel code (modules, BPF, kexec), raw memory and I/O, taking over the
 * agent's NIC (sniffing its traffic for the token, redirecting its port to an impostor), and
 * writing to the host's disk through the serial console (a device node made anew, or the
 * kernel's console log level raised). */
static const int confined_caps[] = {
    CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_PTRACE, CAP_SYS_ADMIN,
    CAP_SYS_BOOT, CAP_MAC_OVERRIDE, CAP_MAC_ADMIN, CAP_PERFMON, CAP_BPF, CAP_CHECKPOINT_RESTORE,
    CAP_MKNOD, CAP_SYSLOG,
};
static int confine;

/* Drop confined_caps from the bounding and inheritable sets (so no exec can regain them) and
 * set no_new_privs. Returns -1 with errno set if the kernel refuses any step. */
static int confine_self(void)
{
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    for (size_t i = 0; i < sizeof confined_caps / sizeof *confined_caps; i++)
        if (prctl(PR_CAPBSET_DROP, confined_caps[i], 0, 0, 0))
            return -1;
    if (syscall(SYS_capget, &hdr, data))
        return -1;
    for (size_t i = 0; i < sizeof confined_caps / sizeof *confined_caps; i++) {
        uint32_t bit = 1u << (confined_caps[i] % 32);
        int w = confined_caps[i] / 32;
        data[w].inheritable &= ~bit, data[w].permitted &= ~bit, data[w].effective &= ~bit;
    }
    if (syscall(SYS_capset, &hdr, data))
        return -1;
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
}

static void __attribute__((noreturn))
child(char **argv, char **envp, const char *cwd, int in, int out, int err, int privileged, int tty)
{
    struct sigaction dfl = {.sa_handler = SIG_DFL};
    sigset_t none;

    setsid();
    if (tty && ioctl(in, TIOCSCTTY, 0)) { /* the terminal is the new session's */
        dprintf(err, "dsec-agent: cannot take the terminal: %s\n", strerror(errno));
        _exit(126);
    }
    if (in >= 0)
        dup2(in, 0); /* otherwise fd 0 stays the agent's /dev/null */
    dup2(out, 1);
    dup2(err, 2);
    close_range(3, ~0U, 0);
    for (int s = 1; s < NSIG; s++)
        sigaction(s, &dfl, NULL); /* fails harmlessly for SIGKILL, SIGSTOP, glibc-internal */
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setrlimit(RLIMIT_NOFILE, &nofile);
    if (confine && !privileged && confine_self()) {
        dprintf(2, "dsec-agent: cannot confine the command: %s\n", strerror(errno));
        _exit(126);
    }
    if (cwd && chdir(cwd)) {
        dprintf(2, "%s: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    environ = envp; /* execvp searches the child's PATH */
    execvp(argv[0], argv);
    if (errno == ENOENT) {
        dprintf(2, "%s: command not found\n", argv[0]);
        _exit(127);
    }
    dprintf(2, "%s: %s\n", argv[0], strerror(errno));
    _exit(126);
}

/* Pipes for the child's stdio: fds[0] is the parent's end (non-blocking), fds[1] the child's. */
static int stdio_pipe(int fds[2], int parent_reads)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC))
        return -1;
    fds[0] = p[!parent_reads];
    fds[1] = p[parent_reads];
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    return 0;
}

/* The slave of a master where the kernel has no TIOCGPTPEER (gVisor): /dev/pts/N, opened
 * without following links and kept only if it is the character device of slave N. */
static int open_slave_by_number(int master)
{
    unsigned n;
    char path[32];
    struct stat st;
    if (ioctl(master, TIOCGPTN, &n))
        return -1;
    snprintf(path, sizeof path, "/dev/pts/%u", n);
    int fd = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0)
        return -1;
    if (fstat(fd, &st) || !S_ISCHR(st.st_mode) || major(st.st_rdev) < 136 || major(st.st_rdev) > 143 ||
        (major(st.st_rdev) - 136) * 256 + minor(st.st_rdev) != n ||
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK)) {
        close(fd);
        errno = EIO;
        return -1;
    }
    return fd;
}

/* A pseudo-terminal of cols x rows: fds[0] its master (non-blocking), fds[1] its slave, opened
 * through the master (TIOCGPTPEER; by number, checked, where the kernel lacks it). The
 * sandbox can replace /dev/ptmx itself: it is opened non-blocking (a FIFO or anything else
 * there cannot hold the agent), and only a real master answers the ioctls. */
static int open_pty(int fds[2], long long cols, long long rows)
{
    struct winsize ws = {.ws_row = rows, .ws_col = cols};
    fds[0] = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
    fds[1] = -1;
    if (fds[0] >= 0 && !unlockpt(fds[0]) && !ioctl(fds[0], TIOCSWINSZ, &ws)) {
        fds[1] = ioctl(fds[0], TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (fds[1] < 0 && (errno == ENOTTY || errno == EINVAL))
            fds[1] = open_slave_by_number(fds[0]);
    }
    if (fds[1] < 0) {
        int e = errno;
        close(fds[0]);
        fds[0] = -1;
        errno = e;
        return -1;
    }
    return 0;
}

/* `E` (exec) and `P` (a background exec on a new pseudo-terminal). */
static void do_exec(struct conn *c, const struct req *r)
{
    struct buf *o = &c->out;
    int nargv = 0, nenv = 0, background = 0, privileged, stdin_open, tty = r->type == 'P';
    long long timeout, max_output, cols, rows;
    char *cwd, *mode;
    struct field *in = get(r, "stdin");
    struct stat st;

    for (int i = 0; i < r->nf; i++) {
        int a = !strcmp(r->f[i].k, "argv"), e = !strcmp(r->f[i].k, "env");
        if ((a || e) && !is_text(&r->f[i]))
            return reply_err(o, EINVAL, "argv and env must not contain NUL bytes");
        nargv += a, nenv += e;
    }
    if (!nargv || !*get(r, "argv")->v)
        return reply_err(o, EINVAL, "argv is required");
    if (get_str(r, "cwd", &cwd) || get_str(r, "mode", &mode) ||
        get_num(r, "timeout_ms", 10, 0, LLONG_MAX / 2, 0, &timeout) ||
        get_num(r, "max_output", 10, 0, SIZE_MAX / 2, DEFAULT_MAX_OUTPUT, &max_output) ||
        get_flag(r, "privileged", &privileged) || get_flag(r, "stdin_open", &stdin_open) ||
        get_num(r, "cols", 10, 1, WINSIZE_MAX, 80, &cols) ||
        get_num(r, "rows", 10, 1, WINSIZE_MAX, 24, &rows))
        return reply_err(o, EINVAL, "malformed exec field");
    if (mode && !(background = !strcmp(mode, "background")) && strcmp(mode, "wait"))
        return reply_err(o, EINVAL, "mode must be wait or background");
    if (tty && (mode || in || stdin_open))
        return reply_err(o, EINVAL, "a terminal runs in the background and takes input as `I` frames");
    if (stdin_open && !background)
        return reply_err(o, EINVAL, "stdin_open needs mode background");
    background |= tty;
    stdin_open |= tty;
    if (cwd && stat(cwd, &st))
        return reply_errno(o, errno, cwd);
    if (cwd && !S_ISDIR(st.st_mode))
        return reply_errno(o, ENOTDIR, cwd);

    char **argv = xcalloc(nargv + 1, sizeof *argv), **envp = xcalloc(nenv + 1, sizeof *envp);
    size_t cmdlen = 0;
    nargv = nenv = 0;
    for (int i = 0; i < r->nf; i++) {
        if (!strcmp(r->f[i].k, "argv"))
            argv[nargv++] = r->f[i].v, cmdlen += r->f[i].n + 1;
        else if (!strcmp(r->f[i].k, "env"))
            envp[nenv++] = r->f[i].v;
    }

    /* A terminal: its master is read as stdout and (a dup) written as stdin; its slave is
     * the child's fds 0-2 and controlling terminal. */
    int po[2] = {-1, -1}, pe[2] = {-1, -1}, pi[2] = {-1, -1};
    pid_t pid = -1;
    if (tty && open_pty(po, cols, rows)) {
        reply_errno(o, errno, "terminal");
        goto out;
    }
    if ((tty ? (pi[0] = fcntl(po[0], F_DUPFD_CLOEXEC, 3)) < 0
             : stdio_pipe(po, 1) || stdio_pipe(pe, 1) || ((in || stdin_open) && stdio_pipe(pi, 0))) ||
        (pid = fork()) < 0) {
        int e = errno;
        for (int i = 0; i < 2; i++)
            close(po[i]), close(pe[i]), close(pi[i]);
        reply_errno(o, e, "spawn");
        goto out;
    }
    if (pid == 0)
        tty ? child(argv, envp, cwd, po[1], po[1], po[1], privileged, 1)
            : child(argv, envp, cwd, pi[1], po[1], pe[1], privileged, 0);
    close(po[1]), close(pe[1]), close(pi[1]);

    struct proc *p = xcalloc(1, sizeof *p);
    p->pid = pid;
    p->background = background;
    p->running = 1;
    p->out[0] = po[0], p->out[1] = pe[0], p->in = pi[0];
    p->stdin_open = stdin_open;
    p->tty = tty;
    p->max_output = max_output;
    p->start = now_ms();
    p->deadline = timeout ? p->start + timeout : 0;
    if (in)
        buf_put(&p->stdin_data, in->v, in->n);
    p->cmd = xcalloc(1, cmdlen);
    for (int i = 0; i < nargv; i++)
        strcat(strcat(p->cmd, i ? " " : ""), argv[i]);
    *procs_tail = p;
    procs_tail = &p->next;
    if (background) {
        size_t at = frame_begin(o, 'S');
        p->id = next_id++;
        field_int(o, "id", p->id);
        field_int(o, "pid", pid);
        frame_end(o, at);
    } else {
        p->waiter = c;
        c->proc = p;
    }
out:
    free(argv);
    free(envp);
}

static struct proc *find_proc(const struct req *r)
{
    long long id;
    if (get_num(r, "id", 10, 1, LONG_MAX, 0, &id))
        return NULL;
    for (struct proc *p = procs; p; p = p->next)
        if (p->id == id && !p->dead)
            return p;
    return NULL;
}

static void do_attach(struct conn *c, const struct req *r)
{
    struct proc *p = find_proc(r);
    if (!p)
        return reply_err(&c->out, ESRCH, "no such process");
    c->attach = p;
    p->nattach++;
}

/* Signal a process's whole group. Right after fork the child may not have called setsid()
 * yet, so its group does not exist: signal the child itself, which then takes the signal
 * with it. */
static int signal_group(const struct proc *p, int sig)
{
    if (kill(-p->pid, sig) == 0)
        return 0;
    return errno == ESRCH ? kill(p->pid, sig) : -1;
}

static void do_signal(struct conn *c, const struct req *r)
{
    struct proc *p = find_proc(r);
    long long sig;
    if (!p)
        return reply_err(&c->out, ESRCH, "no such process");
    if (get_num(r, "sig", 10, 1, NSIG - 1, -1, &sig))
        return reply_err(&c->out, EINVAL, "sig must be a signal number");
    if (p->exited)
        return reply_err(&c->out, ESRCH, "process has exited");
    if (signal_group(p, (int)sig))
        return reply_errno(&c->out, errno, "kill");
    reply_ok(&c->out);
}

/* A running background process whose stdin is the request's concern: ESRCH for an unknown
 * id, ECHILD once it has exited. */
static struct proc *input_proc(struct conn *c, const struct req *r)
{
    struct proc *p = find_proc(r);
    if (!p)
        reply_err(&c->out, ESRCH, "no such process");
    else if (p->exited)
        reply_err(&c->out, ECHILD, "process has exited");
    return p && !p->exited ? p : NULL;
}

/* `I`: input for a process's stdin (or terminal). All or nothing: EAGAIN while the data would
 * take more than STDIN_CAP bytes not yet written (the process is not reading). */
static void do_input(struct conn *c, const struct req *r)
{
    struct field *d = get(r, "data");
    struct proc *p = input_proc(c, r);
    struct buf *b;
    if (!p)
        return;
    if (!d)
        return reply_err(&c->out, EINVAL, "input needs data");
    if (!p->stdin_open)
        return reply_err(&c->out, EPIPE, "stdin is closed");
    b = &p->stdin_data;
    if (buf_pending(b) + d->n > STDIN_CAP)
        return reply_err(&c->out, EAGAIN, "stdin buffer full: the process is not reading");
    memmove(b->p, b->p + b->off, buf_pending(b));
    b->len -= b->off;
    b->off = 0;
    buf_put(b, d->v, d->n);
    write_stdin(p);
    reply_ok(&c->out);
}

/* `W`: close a process's stdin once the input already accepted is written. */
static void do_close_stdin(struct conn *c, const struct req *r)
{
    struct proc *p = input_proc(c, r);
    if (!p)
        return;
    if (p->tty)
        return reply_err(&c->out, EINVAL, "a terminal's input is not closed; send ^D (\\x04)");
    p->stdin_open = 0;
    if (p->in >= 0 && !buf_pending(&p->stdin_data))
        write_stdin(p); /* nothing left: closes now */
    reply_ok(&c->out);
}

/* `Z`: a terminal's new size (the kernel sends its foreground group SIGWINCH). */
static void do_resize(struct conn *c, const struct req *r)
{
    struct proc *p = input_proc(c, r);
    long long cols, rows;
    if (!p)
        return;
    if (get_num(r, "cols", 10, 1, WINSIZE_MAX, -1, &cols) ||
        get_num(r, "rows", 10, 1, WINSIZE_MAX, -1, &rows) || cols < 0 || rows < 0)
        return reply_err(&c->out, EINVAL, "resize needs cols and rows of 1 to 10000");
    if (!p->tty)
        return reply_err(&c->out, ENOTTY, "not a terminal");
    struct winsize ws = {.ws_row = rows, .ws_col = cols};
    if (p->in < 0 || ioctl(p->in, TIOCSWINSZ, &ws))
        return reply_errno(&c->out, p->in < 0 ? EIO : errno, "resize");
    reply_ok(&c->out);
}

static void do_list(struct conn *c)
{
    struct buf *o = &c->out;
    for (struct proc *p = procs; p; p = p->next) {
        if (!p->background || p->dead)
            continue;
        size_t at = frame_begin(o, 'p');
        field_int(o, "id", p->id);
        field_int(o, "pid", p->pid);
        field_str(o, "argv", p->cmd);
        field_int(o, "running", p->running);
        field_int(o, "tty", p->tty);
        if (!p->running)
            put_status(o, p->status);
        frame_end(o, at);
    }
    reply_ok(o);
}

/* ---------- file operations ---------- */

static void put_entry(struct buf *b, const char *name, size_t len, const struct stat *st)
{
    size_t at = frame_begin(b, 'e');
    field(b, "name", name, len);
    field_str(b, "type", S_ISREG(st->st_mode)   ? "file"
                         : S_ISDIR(st->st_mode) ? "dir"
                         : S_ISLNK(st->st_mode) ? "symlink"
                                                : "other");
    field_int(b, "size", st->st_size);
    field_fmt(b, "mode", "%llo", st->st_mode & 07777);
    field_int(b, "mtime", st->st_mtime);
    frame_end(b, at);
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0)
            return -1;
        p += w, n -= w;
    }
    return 0;
}

/* Without append: write a temp file next to path and rename it over path. Returns errno. */
static int file_write(const char *path, const struct field *data, mode_t mode, int append)
{
    struct stat st;
    int fd, e = 0;
    if (append) {
        int created = (fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC, mode)) >= 0;
        if (!created && errno == EEXIST)
            fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
        if (fd < 0)
            return errno;
        if (fstat(fd, &st))
            e = errno;
        else if (!S_ISREG(st.st_mode)) /* no appending to FIFOs or devices */
            e = EINVAL;
        else if ((created && fchmod(fd, mode)) || write_all(fd, data->v, data->n))
            e = errno;
        close(fd);
        return e;
    }
    char *tmp;
    if (asprintf(&tmp, "%s.dsec-XXXXXX", path) < 0)
        abort();
    if ((fd = mkostemp(tmp, O_CLOEXEC)) < 0) {
        e = errno;
    } else {
        if (write_all(fd, data->v, data->n) || fchmod(fd, mode))
            e = errno;
        if (close(fd) && !e)
            e = errno;
        if (!e && rename(tmp, path))
            e = errno;
        if (e)
            unlink(tmp);
    }
    free(tmp);
    return e;
}

static int file_mkdir(char *path, mode_t mode, int parents)
{
    struct stat st;
    if (parents) /* create each missing ancestor, like mkdir -p */
        for (char *q = path + 1; *q; q++)
            if (*q == '/') {
                *q = 0;
                int rc = mkdir(path, 0755);
                *q = '/';
                if (rc && errno != EEXIST)
                    return errno;
            }
    if (mkdir(path, mode) == 0)
        return chmod(path, mode) ? errno : 0; /* exact mode, no umask */
    if (errno == EEXIST && parents && stat(path, &st) == 0)
        return S_ISDIR(st.st_mode) ? 0 : EEXIST;
    return errno;
}

static int rm_errno;

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path) ? (rm_errno = errno, -1) : 0;
}

static int file_remove(const char *path, int recursive)
{
    struct stat st;
    if (lstat(path, &st))
        return errno;
    if (!S_ISDIR(st.st_mode))
        return unlink(path) ? errno : 0;
    if (!recursive)
        return rmdir(path) ? errno : 0;
    /* Depth-first, never following symlinks. Not FTW_MOUNT: on overlayfs a file's st_dev is
     * that of the layer it lives in, so it would skip most of the tree. */
    rm_errno = 0;
    if (nftw(path, rm_one, 64, FTW_DEPTH | FTW_PHYS))
        return rm_errno ? rm_errno : errno;
    return 0;
}

static int file_list(struct buf *o, const char *path)
{
    DIR *d = opendir(path);
    struct dirent *de;
    struct stat st;
    if (!d)
        return errno;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") &&
            !fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW))
            put_entry(o, de->d_name, strlen(de->d_name), &st);
    closedir(d);
    reply_ok(o);
    return 0;
}

static int file_stat(struct buf *o, const char *path)
{
    struct stat st;
    size_t end = strlen(path), start;
    if (lstat(path, &st))
        return errno;
    while (end > 1 && path[end - 1] == '/') /* the basename, ignoring trailing slashes */
        end--;
    for (start = end; start > 0 && path[start - 1] != '/'; start--)
        ;
    if (start == end) /* "/" */
        start = 0;
    put_entry(o, path + start, end - start, &st);
    return 0;
}

static int file_read(struct conn *c, const char *path)
{
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return errno;
    int e = fstat(fd, &st)           ? errno
            : S_ISDIR(st.st_mode)    ? EISDIR
            : !S_ISREG(st.st_mode)   ? EINVAL /* no FIFOs or devices */
                                     : 0;
    if (e) {
        close(fd);
        return e;
    }
    c->file_fd = fd;
    return 0;
}

static void do_file(struct conn *c, const struct req *r)
{
    struct buf *o = &c->out;
    char *op, *path;
    long long mode;
    int flag, e;

    if (get_str(r, "op", &op) || get_str(r, "path", &path) || !op || !path || path[0] != '/')
        return reply_err(o, EINVAL, "op and an absolute path are required");
    if (!strcmp(op, "read")) {
        e = file_read(c, path);
    } else if (!strcmp(op, "write")) {
        struct field *data = get(r, "data");
        if (!data || get_num(r, "mode", 8, 0, 07777, 0644, &mode) || get_flag(r, "append", &flag))
            return reply_err(o, EINVAL, "write needs data, an octal mode and append 0/1");
        if (!(e = file_write(path, data, mode, flag)))
            reply_ok(o);
    } else if (!strcmp(op, "list")) {
        e = file_list(o, path);
    } else if (!strcmp(op, "stat")) {
        e = file_stat(o, path);
    } else if (!strcmp(op, "remove")) {
        if (get_flag(r, "recursive", &flag))
            return reply_err(o, EINVAL, "recursive must be 0 or 1");
        if (!(e = file_remove(path, flag)))
            reply_ok(o);
    } else if (!strcmp(op, "mkdir")) {
        if (get_num(r, "mode", 8, 0, 07777, 0755, &mode) || get_flag(r, "parents", &flag))
            return reply_err(o, EINVAL, "mkdir needs an octal mode and parents 0/1");
        if (!(e = file_mkdir(path, mode, flag)))
            reply_ok(o);
    } else {
        return reply_err(o, EINVAL, "unknown file op");
    }
    if (e)
        reply_errno(o, e, path);
}

/* ---------- authentication ---------- */

/* The agent starts unclaimed; the first `C` request sets the token every later request must
 * carry. Processes in the sandbox can reach the socket, so without it they could run, watch
 * or kill anything through the agent (and impersonate the edge's view of results). */
#define TOKEN_MIN 16
#define TOKEN_MAX 256
static char token[TOKEN_MAX];
static size_t token_len; /* 0: unclaimed */

static void __attribute__((constructor)) not_dumpable(void)
{
    prctl(PR_SET_DUMPABLE, 0); /* no ptrace, no /proc/1/mem for sandbox processes */
}

static void do_claim(struct conn *c, const struct req *r)
{
    struct field *f = get(r, "token");
    if (token_len)
        return reply_err(&c->out, EPERM, "agent already claimed");
    if (!f || f->n < TOKEN_MIN || f->n > TOKEN_MAX)
        return reply_err(&c->out, EINVAL, "claim needs a token of 16 to 256 bytes");
    memcpy(token, f->v, f->n);
    token_len = f->n;
    reply_ok(&c->out);
}

/* --token-from DEVICE (a VM guest): the edge's boot message comes over a virtio-serial port
 * whose host end only root on the host can reach (a Unix socket in a 0700 directory), never
 * over the network: "TOKEN HOSTNAME SECONDS NANOSECONDS SEED\n". The agent takes the token as
 * if claimed (so a `C` over TCP is refused), sets the guest's name and clock (a
 * snapshot-restored guest has its template's), mixes SEED (64 random bytes of the host, in
 * hex) into the kernel's random pool and reseeds it (RNDADDENTROPY, RNDRESEEDCRNG), answers
 * "OK\n" (or "ERR reason\n" and exits). No connection is served before. A read returns 0
 * while nothing is connected on the host side (a template saved for snapshots waits here;
 * each restore gets its own).
 * The port stays open afterwards: a guest restored from a saved state (a `full` snapshot's
 * child, a rollback, a resume from disk) holds the token, name, clock and random state of
 * the moment it was saved, so the edge sends a new message, which replaces all four at once:
 * from then on the old token is refused. SIGIO says the host end connected or sent data. */
#define BOOT_LINE 512
#define SEED_BYTES 64
#define CONSOLE_READY "\ndsec-agent: listening\n" /* on a VM's console, in place of `R` */
static int boot_fd = -1, random_fd = -1;
static char boot_line[BOOT_LINE + 1];
static size_t boot_len;

static int unhex(const char *hex, unsigned char *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (sscanf(hex + 2 * i, "%2hhx", &out[i]) != 1)
            return -1;
    return hex[2 * n] ? -1 : 0;
}

static const char *boot_error(char *line)
{
    char got[TOKEN_MAX + 2], host[65], seed_hex[2 * SEED_BYTES + 2];
    long long sec;
    long nsec;
    int used = 0;
    struct { struct rand_pool_info info; unsigned char bytes[SEED_BYTES]; } seed;
    if (sscanf(line, "%257s %64s %lld %ld %129s%n", got, host, &sec, &nsec, seed_hex, &used) != 5
        || line[used])
        return "malformed boot message";
    if (strlen(got) < TOKEN_MIN || strlen(got) > TOKEN_MAX)
        return "the token must be 16 to 256 bytes";
    if (unhex(seed_hex, seed.bytes, SEED_BYTES))
        return "the seed must be 64 bytes in hex";
    seed.info.entropy_count = SEED_BYTES * 8;
    seed.info.buf_size = SEED_BYTES;
    if (ioctl(random_fd, RNDADDENTROPY, &seed) || ioctl(random_fd, RNDRESEEDCRNG))
        return "reseeding the random pool failed";
    token_len = strlen(got);
    memcpy(token, got, token_len);
    if (sethostname(host, strlen(host)))
        return "sethostname failed";
    struct timespec now = {sec, nsec};
    if (clock_settime(CLOCK_REALTIME, &now))
        return "clock_settime failed";
    return NULL;
}

/* The guest stops (as PID 1, powered off: a clean console, not a panic) rather than ever
 * serve unclaimed, or with a token it was not given. */
static void __attribute__((noreturn)) boot_failed(const char *what, const char *why)
{
    fprintf(stderr, "dsec-agent: %s: %s\n", what, why);
    if (getpid() == 1)
        reboot(RB_POWER_OFF);
    exit(1);
}

/* The port's data can reach the guest before its news that the host end connected, and
 * until then a non-blocking write fails with EAGAIN: retried for a while. */
#define BOOT_REPLY_TRIES 5000
static int boot_reply(const char *reply, int n)
{
    for (int i = 0; i < BOOT_REPLY_TRIES; i++) {
        if (write(boot_fd, reply, n) == n)
            return 0;
        if (errno != EAGAIN && errno != EINTR)
            return -1;
        usleep(1000);
    }
    return -1;
}

/* Reads what the port has; once a whole line (or too much) came, obeys it and answers.
 * Returns whether it answered. */
static int boot_read(void)
{
    for (;;) {
        char *nl = memchr(boot_line, '\n', boot_len);
        if (nl || boot_len == BOOT_LINE) {
            const char *err = nl ? (*nl = 0, boot_error(boot_line)) : "boot message too long";
            char reply[128];
            int n = snprintf(reply, sizeof reply, err ? "ERR %s\n" : "OK\n", err);
            boot_len = 0; /* one message per connection: anything after it is dropped */
            if (boot_reply(reply, n) || err)
                boot_failed("boot message", err ? err : strerror(errno));
            return 1;
        }
        ssize_t n = read(boot_fd, boot_line + boot_len, BOOT_LINE - boot_len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno != EAGAIN)
            boot_failed("boot port", strerror(errno));
        if (n <= 0) /* EAGAIN: no more yet; 0: nothing connected on the host side */
            return 0;
        boot_len += n;
    }
}

static void boot_from(const char *device)
{
    boot_fd = open(device, O_RDWR | O_CLOEXEC | O_NOCTTY);
    if (boot_fd < 0)
        boot_failed(device, strerror(errno));
    random_fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (random_fd < 0) /* opened before any command runs: no command can swap it */
        boot_failed("/dev/urandom", strerror(errno));
    while (!boot_read())
        usleep(10000);
    if (fcntl(boot_fd, F_SETOWN, getpid()) ||
        fcntl(boot_fd, F_SETFL, fcntl(boot_fd, F_GETFL) | O_NONBLOCK | O_ASYNC))
        boot_failed("boot port", strerror(errno));
    /* The edge may save the guest between the answer above and O_ASYNC (it pauses a VM as
     * soon as its create returns): the restored guest can then be sent its new message
     * before O_ASYNC is set, and no SIGIO would ever come for it. Read once now; what comes
     * later raises SIGIO. */
    boot_read();
}

/* Constant time in the token's bytes: a wrong guess says nothing about how close it was. */
static int authorized(const struct req *r)
{
    struct field *f = get(r, "token");
    unsigned char diff = 0;
    if (!token_len || !f || f->n != token_len)
        return 0;
    for (size_t i = 0; i < token_len; i++)
        diff |= (unsigned char)(token[i] ^ f->v[i]);
    return !diff;
}

/* ---------- ports ---------- */

static void conn_write(struct conn *c);

/* `N`: connect to 127.0.0.1:port in the sandbox's own network namespace (a VM's guest), without
 * blocking: the reply waits for the connect to finish (W_TUN). The client bounds how long. */
static void do_port(struct conn *c, const struct req *r)
{
    long long port;
    if (get_num(r, "port", 10, 1, 65535, 0, &port) || !port)
        return reply_err(&c->out, EINVAL, "port must be 1-65535");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return reply_errno(&c->out, errno, "socket");
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) && errno != EINPROGRESS) {
        int e = errno;
        close(fd);
        return reply_errno(&c->out, e, "connect");
    }
    c->tun = fd;
    c->tun_state = 1;
}

/* The connect finished: `O` and raw bytes from now on, or `X` and the end. */
static void tun_connected(struct conn *c)
{
    int e = 0;
    socklen_t len = sizeof e;
    if (getsockopt(c->tun, SOL_SOCKET, SO_ERROR, &e, &len) || e) {
        close(c->tun);
        c->tun = -1;
        c->tun_state = 0;
        reply_errno(&c->out, e ? e : errno, "connect");
    } else {
        int one = 1;
        setsockopt(c->tun, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        c->tun_state = 2;
        reply_ok(&c->out);
    }
    conn_write(c);
}

/* The port's bytes to the client. At the port's EOF the client's write side is shut once out
 * is sent (conn_write); the client then closes, which ends the tunnel. */
static void tun_read(struct conn *c)
{
    if (buf_pending(&c->out))
        return;
    c->out.len = c->out.off = 0;
    buf_reserve(&c->out, PIPE_CHUNK);
    ssize_t n = recv(c->tun, c->out.p, PIPE_CHUNK, 0);
    if (n > 0)
        c->out.len = n;
    else if (n == 0)
        c->tun_eof = 1;
    else if (errno != EAGAIN)
        return conn_close(c);
    conn_write(c);
}

static void tun_write(struct conn *c)
{
    struct buf *u = &c->up;
    ssize_t n = send(c->tun, u->p + u->off, buf_pending(u), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN)
        return conn_close(c);
    if (n > 0 && (u->off += n) == u->len)
        u->len = u->off = 0;
}

/* The client's bytes for the port. The client's EOF ends the tunnel: the edge never
 * half-closes, so an EOF means it is gone (and a port that never answers is not held). */
static void tun_client_read(struct conn *c)
{
    if (buf_pending(&c->up))
        return;
    c->up.len = c->up.off = 0;
    buf_reserve(&c->up, PIPE_CHUNK);
    ssize_t n = recv(c->fd, c->up.p, PIPE_CHUNK, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN))
        return conn_close(c);
    if (n > 0)
        c->up.len = n;
}

/* ---------- connections ---------- */

static void dispatch(struct conn *c, const struct req *r)
{
    if (r->type == 'C')
        return do_claim(c, r);
    if (!authorized(r))
        return reply_err(&c->out, EACCES, token_len ? "bad token" : "agent not claimed");
    switch (r->type) {
    case 'H': return reply_ok(&c->out);
    case 'E':
    case 'P': return do_exec(c, r);
    case 'I': return do_input(c, r);
    case 'W': return do_close_stdin(c, r);
    case 'Z': return do_resize(c, r);
    case 'A': return do_attach(c, r);
    case 'K': return do_signal(c, r);
    case 'L': return do_list(c);
    case 'F': return do_file(c, r);
    case 'N': return do_port(c, r);
    default: return reply_err(&c->out, EINVAL, "unknown request type");
    }
}

/* Refills c->out from the connection's source (file being read, attached process). Returns
 * 0 when there is nothing more to send for now. */
static int conn_fill(struct conn *c)
{
    struct buf *o = &c->out;
    if (c->file_fd >= 0) {
        static char chunk[FILE_CHUNK];
        ssize_t n = read(c->file_fd, chunk, sizeof chunk);
        if (n > 0) {
            size_t at = frame_begin(o, 'D');
            field(o, "data", chunk, n);
            frame_end(o, at);
            return 1;
        }
        if (n < 0)
            reply_errno(o, errno, "read");
        else
            reply_ok(o);
        close(c->file_fd);
        c->file_fd = -1;
        return 1;
    }
    struct proc *p = c->attach;
    if (!p)
        return 0;
    if (c->off < p->log_base + p->log.off) /* a terminal dropped frames it had not sent */
        c->off = p->log_base + p->log.off;
    if (c->off < p->log_base + p->log.len) { /* whole frames, so dropping never splits one */
        const char *q = p->log.p + (c->off - p->log_base);
        size_t n = 0, left = p->log_base + p->log.len - c->off;
        while (n < left && (!n || n + 4 + get_u32(q + n) <= ATTACH_CHUNK))
            n += 4 + get_u32(q + n);
        buf_put(o, q, n);
        c->off += n;
        return 1;
    }
    if (p->running)
        return 0;
    put_exit(o, p);
    p->nattach--;
    c->attach = NULL;
    return 1;
}

static int want_write(const struct conn *c)
{
    return buf_pending(&c->out) || c->file_fd >= 0 ||
           (c->attach && (c->off < c->attach->log_base + c->attach->log.len || !c->attach->running));
}

/* Sends until the socket is full or nothing is left; closes a finished connection. */
static void conn_write(struct conn *c)
{
    struct buf *o = &c->out;
    for (;;) {
        if (!buf_pending(o)) {
            o->len = o->off = 0;
            if (!conn_fill(c))
                break;
            continue;
        }
        ssize_t n = send(c->fd, o->p + o->off, buf_pending(o), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EAGAIN)
            return;
        if (n < 0)
            return conn_close(c);
        o->off += n;
    }
    if (c->tun_state == 2 && c->tun_eof)
        shutdown(c->fd, SHUT_WR); /* the port's EOF, passed on */
    else if (c->dispatched && !c->proc && !c->attach && !c->tun_state)
        conn_close(c); /* reply complete */
}

static void conn_read(struct conn *c)
{
    struct buf *in = &c->in;
    if (c->tun_state == 2)
        return tun_client_read(c);
    for (;;) {
        if (c->dispatched) { /* only an EOF (client gone) is of interest now */
            char junk[4096];
            ssize_t n = recv(c->fd, junk, sizeof junk, 0);
            if (n == 0 || (n < 0 && errno != EAGAIN))
                conn_close(c);
            if (n <= 0)
                return;
            continue;
        }
        size_t want = in->len < 4 ? 4 : 4 + (size_t)get_u32(in->p);
        buf_reserve(in, want + 1 - in->len);
        ssize_t n = recv(c->fd, in->p + in->len, want - in->len, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN))
            return conn_close(c);
        if (n < 0)
            return;
        in->len += n;
        if (in->len == 4 && (get_u32(in->p) == 0 || get_u32(in->p) > MAX_FRAME)) {
            c->dispatched = 1;
            reply_err(&c->out, EMSGSIZE, "bad frame length");
        } else if (in->len == want && want > 4) {
            struct req r;
            c->dispatched = 1;
            if (parse(in->p + 4, want - 4, &r))
                reply_err(&c->out, EINVAL, "malformed frame");
            else
                dispatch(c, &r);
            free(r.f);
            buf_free(in);
        }
        if (c->dispatched)
            return conn_write(c);
    }
}

static void accept_all(int lfd)
{
    int fd;
    while ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
        struct conn *c = xcalloc(1, sizeof *c);
        int one = 1; /* frames go out as written (fails harmlessly on a Unix socket) */
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        c->fd = fd;
        c->file_fd = -1;
        c->tun = -1;
        c->next = conns;
        conns = c;
    }
}

/* ---------- main loop ---------- */

enum { W_LISTEN, W_SIGNAL, W_CONN, W_OUT, W_IN, W_SINK, W_TUN };

struct watch {
    int kind, i;
    void *obj;
};

static struct pollfd *pfds;
static struct watch *watches;
static int nwatch, capwatch;

static void watch(int fd, short events, int kind, void *obj, int i)
{
    if (nwatch == capwatch) {
        capwatch = capwatch ? 2 * capwatch : 64;
        pfds = xrealloc(pfds, capwatch * sizeof *pfds);
        watches = xrealloc(watches, capwatch * sizeof *watches);
    }
    pfds[nwatch] = (struct pollfd){.fd = fd, .events = events};
    watches[nwatch++] = (struct watch){kind, i, obj};
}

static int poll_timeout(void)
{
    long long next = -1, now = now_ms();
    for (struct proc *p = procs; p; p = p->next)
        if (p->running && p->exited && (next < 0 || drain_deadline(p) < next))
            next = drain_deadline(p);
        else if (p->running && p->deadline && !p->timed_out && (next < 0 || p->deadline < next))
            next = p->deadline;
    return next < 0 ? -1 : next <= now ? 0 : next - now > INT_MAX ? INT_MAX : (int)(next - now);
}

static void kill_timed_out(void)
{
    long long now = now_ms();
    for (struct proc *p = procs; p; p = p->next)
        if (!p->exited && p->deadline && !p->timed_out && now >= p->deadline) {
            signal_group(p, SIGKILL);
            p->timed_out = 1;
        }
}

static void handle_signals(void)
{
    struct signalfd_siginfo si;
    while (read(sig_fd, &si, sizeof si) == sizeof si)
        if (si.ssi_signo == SIGIO) { /* the edge restored the guest: a new boot message */
            if (boot_fd >= 0)
                boot_read();
        } else if (si.ssi_signo != SIGCHLD) { /* SIGTERM/SIGINT: take every process group down */
            for (struct proc *p = procs; p; p = p->next)
                if (!p->exited)
                    signal_group(p, SIGKILL);
            exit(0);
        }
    reap();
}

static void sweep(void)
{
    for (struct conn **cp = &conns, *c; (c = *cp);)
        if (c->dead) {
            *cp = c->next;
            buf_free(&c->in);
            buf_free(&c->out);
            buf_free(&c->up);
            free(c);
        } else {
            cp = &c->next;
        }
    procs_tail = &procs;
    for (struct proc *p; (p = *procs_tail);)
        if (p->dead) {
            *procs_tail = p->next;
            buf_free(&p->log);
            free(p->cmd);
            free(p);
        } else {
            procs_tail = &p->next;
        }
    int n = 0;
    for (int i = 0; i < nsinks; i++)
        if (sinks[i] >= 0)
            sinks[n++] = sinks[i];
    nsinks = n;
}

static void handle(struct pollfd *pfd, struct watch *w)
{
    struct conn *c = w->obj;
    struct proc *p = w->obj;
    char junk[PIPE_CHUNK];

    switch (w->kind) {
    case W_CONN:
        if (c->dead)
            return;
        if (c->tun_state && pfd->revents & (POLLHUP | POLLERR))
            return conn_close(c); /* a tunnel's client is gone */
        if (pfd->revents & (POLLIN | POLLHUP | POLLERR))
            conn_read(c);
        if (!c->dead && pfd->revents & POLLOUT)
            conn_write(c);
        return;
    case W_TUN:
        if (c->dead || c->tun != pfd->fd)
            return;
        if (c->tun_state == 1)
            return tun_connected(c);
        if (pfd->revents & POLLOUT)
            tun_write(c);
        if (!c->dead && pfd->revents & (POLLIN | POLLHUP | POLLERR))
            tun_read(c);
        return;
    case W_OUT:
        if (p->out[w->i] == pfd->fd)
            proc_read(p, w->i);
        return;
    case W_IN:
        if (p->in == pfd->fd)
            write_stdin(p);
        return;
    case W_SINK: {
        ssize_t n = read(sinks[w->i], junk, sizeof junk);
        if (n == 0 || (n < 0 && errno != EAGAIN)) {
            close(sinks[w->i]);
            sinks[w->i] = -1;
        }
        return;
    }
    }
}

/* "tcp:ADDRESS:PORT" in a VM guest: ADDRESS is the guest's end of the host's port forward,
   so that no other NIC of the guest (a network policy's) leads to the agent. */
static int listen_tcp(const char *spec)
{
    char address[INET_ADDRSTRLEN] = "", *end;
    const char *port = strrchr(spec, ':');
    long n = port ? strtol(port + 1, &end, 10) : 0;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)n)};
    int one = 1, fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (!port || port - spec >= (long)sizeof address || port[1] == 0 || *end || n < 1 || n > 65535 ||
        (memcpy(address, spec, (size_t)(port - spec)), inet_pton(AF_INET, address, &addr.sin_addr) != 1)) {
        fprintf(stderr, "dsec-agent: bad TCP address (want ADDRESS:PORT): %s\n", spec);
        exit(2);
    }
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(fd, (struct sockaddr *)&addr, sizeof addr) || listen(fd, 512)) {
        fprintf(stderr, "dsec-agent: listen on TCP %s: %s\n", spec, strerror(errno));
        exit(1);
    }
    return fd;
}

/* A Unix socket path, or "tcp:ADDRESS:PORT" (VMs reach their agent through a TCP port forward). */
static int listen_on(const char *path)
{
    if (!strncmp(path, "tcp:", 4))
        return listen_tcp(path + 4);

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (strlen(path) >= sizeof addr.sun_path) {
        fprintf(stderr, "dsec-agent: socket path too long: %s\n", path);
        exit(1);
    }
    strcpy(addr.sun_path, path);
    unlink(path);
    mode_t old = umask(0177); /* the socket file is created 0600, with no window */
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof addr) || listen(fd, 512)) {
        fprintf(stderr, "dsec-agent: listen on %s: %s\n", path, strerror(errno));
        exit(1);
    }
    umask(old);
    return fd;
}

int main(int argc, char **argv)
{
    sigset_t set;
    struct rlimit raised;

    const char *listen_at = NULL, *token_from = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--listen") && i + 1 < argc)
            listen_at = argv[++i];
        else if (!strcmp(argv[i], "--token-from") && i + 1 < argc)
            token_from = argv[++i];
        else if (!strcmp(argv[i], "--confine"))
            confine = 1;
        else
            listen_at = NULL, i = argc;
    }
    if (!listen_at) {
        fprintf(stderr, "usage: dsec-agent --listen PATH|tcp:ADDRESS:PORT [--token-from DEVICE] [--confine]\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGCHLD, SIG_DFL); /* an inherited SIG_IGN would auto-reap and hide exit codes */
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGIO);
    sigprocmask(SIG_BLOCK, &set, NULL);
    sig_fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    prctl(PR_SET_CHILD_SUBREAPER, 1); /* when not PID 1, orphans still come back to us */
    getrlimit(RLIMIT_NOFILE, &nofile);
    raised = (struct rlimit){nofile.rlim_max, nofile.rlim_max};
    setrlimit(RLIMIT_NOFILE, &raised);

    int lfd = listen_on(listen_at);
    /* Ready: the byte `R` on a runtime's pipe. A VM's stdout is its console, which firmware and
     * the kernel write to as well (SeaBIOS's "Booting from ROM.."), so there it is a line
     * nothing else prints (substrates/vm/guest.py CONSOLE_READY). */
    const char *ready = token_from ? CONSOLE_READY : "R";
    if (write(1, ready, strlen(ready)) != (ssize_t)strlen(ready))
        return 1;
    if (token_from)
        boot_from(token_from);
    int null = open("/dev/null", O_RDWR);
    for (int fd = 0; fd < 3; fd++)
        dup2(null, fd);
    if (null > 2)
        close(null);

    for (;;) {
        nwatch = 0;
        watch(lfd, POLLIN, W_LISTEN, NULL, 0);
        watch(sig_fd, POLLIN, W_SIGNAL, NULL, 0);
        for (struct conn *c = conns; c; c = c->next) {
            /* a tunnel reads its client only into an empty `up`, and not while connecting
               (an EOF still shows as POLLHUP) */
            int in = c->tun_state == 1 || (c->tun_state == 2 && buf_pending(&c->up)) ? 0 : POLLIN;
            watch(c->fd, in | (want_write(c) ? POLLOUT : 0), W_CONN, c, 0);
            short tun = c->tun_state == 1 ? POLLOUT
                        : c->tun_state == 2 ? (buf_pending(&c->out) || c->tun_eof ? 0 : POLLIN) |
                                                  (buf_pending(&c->up) ? POLLOUT : 0)
                                            : 0;
            if (tun) /* unwatched when idle: a port that hung up must not spin the loop */
                watch(c->tun, tun, W_TUN, c, 0);
        }
        for (struct proc *p = procs; p; p = p->next) {
            for (int i = 0; i < 2; i++)
                if (want_read(p, i))
                    watch(p->out[i], POLLIN, W_OUT, p, i);
            if (p->in >= 0 && (buf_pending(&p->stdin_data) || !p->stdin_open))
                watch(p->in, POLLOUT, W_IN, p, 0);
        }
        for (int i = 0; i < nsinks; i++)
            watch(sinks[i], POLLIN, W_SINK, NULL, i);

        if (poll(pfds, nwatch, poll_timeout()) < 0 && errno != EINTR)
            return 1;
        if (pfds[1].revents)
            handle_signals(); /* first: reaping may retire pipes watched below */
        for (int k = 2; k < nwatch; k++)
            if (pfds[k].revents)
                handle(&pfds[k], &watches[k]);
        if (pfds[0].revents)
            accept_all(lfd);
        kill_timed_out();
        finish_drained();
        sweep();
    }
}
