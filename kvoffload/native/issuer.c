/* kvoffload's native library: the issuer, one thread per direction that plans and enqueues a
 * job's copies and finds their completion without Python's GIL, and the worker's admission check of
 * a job's block ids (docs/design.md §16).
 *
 * Python hands a job over with one call (kvo_hand_off: the block ids are copied here, and the
 * caller's fence is recorded in the same call unless the caller took one) and returns.
 * The thread, blocked on a condition variable until then, plans the job (the copy kernel's launch
 * parameters, batched-DMA descriptors merged where they continue each other, staged chunks rotating
 * over the staging ring), enqueues it behind the caller's fence on the direction's streams through
 * driver entry points Python resolved with cuGetProcAddress, records its end event, and then polls
 * that event (cuEventQuery, short sleeps with a 1 us timer slack) until it completes; waiters on a
 * condition variable are woken at once. A waiter spinning for the job polls it too (waiter_query), a
 * small job handed to an idle thread is issued by its caller (caller_issue), and a caller about to
 * hand over a large one may wake the thread first (kvo_issuer_expect). No CUDA header is needed:
 * the few types are declared here.
 *
 * Ownership: the issuer owns its thread, its event pools and every job from kvo_hand_off until the
 * last of its references (the thread's, the ticket's, the layer marks') is dropped. A fence is owned
 * by its references: its taker's and each job's until that job's stream wait was enqueued. The
 * issuer's memory goes when its owner (Python) and every job have let go (kvo_issuer_free after
 * kvo_issuer_stop). The streams, the staging ring and the kernel tables are Python's, kept alive
 * until the thread was joined.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef uint64_t CUdeviceptr;

enum {
    KVO_NOT_READY = 600,
    KVO_INVALID_CONTEXT = 201,
    /* kvoffload's own codes (negative: not CUresults) */
    KVO_NO_MEMORY = -2,      /* host allocation failed */
    KVO_RELEASED = -3,       /* the issuer stopped before the job was issued */
    KVO_ABANDONED = -4,      /* the issuer stopped while the job was in flight */
    KVO_RECORD_TOO_BIG = -5, /* a staged row does not fit a slot */
    KVO_TIMEOUT = -6,        /* a wait passed its deadline */
    KVO_BAD_ARGUMENT = -7,   /* an argument out of its range (kvo_wait_layer's layer) */
    KVO_JOB_FAILED = -8,     /* kvo_wait_layer: the job ended with an error (failed or given up) */
};
enum { PATH_DMA = 0, PATH_SM = 1, PATH_STAGED = 2 };
/* A test's control breaks rule 5 on purpose: a slot is rewritten without waiting for its last read. */
enum { CONTROL_SKIP_SLOT_WAIT = 1, CONTROL_NEVER_SIGNAL = 2, CONTROL_COMING_ALWAYS = 4,
       CONTROL_BOOK_ANY_ORDER = 8, CONTROL_BOOK_WAIT_ITSELF = 16 };
enum { JOB_QUEUED = 0, JOB_ISSUED = 1, JOB_DONE = 2 };
enum { BOOK_FIELDS = 9 }; /* a result's int64 fields in kvo_book_take's out */
/* kind of failure, as the Python ticket reports it */
enum { FAIL_NONE = 0, FAIL_PARTLY = 1, FAIL_NOTHING = 2, FAIL_COMPLETION = 3 };
/* BATCH_MAX: descriptors per cuMemcpyBatchAsync call. The driver holds a lock for the whole call,
 * and the caller's own driver calls (its fence's cuEventRecord) wait for it: one call of 16 384
 * descriptors held the engine's thread for about 10 ms on the H200 (bench --latency, path dma).
 * BATCH_FIRST: descriptors of the first call of a run of them, each next call taking twice as many
 * up to BATCH_MAX: the copy engine starts on a call's descriptors only once the call returned, and
 * the driver spends about 0.37 us a descriptor (a call of 1024 took 350-380 us on an H100 host),
 * so one call of them all held a job's first byte that long (docs/design.md §16, *Descriptors in
 * growing calls*); kvoffload.bindings.copier.BATCH_FIRST_COPIES is the same for the Python paths. */
enum { MAX_FUNCTIONS = 4, MAX_ROWS = 1024, BATCH_MAX = 1024, BATCH_FIRST = 64, ABI_13 = 13000 };
/* The most a caller issues of a layered job's first layer (first_layer_is_cheap): staged chunks,
 * descriptors beside its strided copies, and strided copies (a dma layer's direct ones too). */
enum { CALLER_LAYER_CHUNKS = 4, CALLER_LAYER_COPIES = 16, CALLER_LAYER_STRIDED = 16 };
/* The issuing side's driver calls by kind, for the diagnostics of kvo_issuer_call_stats; a caller's
 * driver call longer than SLOW_CALLER_CALL_NS is counted by the kind in progress when it began. */
enum { CALL_NONE = 0, CALL_RECORD, CALL_WAIT, CALL_COPY, CALL_LAUNCH, CALL_QUERY, CALL_KINDS };
#define SLOW_CALLER_CALL_NS 100000
/* A staged job's chunks grow by this factor from its edge chunk (staged_chunks). */
enum { EDGE_GROWTH = 8, MAX_EDGE_CHUNKS = 64 };

typedef CUresult (*fn_ctx_set)(void *);
typedef CUresult (*fn_ctx_get)(void **);
typedef CUresult (*fn_event_create)(CUevent *, unsigned);
typedef CUresult (*fn_event_destroy)(CUevent);
typedef CUresult (*fn_event_record)(CUevent, CUstream);
typedef CUresult (*fn_event_query)(CUevent);
typedef CUresult (*fn_event_elapsed)(float *, CUevent, CUevent);
typedef CUresult (*fn_stream_wait)(CUstream, CUevent, unsigned);
typedef CUresult (*fn_memcpy)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*fn_batch13)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *,
                               size_t, CUstream);
typedef CUresult (*fn_batch12)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *,
                               size_t, size_t *, CUstream);
typedef CUresult (*fn_memcpy_2d)(const void *, CUstream);
typedef CUresult (*fn_launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **);

/* CUDA_MEMCPY2D as the driver lays it out: `height` rows of `width` bytes, each side `pitch` bytes
 * from row to row. A host side is named by its pointer, a device side by its address. */
struct memcpy_2d {
    size_t src_x, src_y;
    int32_t src_type;
    const void *src_host;
    CUdeviceptr src_device;
    void *src_array;
    size_t src_pitch;
    size_t dst_x, dst_y;
    int32_t dst_type;
    void *dst_host;
    CUdeviceptr dst_device;
    void *dst_array;
    size_t dst_pitch;
    size_t width, height;
};
enum { MEMORYTYPE_HOST = 1, MEMORYTYPE_DEVICE = 2 };
_Static_assert(sizeof(struct memcpy_2d) == 128, "CUDA_MEMCPY2D is 128 bytes on 64-bit hosts");
/* The widest host pitch a strided copy is given (the driver refuses pitches above the device's
 * CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2^31 - 1 on the GPUs the library runs on). */
#define STRIDED_MAX_PITCH ((int64_t)INT32_MAX)
/* The fewest rows a strided copy moves where strided_row_bytes scales the threshold with a row's
 * width (plan_min_rows): below 8 KiB a descriptor's cost on the copy engine stops shrinking with its
 * bytes, so runs shorter than this cost less as descriptors than as one strided copy. */
#define STRIDED_FLOOR_ROWS ((int64_t)8)
/* A dma plan's pages this wide or wider stay descriptors where their pairs run (direct_rows): such
 * copies already move at the link's pace one by one (512 KiB spans took 1.05x a contiguous copy). */
#define DIRECT_MAX_WIDTH ((int64_t)512 << 10)

/* What Python passes to kvo_issuer_new (ctypes Structure of the same layout: 8-byte fields). */
struct kvo_config {
    void *ctx_set_current, *context;
    void *event_create, *event_destroy, *event_record, *event_query, *event_elapsed;
    void *stream_wait_event, *memcpy_async, *memcpy_batch;
    int64_t batch_abi;   /* 0: no batch call (one cuMemcpyAsync per copy) */
    void *batch_attrs;   /* CUmemcpyAttributes of this direction's source access order */
    void *launch;
    void *functions[MAX_FUNCTIONS];
    int64_t function_rows[MAX_FUNCTIONS]; /* ascending */
    int64_t nfunctions, threads;
    void *copy_stream, *kernel_stream;
    int64_t store, sm_ctas, staged_ctas;
    int64_t slots, slot_bytes;
    const uint64_t *slot_bases;
    int64_t poll_min_ns, poll_max_ns;
    int64_t controls;    /* CONTROL ONLY (tests that prove a rule): CONTROL_* */
    int64_t wait_spin_ns; /* how long kvo_job_wait spins before it blocks */
    int64_t give_way_ns;  /* the longest the thread gives way to one caller's driver call */
    int64_t idle_spin_ns; /* how long the thread, out of work, looks for a job before it blocks */
    int64_t end_lead_ns;  /* a job is polled without sleeps from this long before its predicted end
                           * to as long after it (0: never) */
    int64_t idle_nap_ns;  /* out of work, the thread blocks in naps this long (0: blocks until woken) */
    int64_t idle_light_ns; /* for this long after its last work, then until woken */
    int64_t caller_issue_max; /* a job of at most this many pages handed to an idle thread is issued
                               * by the caller (0: never); see caller_issue */
    void *ctx_get_current;    /* cuCtxGetCurrent (needed when caller_issue_max > 0) */
    int64_t wait_query_ns;    /* a spinning kvo_job_wait queries its job's end itself at most this
                               * often once the job heads the flight (0: never); see waiter_query */
    int64_t expect_spin_ns;   /* a thread woken by kvo_issuer_expect looks for the hand-off this long
                               * before it blocks again (0: kvo_issuer_expect does nothing) */
    void *memcpy_2d;          /* cuMemcpy2DAsync (NULL: staged rows always go as descriptors) */
    int64_t strided_min_rows; /* a staged chunk's rows of at least this many consecutive records go
                               * as one strided copy per run (0: never), or fewer for narrow rows
                               * where strided_row_bytes > 0; see plan_min_rows, staged_plan */
    int64_t edge_bytes;       /* bytes of a staged job's edge chunk (0: every chunk a whole slot);
                               * see staged_chunks */
    int64_t caller_coming_ns; /* a busy thread told by kvo_issuer_expect that a caller's hand-off
                               * is coming gives way for at most this long (0: never); see give_way */
    int64_t start_timeout_ns; /* kvo_issuer_new waits this long for the thread's start (<= 0: 0) */
    int64_t piece_bytes;      /* no copy is longer (0: no bound): descriptors are cut into pieces
                               * of it (append_copy), strided copies hold the rows it holds and
                               * go as descriptors where plan_min_rows rows do not fit it
                               * (strided_rows) */
    int64_t wait_lead_ns;     /* a kvo_job_wait blocked past its spin wakes this long before its
                               * job's predicted end and spins to as long after it (0: it blocks
                               * until the job is done); see kvo_job_wait */
    int64_t strided_row_bytes; /* a plan's strided copies move runs of at least one record per this
                               * many bytes of its copies' mean width (at least STRIDED_FLOOR_ROWS,
                               * at most strided_min_rows); 0: strided_min_rows whatever the width.
                               * See plan_min_rows */
    int64_t share_cpu;        /* 1: the issuing side and its callers give a CPU they share to each
                               * other (yield_to_caller, give_cpu); 0: never */
};

/* One plan: the pages of a block (or of one layer of it) and how host records hold them. */
struct kvo_plan_spec {
    int64_t pages;
    const int64_t *dev_base, *dev_stride, *nbytes, *host_offset, *segment;
    int64_t record_bytes, host_base, host_stride, chunk_records, merge;
    int64_t kseg, kseg_rows; /* the copy kernel's table of this plan (device memory) */
    int64_t cseg, cseg_rows; /* the table of its staged rows (pitch-wide) */
    int64_t pitch;           /* bytes of one staged row */
    int64_t runs;            /* byte ranges of a record a staged row holds */
    const int64_t *run_offset, *run_size;
};

struct kvo_plan {
    int64_t pages;
    int64_t *dev_base, *dev_stride, *nbytes, *host_offset, *segment;
    int64_t record_bytes, host_base, host_stride, chunk_records, merge;
    int64_t kseg, kseg_rows, cseg, cseg_rows, pitch, runs;
    int64_t *run_offset, *run_size;
    int64_t bytes;           /* of one pair: the sum of its pages' bytes */
};

struct pool { CUevent *free; int64_t count, cap; unsigned flags; };

struct kvo_fence { CUevent event; int64_t refs; };

struct kvo_issuer;

struct kvo_job {
    struct kvo_issuer *issuer;
    struct kvo_job *next;
    int64_t path, n, nplans, first, layered;
    int64_t begun;         /* its issue began: fence waited for, start recorded (issue_begin) */
    int64_t alone;         /* nothing of its direction was in flight or queued when its issue was
                            * taken up: a staged job's edge chunk is then worth it (at_edge) */
    int64_t next_plan;     /* plans (layers) enqueued so far (issue_plans) */
    int64_t *dev_ids, *host_ids;
    struct kvo_plan **plans;
    struct kvo_fence *fence;
    CUevent start, end;
    CUevent *marks;        /* one per layer (first + nplans), recorded by the thread */
    int64_t marked;        /* layers whose mark is recorded or will never be */
    int64_t failed_from;   /* a partly failed issue: the first layer it did not enqueue */
    int64_t marks_released, waiters;
    int64_t state, error, fail, refs;
    const char *error_call;
    double seconds;
    int64_t polled_ns;     /* when the thread first found it in flight */
    int64_t bytes;         /* the bytes it copies */
    int64_t expected_end;  /* CLOCK_MONOTONIC ns of its predicted end (0: none; see predict_end) */
    int64_t runs;          /* its predicted device time, ns (0: none; see predict_end) */
    int64_t times[4];      /* CLOCK_MONOTONIC ns: handed over, issue began, issued, found done */
    int64_t caller_cpu;    /* the CPU its caller handed it over on (-1: unknown) */
    int64_t id, tag;       /* a booked job's id and its owner's tag (kvo_hand_off_booked) */
    struct kvo_job *book_next; /* the next job of the issuer's book */
};

struct launch_params {
    uint64_t scalars[5];
    int32_t to_host;
    int64_t ids[2 * MAX_ROWS];
    void *pointers[7];
};

struct kvo_issuer {
    struct kvo_config c;
    uint64_t *slot_bases;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    struct kvo_job *queue_head, *queue_tail, *flight_head, *flight_tail;
    struct kvo_job *book_head, *book_tail; /* booked jobs whose results were not taken, in hand-off
                                            * order (the book holds a reference to each) */
    int64_t book_count, book_total; /* jobs in the book; jobs ever booked */
    int64_t stop, exited, joined, started, refs, ctx_error;
    int64_t orphaned; /* kvo_issuer_new gave up waiting for the start: the thread owns the issuer */
    int64_t pools_closed; /* the exiting thread took the pools' events to destroy them unlocked */
    int64_t sleeping; /* the thread waits on `work` (under mu): a hand-off must signal it */
    int64_t signals;  /* hand-offs that signalled it (kvo_issuer_counts) */
    int64_t naps;     /* idle naps the thread took (kvo_issuer_counts) */
    int64_t issuing;  /* a caller issues a job (caller_issue): the thread issues nothing meanwhile */
    int64_t caller_issued; /* jobs their callers issued (kvo_issuer_counts) */
    int64_t querying; /* the thread or a waiter queries the flight's head (without the lock) */
    int64_t waiter_found; /* jobs their waiters found done (kvo_issuer_counts) */
    int64_t expect_until; /* CLOCK_MONOTONIC ns until which the thread, out of work, looks for a
                           * hand-off kvo_issuer_expect announced (0: none) */
    int64_t expects;      /* the calls of kvo_issuer_expect that woke the thread (kvo_issuer_counts) */
    atomic_int callers; /* callers' threads inside a driver call of theirs (see give_way) */
    int64_t coming_until; /* CLOCK_MONOTONIC ns until which the thread gives way to a caller whose
                           * hand-off kvo_issuer_expect announced (0: none; atomics) */
    int64_t comings;      /* the calls of kvo_issuer_expect that announced one (kvo_issuer_counts) */
    int coming_lapsed;    /* an announcement lapsed with no caller's record: announcements are
                           * ignored until the next record (atomics; see give_way) */
    int thread_issues;    /* the thread is issuing a job it took off the queue (under the mutex) */
    int64_t thread_yields, waiter_yields, spin_yields; /* CPUs given (kvo_issuer_yields; atomics) */
    int64_t thread_cpu;   /* the CPU the thread last woke or took up work on (-1: none yet; atomics) */
    int64_t caller_cpu;   /* the CPU of the last caller that announced a hand-off or entered a driver
                           * call of its own (-1: none yet; atomics): see give_cpu */
    /* Diagnostics (kvo_issuer_call_stats): the issuing side's driver call in progress (CALL_*),
     * its longest call of each kind, and the callers' calls: how many, the longest, and those
     * slower than SLOW_CALLER_CALL_NS by the issuing side's call in progress when they began. */
    atomic_int issue_call;
    int64_t issue_call_max_ns[CALL_KINDS];
    int64_t caller_calls, caller_call_max_ns, slow_caller_calls[CALL_KINDS];
    struct pool timing, plain;
    /* the thread's state (the rate also the waiter's, under mu: learn_rate) */
    double fastest_ns_per_byte; /* the fastest completed job's device time per byte (0: none yet) */
    int64_t last_expected_end;  /* the predicted end of the last job put in flight */
    CUstream last_end;
    int64_t next_slot;
    CUevent *filled, *drained;
    struct launch_params params;
    CUdeviceptr *d_dst, *d_src;
    size_t *d_size, d_cap;
    struct memcpy_2d *strided; /* a staged chunk's strided copies (see staged_plan) */
    size_t strided_cap;
    int64_t direct_copies; /* strided copies dma plans made (kvo_issuer_direct_copies; atomics) */
    int64_t *order, order_cap;
    uint64_t *radix; int64_t radix_cap; /* staged_order's two buffers of radix_cap each */
};

/* ---------------------------------------------------------------------------------- helpers */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void deadline_after(struct timespec *out, int64_t ns) {
    if (ns < 0) ns = 0; /* a negative remainder would make the timespec invalid: EINVAL, not a timeout */
    clock_gettime(CLOCK_MONOTONIC, out);
    out->tv_sec += ns / 1000000000LL;
    out->tv_nsec += ns % 1000000000LL;
    if (out->tv_nsec >= 1000000000L) { out->tv_sec += 1; out->tv_nsec -= 1000000000L; }
}

static void cond_init(pthread_cond_t *cond) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
}

/* A spin of one side that waits for the other side's progress gives its CPU (with share_cpu) where
 * the other side was last seen on the same CPU (`other`: is->thread_cpu or is->caller_cpu): if the
 * two share it (a host of few cores, or an engine's threads pinned together), a spin that never
 * yields holds it until the scheduler's slice ends, and the side it waits for cannot run
 * meanwhile (a waiter spinning for a job the thread had not issued got its result after its 2 ms
 * spin). Sides seen on CPUs of their own never yield, so a spin never gives its CPU to an unrelated
 * thread. `count`: kvo_issuer_yields' counter. */
static void give_cpu(struct kvo_issuer *is, const int64_t *other, int64_t *count) {
    int64_t there = is->c.share_cpu ? __atomic_load_n(other, __ATOMIC_RELAXED) : -1;
    if (there < 0 || sched_getcpu() != there) return; /* -1: not seen (or sched_getcpu failed) */
    __atomic_fetch_add(count, 1, __ATOMIC_RELAXED);
    sched_yield();
}

/* The side that calls it runs on the CPU it records in `at` now (is->thread_cpu, is->caller_cpu). */
static void seen_on_cpu(struct kvo_issuer *is, int64_t *at) {
    if (is->c.share_cpu) __atomic_store_n(at, (int64_t)sched_getcpu(), __ATOMIC_RELAXED);
}

/* The thread took up `job` (without mu), handed over and not begun by its caller. Where the thread
 * runs on the CPU the caller handed the job over on, the hand-off's signal woke it there and it
 * has likely preempted the caller, whose call would return only after the whole issue (on a CPU
 * the two share: a 256-block job's call took 350-400 us against 13 with a CPU each on the CI host,
 * docs/design.md §16). So it gives the CPU back once first (with share_cpu); it runs again when
 * the caller blocks, spins for it (give_cpu), ends its slice, or when an idle CPU takes it. */
static void yield_to_caller(struct kvo_issuer *is, struct kvo_job *job) {
    if (!is->c.share_cpu || job->caller_cpu < 0 || job->begun || sched_getcpu() != job->caller_cpu) return;
    __atomic_fetch_add(&is->thread_yields, 1, __ATOMIC_RELAXED);
    sched_yield();
}

/* The thread gives way to a caller's driver call (the fence's record, a layer's stream wait) before
 * each of its own: the driver serialises the calls of one context, and a thread that issues call
 * after call would keep the caller's thread (the engine's) waiting behind several of them. The wait
 * is bounded: a caller stalled inside its call delays the issue by the config's give_way_ns at most. */
static void give_way(struct kvo_issuer *is) {
    int64_t coming = __atomic_load_n(&is->coming_until, __ATOMIC_ACQUIRE);
    if (!atomic_load_explicit(&is->callers, memory_order_acquire) && !coming) return;
    int64_t now = now_ns(), until = now + is->c.give_way_ns;
    /* Also while a caller announced by kvo_issuer_expect is on its way to its record (until its
     * record, or until the announcement lapses): its record then finds no call of ours to wait for. */
    while (now < until && (atomic_load_explicit(&is->callers, memory_order_acquire) ||
                           now < __atomic_load_n(&is->coming_until, __ATOMIC_ACQUIRE))) {
        cpu_relax();
        give_cpu(is, &is->caller_cpu, &is->spin_yields); /* the caller's call, on this CPU, can end */
        now = now_ns();
    }
    /* An announcement that lapsed with no record (a caller whose job was then declined, or that
     * never came) ends here, and further ones are ignored until a caller's record: a caller that
     * announces again and again without recording delays the issue by one caller_coming_ns at
     * most between two records, never for as long as it keeps announcing. */
    coming = __atomic_load_n(&is->coming_until, __ATOMIC_ACQUIRE);
    if (coming && now >= coming && !(is->c.controls & CONTROL_COMING_ALWAYS) &&
        __atomic_compare_exchange_n(&is->coming_until, &coming, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        __atomic_store_n(&is->coming_lapsed, 1, __ATOMIC_RELEASE);
}

/* A caller's thread enters (1) or leaves (-1) a driver call of its own. */
static void caller_call(struct kvo_issuer *is, int delta) {
    if (delta > 0) seen_on_cpu(is, &is->caller_cpu);
    atomic_fetch_add_explicit(&is->callers, delta, memory_order_acq_rel);
}

/* The issuing side (the thread, or a caller that issues) enters a driver call of `kind`: returns
 * when it began. Only the issuing side writes these (one at a time: a caller issues while the
 * thread issues nothing); kvo_issuer_call_stats reads them. */
static int64_t issue_call_begin(struct kvo_issuer *is, int kind) {
    atomic_store_explicit(&is->issue_call, kind, memory_order_relaxed);
    return now_ns();
}

static void issue_call_end(struct kvo_issuer *is, int kind, int64_t began) {
    int64_t took = now_ns() - began;
    atomic_store_explicit(&is->issue_call, CALL_NONE, memory_order_relaxed);
    if (took > __atomic_load_n(&is->issue_call_max_ns[kind], __ATOMIC_RELAXED))
        __atomic_store_n(&is->issue_call_max_ns[kind], took, __ATOMIC_RELAXED);
}

/* The issuing side's driver call `call` of `kind`, timed (a GNU statement expression). */
#define ISSUE_CALL(is, kind, call) __extension__({ \
    int64_t began_ = issue_call_begin((is), (kind)); \
    CUresult r_ = (call); \
    issue_call_end((is), (kind), began_); \
    r_; })

/* A caller's driver call that began while the issuing side was in a call of kind `at` took `took`
 * ns: counted for kvo_issuer_call_stats (callers may race: atomics). CALLER_CALL times one. */
static void caller_call_took(struct kvo_issuer *is, int at, int64_t took) {
    __atomic_fetch_add(&is->caller_calls, 1, __ATOMIC_RELAXED);
    int64_t longest = __atomic_load_n(&is->caller_call_max_ns, __ATOMIC_RELAXED);
    while (took > longest &&
           !__atomic_compare_exchange_n(&is->caller_call_max_ns, &longest, took, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
    if (took > SLOW_CALLER_CALL_NS) __atomic_fetch_add(&is->slow_caller_calls[at], 1, __ATOMIC_RELAXED);
}

/* A caller's driver call `call` (on the caller's thread), timed for kvo_issuer_call_stats. */
#define CALLER_CALL(is, call) __extension__({ \
    int at_ = atomic_load_explicit(&(is)->issue_call, memory_order_relaxed); \
    int64_t began_ = now_ns(); \
    CUresult r_ = (call); \
    caller_call_took((is), at_, now_ns() - began_); \
    r_; })

/* The thread's driver calls that enqueue work: each gives way first. */
static CUresult record_on(struct kvo_issuer *is, CUevent ev, CUstream stream) {
    give_way(is);
    return ISSUE_CALL(is, CALL_RECORD, ((fn_event_record)is->c.event_record)(ev, stream));
}

static CUresult wait_on(struct kvo_issuer *is, CUstream stream, CUevent ev) {
    give_way(is);
    return ISSUE_CALL(is, CALL_WAIT, ((fn_stream_wait)is->c.stream_wait_event)(stream, ev, 0));
}

/* A staged chunk's stream wait, timed as the issuing side's (it does not give way first). */
static CUresult chunk_wait(struct kvo_issuer *is, CUstream stream, CUevent ev) {
    return ISSUE_CALL(is, CALL_WAIT, ((fn_stream_wait)is->c.stream_wait_event)(stream, ev, 0));
}

/* Whether a call that failed with `r` may be made again: the calling thread had no current context
 * (a caller's thread that never made it current) and the issuer's context is now current. */
static int context_restored(const struct kvo_issuer *is, CUresult r) {
    return r == KVO_INVALID_CONTEXT && ((fn_ctx_set)is->c.ctx_set_current)(is->c.context) == 0;
}

static int64_t *copy_i64(const int64_t *src, int64_t n) {
    int64_t *out = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (out && n > 0) memcpy(out, src, (size_t)n * sizeof(int64_t));
    return out;
}

/* A new event of a pool's kind (a driver call, made without the mutex). */
static CUresult create_event(struct kvo_issuer *is, const struct pool *p, CUevent *out) {
    CUresult r = ((fn_event_create)is->c.event_create)(out, p->flags);
    if (context_restored(is, r)) r = ((fn_event_create)is->c.event_create)(out, p->flags);
    return r;
}

/* Take an event from a pool, or create one when none is free: the creation, a driver call, is made
 * without the mutex, so that no wait on the mutex (a stop's, a waiter's) waits for the driver.
 * KVO_RELEASED once the pools closed (the thread is exiting). The caller does not hold the mutex. */
static CUresult take_event(struct kvo_issuer *is, struct pool *p, CUevent *out) {
    pthread_mutex_lock(&is->mu);
    int closed = is->pools_closed, free_one = !closed && p->count > 0;
    if (free_one) *out = p->free[--p->count];
    pthread_mutex_unlock(&is->mu);
    if (closed) return KVO_RELEASED;
    return free_one ? 0 : create_event(is, p, out);
}

/* Give an event back (its last record may still be pending: a later record replaces it). An event
 * returned after the pools closed (the thread is exiting) is left to the process: it may still be in
 * use on the device. */
static void pool_give(struct kvo_issuer *is, struct pool *p, CUevent ev) {
    if (!ev || is->exited || is->pools_closed) return;
    if (p->count == p->cap) {
        int64_t cap = p->cap ? 2 * p->cap : 64;
        CUevent *grown = realloc(p->free, (size_t)cap * sizeof(CUevent));
        if (!grown) return; /* left to the process */
        p->free = grown;
        p->cap = cap;
    }
    p->free[p->count++] = ev;
}

static void pool_destroy(struct kvo_issuer *is, struct pool *p) {
    for (int64_t i = 0; i < p->count; i++) ((fn_event_destroy)is->c.event_destroy)(p->free[i]);
    p->count = 0;
}

static void issuer_unref(struct kvo_issuer *is); /* caller holds the mutex; it may free `is` */

/* A job's memory (its events are given back by whoever drops its last reference). */
static void job_free(struct kvo_job *job) {
    free(job->dev_ids); free(job->host_ids); free(job->plans); free(job->marks); free(job);
}

/* Drop one reference to a job (caller holds the mutex); the last one frees it and gives its events
 * back. */
static void job_unref(struct kvo_job *job) {
    struct kvo_issuer *is = job->issuer;
    if (--job->refs > 0) return;
    pool_give(is, &is->timing, job->start);
    pool_give(is, &is->timing, job->end);
    if (job->marks && !job->marks_released)
        for (int64_t i = 0; i < job->first + job->nplans; i++) pool_give(is, &is->plain, job->marks[i]);
    job_free(job);
    issuer_unref(is);
}

static void fence_unref(struct kvo_issuer *is, struct kvo_fence *fence) {
    if (--fence->refs > 0) return;
    pool_give(is, &is->plain, fence->event);
    free(fence);
}

/* --------------------------------------------------------------------------- the copy kernel */

/* Launch the copy kernel over `count` rows (device block dev[i] <-> row host[i] of the record array
 * at host_base, rows record_bytes apart), one launch per MAX_ROWS rows, each with the smallest entry
 * point that holds its rows. */
static CUresult launch_rows(struct kvo_issuer *is, int64_t table, int64_t table_rows,
                            const int64_t *dev, const int64_t *host, int64_t host_step,
                            int64_t count, uint64_t host_base, int64_t record_bytes, int to_host,
                            int64_t ctas, CUstream stream, const char **call) {
    struct launch_params *p = &is->params;
    *call = "cuLaunchKernel";
    if (table_rows == 0) return 0;
    for (int64_t start = 0; start < count; start += MAX_ROWS) {
        int64_t rows = count - start < MAX_ROWS ? count - start : MAX_ROWS;
        int64_t f = 0;
        while (f + 1 < is->c.nfunctions && is->c.function_rows[f] < rows) f++;
        int64_t width = is->c.function_rows[f];
        p->scalars[0] = (uint64_t)table;
        p->scalars[1] = (uint64_t)table_rows;
        p->scalars[2] = (uint64_t)rows;
        p->scalars[3] = host_base;
        p->scalars[4] = (uint64_t)record_bytes;
        p->to_host = to_host;
        for (int64_t i = 0; i < rows; i++) {
            p->ids[i] = dev[start + i];
            p->ids[width + i] = host ? host[start + i] : (start + i) * host_step;
        }
        give_way(is);
        CUresult r = ISSUE_CALL(is, CALL_LAUNCH,
                                ((fn_launch)is->c.launch)(is->c.functions[f], (unsigned)ctas, 1, 1,
                                                          (unsigned)is->c.threads, 1, 1, 0, stream,
                                                          p->pointers, 0));
        if (r) return r;
    }
    return 0;
}

/* --------------------------------------------------------------------------------- batched DMA */

static int reserve_descriptors(struct kvo_issuer *is, size_t n) {
    if (n <= is->d_cap) return 1;
    size_t cap = is->d_cap ? is->d_cap : 1024;
    while (cap < n) cap *= 2;
    CUdeviceptr *d = realloc(is->d_dst, cap * sizeof(CUdeviceptr));
    if (!d) return 0;
    is->d_dst = d;
    CUdeviceptr *s = realloc(is->d_src, cap * sizeof(CUdeviceptr));
    if (!s) return 0;
    is->d_src = s;
    size_t *z = realloc(is->d_size, cap * sizeof(size_t));
    if (!z) return 0;
    is->d_size = z;
    is->d_cap = cap;
    return 1;
}

/* Append one copy, merged into the previous one when both sides continue it inside one area, in
 * copies of at most piece_bytes each (0: no bound): a merged run is cut every piece_bytes from its
 * start, as the Python paths cut it (copier.in_pieces): the copy engine can take another stream's
 * copy in the same direction (the expedited load lane's) only between copies, and did so only where
 * the device's queues let it (docs/design.md §4, Copies in pieces). Grows the descriptor arrays as
 * the pieces need; 0 when it could not. */
static int append_copy(struct kvo_issuer *is, size_t *count, int64_t *last_area, uint64_t dst,
                       uint64_t src, uint64_t size, int64_t area, int merge) {
    uint64_t piece = is->c.piece_bytes > 0 ? (uint64_t)is->c.piece_bytes : UINT64_MAX;
    size_t k = *count;
    if (!size) return 1; /* nothing to move, and no run for the next copy to continue */
    if (merge && k > 0 && *last_area == area && is->d_dst[k - 1] + is->d_size[k - 1] == dst &&
        is->d_src[k - 1] + is->d_size[k - 1] == src && is->d_size[k - 1] < piece) {
        uint64_t take = piece - is->d_size[k - 1];
        if (take > size) take = size;
        is->d_size[k - 1] += take;
        dst += take;
        src += take;
        size -= take;
        if (!size) return 1;
    }
    size_t pieces = (size_t)(size / piece + (size % piece != 0));
    if (!reserve_descriptors(is, k + pieces)) return 0;
    for (; size; k++) {
        uint64_t take = size < piece ? size : piece;
        is->d_dst[k] = dst;
        is->d_src[k] = src;
        is->d_size[k] = take;
        dst += take;
        src += take;
        size -= take;
    }
    *last_area = area;
    *count = k;
    return 1;
}

/* Enqueue the descriptors built so far on `stream`, in calls growing from BATCH_FIRST descriptors. */
static CUresult issue_copies(struct kvo_issuer *is, size_t count, CUstream stream,
                             const char **call) {
    if (count == 0) return 0;
    if (count == 1 || !is->c.memcpy_batch) {
        *call = "cuMemcpyAsync";
        for (size_t i = 0; i < count; i++) {
            give_way(is);
            CUresult r = ISSUE_CALL(is, CALL_COPY, ((fn_memcpy)is->c.memcpy_async)(
                                                       is->d_dst[i], is->d_src[i], is->d_size[i], stream));
            if (r) return r;
        }
        return 0;
    }
    *call = "cuMemcpyBatchAsync";
    size_t zero = 0, fail = 0, most = BATCH_FIRST, n;
    for (size_t start = 0; start < count; start += n, most = most < BATCH_MAX / 2 ? most * 2 : BATCH_MAX) {
        n = count - start < most ? count - start : most;
        CUresult r;
        give_way(is);
        int64_t began = issue_call_begin(is, CALL_COPY);
        if (is->c.batch_abi >= ABI_13)
            r = ((fn_batch13)is->c.memcpy_batch)(is->d_dst + start, is->d_src + start,
                                                  is->d_size + start, n, is->c.batch_attrs, &zero,
                                                  1, stream);
        else
            r = ((fn_batch12)is->c.memcpy_batch)(is->d_dst + start, is->d_src + start,
                                                  is->d_size + start, n, is->c.batch_attrs, &zero,
                                                  1, &fail, stream);
        issue_call_end(is, CALL_COPY, began);
        if (r) return r;
    }
    return 0;
}

/* ------------------------------------------------------------------------------- staged chunks */

static int by_host(const void *a, const void *b, void *keys) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    int64_t kx = ((const int64_t *)keys)[x], ky = ((const int64_t *)keys)[y];
    if (kx != ky) return kx < ky ? -1 : 1;
    return x < y ? -1 : (x > y);
}

/* Sort the indices 0..n-1 of `keys` (each >= 0, at most `most`) by key, stably, into `order`, as
 * a radix sort of (key << index bits | index) with 8-bit digits through `packed` and `spare` (n
 * each). 0 when the pair does not fit 64 bits (the caller sorts otherwise). */
static int radix_order(int64_t *order, const int64_t *keys, int64_t n, int64_t most,
                       uint64_t *packed, uint64_t *spare) {
    int index_bits = 0, key_bits = 0;
    while (index_bits < 63 && ((int64_t)1 << index_bits) < n) index_bits++;
    while (key_bits < 63 && ((int64_t)1 << key_bits) <= most) key_bits++;
    if (index_bits + key_bits > 64) return 0;
    for (int64_t i = 0; i < n; i++) packed[i] = (uint64_t)keys[i] << index_bits | (uint64_t)i;
    for (int shift = 0; shift < index_bits + key_bits; shift += 8) {
        size_t at[257] = {0};
        for (int64_t i = 0; i < n; i++) at[((packed[i] >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++) at[d + 1] += at[d];
        for (int64_t i = 0; i < n; i++) spare[at[(packed[i] >> shift) & 255]++] = packed[i];
        uint64_t *t = packed; packed = spare; spare = t;
    }
    uint64_t mask = index_bits ? (~(uint64_t)0 >> (64 - index_bits)) : 0;
    for (int64_t i = 0; i < n; i++) order[i] = (int64_t)(packed[i] & mask);
    return 1;
}

/* The pairs' order for a staged job: by host record (stable), so consecutive records merge. Host
 * records already in order (an engine's usual job) are not sorted: the identity is the stable sort.
 * Others go through radix_order (qsort_r through a comparison callback took 65-80 us of the
 * thread's for 1024 pairs on an H100 host, 10.5 us on a warm CI host; docs/design.md §16), or
 * qsort_r when its buffers cannot be had. */
static int64_t *staged_order(struct kvo_issuer *is, const struct kvo_job *job) {
    int64_t n = job->n;
    if (n > is->order_cap) {
        int64_t *grown = realloc(is->order, (size_t)n * sizeof(int64_t));
        if (!grown) return 0;
        is->order = grown;
        is->order_cap = n;
    }
    int64_t sorted = 1, least = 0, most = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t h = job->host_ids[i];
        is->order[i] = i;
        sorted &= i == 0 || job->host_ids[i - 1] <= h;
        least = h < least ? h : least;
        most = h > most ? h : most;
    }
    if (sorted) return is->order;
    if (least >= 0 && n > is->radix_cap) {
        uint64_t *grown = realloc(is->radix, 2 * (size_t)n * sizeof(uint64_t));
        if (grown) { is->radix = grown; is->radix_cap = n; }
    }
    if (least < 0 || n > is->radix_cap ||
        !radix_order(is->order, job->host_ids, n, most, is->radix, is->radix + n))
        qsort_r(is->order, (size_t)n, sizeof(int64_t), by_host, job->host_ids);
    return is->order;
}

/* A staged job's chunks (docs/design.md §7), as kvoffload._descriptors.staged_chunk_rows makes
 * them: in store order, the edge chunk of `edge` rows, then chunks growing by EDGE_GROWTH up to a
 * slot's rows (the head), then whole slots, then the rest; a load with an edge takes them in
 * reverse, so that its last chunk is the small one (its end waits for that chunk's scatter, a
 * store's first DMA for its first chunk's gather). Without an edge: whole slots, then the rest. */
struct chunks {
    int64_t head[MAX_EDGE_CHUNKS];
    int64_t nhead, per_slot, full, rest, count;
    int reverse; /* a load's, with an edge */
};

static void staged_chunks(struct chunks *c, int64_t n, int64_t per_slot, int64_t edge, int store) {
    int64_t size = edge > 0 && edge < per_slot ? edge : per_slot, left = n;
    c->nhead = 0;
    while (left > 0 && size < per_slot) { /* at most log8 of per_slot steps */
        int64_t take = size < left ? size : left;
        c->head[c->nhead++] = take;
        left -= take;
        size = size > per_slot / EDGE_GROWTH ? per_slot : size * EDGE_GROWTH;
    }
    c->per_slot = per_slot;
    c->full = left / per_slot;
    c->rest = left % per_slot;
    c->count = c->nhead + c->full + (c->rest > 0);
    c->reverse = !store && edge > 0;
}

/* Rows of chunk `i` (in issue order) of `c`. */
static int64_t chunk_rows(const struct chunks *c, int64_t i) {
    int64_t k = c->reverse ? c->count - 1 - i : i;
    if (k < c->nhead) return c->head[k];
    return k < c->nhead + c->full ? c->per_slot : c->rest;
}

/* The edge chunk's rows of a plan whose staged rows are `pitch` bytes (0: none). */
static int64_t edge_rows(const struct kvo_issuer *is, int64_t pitch) {
    if (is->c.edge_bytes <= 0) return 0;
    return is->c.edge_bytes / pitch > 0 ? is->c.edge_bytes / pitch : 1;
}

/* Whether plan `k` of `job` takes the job's edge chunk: the job is alone (the link idles until its
 * first DMA, or nothing waits behind its end) and the plan is a store's first or a load's last.
 * The other plans of a layered load keep whole slots (a chunk boundary costs the link about 3 us,
 * more than a layer's smaller last scatter saves), and so do jobs behind others: their gather or
 * scatter overlaps the jobs beside them anyway, and smaller chunks there left the link waiting on
 * the gathers beside a GEMM (docs/design.md §7). */
static int at_edge(const struct kvo_issuer *is, const struct kvo_job *job, int64_t k) {
    return job->alone && (is->c.store ? k == 0 : k == job->nplans - 1);
}

/* A plain event from the pool, recorded on `stream` (given back if the record fails). */
static CUresult take_recorded(struct kvo_issuer *is, CUstream stream, CUevent *out) {
    CUresult r = take_event(is, &is->plain, out);
    if (r) return r;
    r = record_on(is, *out, stream);
    if (r) {
        pthread_mutex_lock(&is->mu);
        pool_give(is, &is->plain, *out);
        pthread_mutex_unlock(&is->mu);
    }
    return r;
}

/* Make `waiter` wait for the work queued on `stream` so far (a stream wait captures the record it
 * was enqueued after, so the event goes back at once). */
static CUresult mark_wait(struct kvo_issuer *is, CUstream waiter, CUstream stream) {
    CUevent ev;
    CUresult r = take_recorded(is, stream, &ev);
    if (r) return r;
    r = wait_on(is, waiter, ev);
    pthread_mutex_lock(&is->mu);
    pool_give(is, &is->plain, ev);
    pthread_mutex_unlock(&is->mu);
    return r;
}

/* Room for n strided copies. */
static int reserve_strided(struct kvo_issuer *is, size_t n) {
    if (n <= is->strided_cap) return 1;
    size_t cap = is->strided_cap ? is->strided_cap : 64;
    while (cap < n) cap *= 2;
    struct memcpy_2d *grown = realloc(is->strided, cap * sizeof(*grown));
    if (!grown) return 0;
    is->strided = grown;
    is->strided_cap = cap;
    return 1;
}

/* Enqueue the strided copies built so far on `stream`. */
static CUresult issue_strided(struct kvo_issuer *is, size_t count, CUstream stream,
                              const char **call) {
    *call = "cuMemcpy2DAsync";
    for (size_t i = 0; i < count; i++) {
        give_way(is);
        CUresult r = ISSUE_CALL(is, CALL_COPY, ((fn_memcpy_2d)is->c.memcpy_2d)(&is->strided[i], stream));
        if (r) return r;
    }
    return 0;
}

/* Append the strided copy of `height` rows of `width` bytes between the host (first row at `host`,
 * rows `host_pitch` apart) and a slot (first row at `slot`, rows `slot_pitch` apart). */
static void append_strided(struct kvo_issuer *is, size_t *count, int store, uint64_t host,
                           int64_t host_pitch, uint64_t slot, int64_t slot_pitch, int64_t width,
                           int64_t height) {
    struct memcpy_2d *d = &is->strided[(*count)++];
    memset(d, 0, sizeof(*d));
    if (store) {
        d->src_type = MEMORYTYPE_DEVICE; d->src_device = slot; d->src_pitch = (size_t)slot_pitch;
        d->dst_type = MEMORYTYPE_HOST; d->dst_host = (void *)(uintptr_t)host; d->dst_pitch = (size_t)host_pitch;
    } else {
        d->src_type = MEMORYTYPE_HOST; d->src_host = (const void *)(uintptr_t)host; d->src_pitch = (size_t)host_pitch;
        d->dst_type = MEMORYTYPE_DEVICE; d->dst_device = slot; d->dst_pitch = (size_t)slot_pitch;
    }
    d->width = (size_t)width;
    d->height = (size_t)height;
}

/* The fewest rows worth one strided copy of rows `width` bytes wide (<= 0: none). A strided copy
 * costs the copy engine a few microseconds whatever its rows, a descriptor less the wider it is, so
 * the narrower the rows the fewer worth one: ceil(width / strided_row_bytes) rows, within
 * [STRIDED_FLOOR_ROWS, strided_min_rows] (the floor no higher than the ceiling); strided_min_rows
 * where strided_row_bytes is 0 or the width unknown (<= 0). */
static int64_t min_rows_at(const struct kvo_issuer *is, int64_t width) {
    int64_t top = is->c.strided_min_rows, unit = is->c.strided_row_bytes;
    if (top <= 0 || unit <= 0 || width <= 0) return top;
    int64_t rows = width / unit + (width % unit != 0); /* ceil, without overflow */
    int64_t floor = STRIDED_FLOOR_ROWS < top ? STRIDED_FLOOR_ROWS : top;
    return rows < floor ? floor : rows > top ? top : rows;
}

/* The fewest records that follow each other which plan `p`'s staged rows move as strided copies
 * (<= 0: none): min_rows_at a row's copies' mean width. */
static int64_t plan_min_rows(const struct kvo_issuer *is, const struct kvo_plan *p) {
    if (p->runs <= 0 || p->pitch <= 0) return is->c.strided_min_rows;
    return min_rows_at(is, p->pitch / p->runs);
}

/* The most rows one strided copy of plan `p` moves: as many as piece_bytes holds at a row's pitch
 * (no bound without piece_bytes); 0 where its rows go as descriptors: no cuMemcpy2DAsync, strided
 * copies off, a pitch the driver refuses, or plan_min_rows rows over piece_bytes (rows that wide
 * move at the link's pace as descriptors: 512 KiB spans took 1.05x a contiguous copy). */
static int64_t strided_rows(const struct kvo_issuer *is, const struct kvo_plan *p) {
    int64_t min_rows = plan_min_rows(is, p);
    if (!is->c.memcpy_2d || min_rows <= 0 || p->pitch <= 0 || p->host_stride > STRIDED_MAX_PITCH) return 0;
    if (is->c.piece_bytes <= 0) return INT64_MAX;
    int64_t rows = is->c.piece_bytes / p->pitch;
    return rows >= min_rows ? rows : 0;
}

/* Rows of a chunk from `k` on whose records follow each other in the host pool, within one pinned
 * area: the rows one strided copy per record run can move. */
static int64_t consecutive_rows(const struct kvo_plan *p, const struct kvo_job *job,
                                const int64_t *order, int64_t k, int64_t rows) {
    int64_t h = job->host_ids[order[k]], area = h / p->chunk_records, m = 1;
    while (k + m < rows && job->host_ids[order[k + m]] == h + m && (h + m) / p->chunk_records == area) m++;
    return m;
}

/* ---------------------------------------------------------------------------------- dma plans */

/* The end of the page group of plan `p` that starts at page `q`: pages that follow each other on
 * both sides (device pages back to back in one allocation at one block stride, their host bytes
 * back to back in the record), which a pair's copies merge into one; *width: the group's bytes. */
static int64_t page_group_end(const struct kvo_plan *p, int64_t q, int64_t *width) {
    int64_t end = q + 1;
    *width = p->nbytes[q];
    while (end < p->pages && p->segment[end] == p->segment[q] && p->dev_stride[end] == p->dev_stride[q] &&
           p->dev_base[end] == p->dev_base[end - 1] + p->nbytes[end - 1] &&
           p->host_offset[end] == p->host_offset[end - 1] + p->nbytes[end - 1]) {
        *width += p->nbytes[end];
        end++;
    }
    return end;
}

/* Pairs from `i` on whose host records and device blocks both follow each other, the records
 * within one pinned area (chunk_records of them): a run whose page groups can each move as one
 * strided copy (direct_rows). */
static int64_t direct_run(const struct kvo_plan *p, const struct kvo_job *job, int64_t i) {
    int64_t h = job->host_ids[i], d = job->dev_ids[i], area = h / p->chunk_records, m = 1;
    while (i + m < job->n && job->host_ids[i + m] == h + m && job->dev_ids[i + m] == d + m &&
           (h + m) / p->chunk_records == area)
        m++;
    return m;
}

/* The most rows (pairs) one direct strided copy of a page group `width` bytes wide moves, for a
 * run of `run` pairs of plan `p` from page `q` on; 0 where the run's group goes as descriptors:
 * no cuMemcpy2DAsync or strided copies off, a run shorter than min_rows_at the width, a group of
 * DIRECT_MAX_WIDTH or wider, pitches the driver refuses or rows that overlap, a group that is the
 * whole block on both sides (its descriptors merge into one copy per run already), or min_rows_at
 * rows over piece_bytes. */
static int64_t direct_rows(const struct kvo_issuer *is, const struct kvo_plan *p, int64_t q,
                           int64_t width, int64_t run) {
    int64_t min_rows = min_rows_at(is, width), pitch = p->dev_stride[q];
    if (!is->c.memcpy_2d || min_rows <= 0 || run < min_rows || width >= DIRECT_MAX_WIDTH) return 0;
    if (pitch < width || pitch > STRIDED_MAX_PITCH || p->host_stride < width ||
        p->host_stride > STRIDED_MAX_PITCH)
        return 0;
    if (p->merge && pitch == width && p->host_stride == width) return 0;
    if (is->c.piece_bytes <= 0) return run;
    int64_t rows = is->c.piece_bytes / width;
    return rows >= min_rows ? (rows < run ? rows : run) : 0;
}

/* The pairs from `i` on that dma_plan takes together: a run (direct_run) where cuMemcpy2DAsync is
 * there, else one pair. *grouped: the run is at least the fewest rows any page group's strided copy
 * takes (min_rows_at), so its groups are each judged by dma_span; else its pairs go one by one, a
 * descriptor per page. */
static int64_t dma_run(const struct kvo_issuer *is, const struct kvo_plan *p, const struct kvo_job *job,
                       int64_t i, int *grouped) {
    int64_t least = is->c.memcpy_2d ? min_rows_at(is, 1) : 0;
    int64_t m = least > 0 ? direct_run(p, job, i) : 1;
    *grouped = m >= least && m > 1;
    return m;
}

/* The pages from `q` on that a run of `run` pairs (`grouped`: dma_run's word) moves together: *end
 * and *width of its page group (every page left where the run is not grouped), and the rows of one
 * strided copy of it (direct_rows; 0: a descriptor per page and pair). */
static int64_t dma_span(const struct kvo_issuer *is, const struct kvo_plan *p, int64_t q, int64_t run,
                        int grouped, int64_t *end, int64_t *width) {
    if (!grouped) {
        *end = p->pages;
        return 0;
    }
    *end = page_group_end(p, q, width);
    return direct_rows(is, p, q, *width, run);
}

/* Every page of every pair, between device block dev[i] and host record host[i]. Pairs in runs
 * (direct_run) whose page groups direct_rows takes move as one cuMemcpy2DAsync per group and run
 * (in pieces of direct_rows rows): the host pitch is the record's, the device pitch the block
 * stride, with no staging slot and no SM. A layered load's layer of a per-layer layout moves as
 * descriptors a page each (a layer of 256 blocks of 32 KiB K and V pages: 512); from records and
 * into blocks that follow each other, as two strided copies (docs/design.md §16, *Direct strided
 * copies*). The other pages go as descriptors, merged where they continue each other; the strided
 * copies are enqueued after them, on the same stream. */
static CUresult dma_plan(struct kvo_issuer *is, const struct kvo_plan *p, const struct kvo_job *job,
                         CUstream stream, const char **call) {
    size_t total = (size_t)job->n * (size_t)p->pages, count = 0, nstrided = 0;
    int64_t last_area = -1, segments = 1;
    *call = "malloc";
    if (!reserve_descriptors(is, total)) return KVO_NO_MEMORY;
    for (int64_t q = 0; q < p->pages; q++) if (p->segment[q] + 1 > segments) segments = p->segment[q] + 1;
    int store = (int)is->c.store, grouped;
    for (int64_t i = 0, m = 1; i < job->n; i += m) {
        m = dma_run(is, p, job, i, &grouped);
        int64_t h = job->host_ids[i], d = job->dev_ids[i];
        uint64_t record = (uint64_t)p->host_base + (uint64_t)h * (uint64_t)p->host_stride;
        int64_t chunk = h / p->chunk_records;
        for (int64_t q = 0, end, width; q < p->pages; q = end) {
            int64_t rows = dma_span(is, p, q, m, grouped, &end, &width);
            if (rows > 0) {
                *call = "malloc";
                if (!reserve_strided(is, nstrided + (size_t)((m + rows - 1) / rows))) return KVO_NO_MEMORY;
                for (int64_t k = 0; k < m; k += rows) {
                    uint64_t host = record + (uint64_t)(k * p->host_stride) + (uint64_t)p->host_offset[q];
                    uint64_t dev = (uint64_t)(p->dev_base[q] + (d + k) * p->dev_stride[q]);
                    append_strided(is, &nstrided, store, host, p->host_stride, dev, p->dev_stride[q],
                                   width, m - k < rows ? m - k : rows);
                }
                continue;
            }
            for (int64_t k = 0; k < m; k++) {
                uint64_t row = record + (uint64_t)(k * p->host_stride);
                for (int64_t g = q; g < end; g++) {
                    uint64_t dev = (uint64_t)(p->dev_base[g] + (d + k) * p->dev_stride[g]);
                    uint64_t host = row + (uint64_t)p->host_offset[g];
                    int64_t area = chunk * segments + p->segment[g];
                    int ok = store ? append_copy(is, &count, &last_area, host, dev, (uint64_t)p->nbytes[g], area, (int)p->merge)
                                   : append_copy(is, &count, &last_area, dev, host, (uint64_t)p->nbytes[g], area, (int)p->merge);
                    if (!ok) { *call = "malloc"; return KVO_NO_MEMORY; }
                }
            }
        }
    }
    __atomic_fetch_add(&is->direct_copies, (int64_t)nstrided, __ATOMIC_RELAXED);
    CUresult r = issue_copies(is, count, stream, call);
    return r ? r : issue_strided(is, nstrided, stream, call);
}

/* One plan's pairs through the staging ring: chunks of as many rows as a slot holds (but those
 * growing from the job's edge chunk when the plan holds it, `edge_here`: staged_chunks), rotating
 * over the slots. Store: gather into the slot (kernel stream), then DMA to the host records (copy
 * stream). Load: DMA into the slot, then scatter. A slot is written only after the event recorded
 * after its previous read (docs/design.md §5 rule 5).
 *
 * A row holds the record's runs packed (`pitch` bytes). Rows of at least plan_min_rows records
 * that follow each other in the pool, where the rows are narrower than the records (a layer's span
 * of each record), go as one cuMemcpy2DAsync per run: the driver's cost of a batched descriptor
 * (about 0.45 µs for a 64 KiB span host -> device on the H200) and the copy engine's pace on many
 * small descriptors made a layer of 256 spans of 64 KiB take 1.36x a contiguous copy, of 8 KiB 12x;
 * one strided copy takes 1.00-1.06x (python -m tests.gpu.probe_strided_copy). The other rows go as
 * descriptors, merged where they continue each other. */
static CUresult staged_plan(struct kvo_issuer *is, const struct kvo_plan *p,
                            const struct kvo_job *job, const int64_t *order, int edge_here,
                            const char **call) {
    CUstream copy = is->c.copy_stream, kernel = is->c.kernel_stream;
    int store = (int)is->c.store;
    int64_t rows_per_slot = is->c.slot_bytes / p->pitch;
    *call = "staged";
    if (rows_per_slot <= 0) return KVO_RECORD_TOO_BIG;
    int64_t *dev = malloc((size_t)(rows_per_slot < job->n ? rows_per_slot : job->n) * sizeof(int64_t) + 8);
    *call = "malloc";
    if (!dev) return KVO_NO_MEMORY;
    CUresult r = 0;
    /* Strided copies only where rows are not already one descriptor (records back to back). */
    int contiguous = p->runs == 1 && p->run_size[0] == p->host_stride && p->pitch == p->host_stride;
    int64_t min_rows = plan_min_rows(is, p);
    int64_t piece_rows = strided_rows(is, p);
    int strided = piece_rows > 0 && !contiguous;
    struct chunks chunks;
    staged_chunks(&chunks, job->n, rows_per_slot, edge_here ? edge_rows(is, p->pitch) : 0, store);
    int64_t rows = 0;
    for (int64_t c = 0, start = 0; c < chunks.count && !r; c++, start += rows) {
        rows = chunk_rows(&chunks, c);
        int64_t slot = is->next_slot;
        is->next_slot = (is->next_slot + 1) % is->c.slots;
        uint64_t base = is->slot_bases[slot];
        size_t count = 0, nstrided = 0;
        int64_t last_area = -1;
        *call = "malloc";
        if (!reserve_descriptors(is, (size_t)(rows * p->runs)) ||
            (strided && !reserve_strided(is, (size_t)((rows / min_rows + 1) * p->runs)))) {
            r = KVO_NO_MEMORY;
            break;
        }
        for (int64_t k = 0; k < rows && !r;) {
            int64_t m = strided ? consecutive_rows(p, job, order + start, k, rows) : 1;
            if (strided && m > piece_rows) m = piece_rows; /* the rest of the run is the next copy */
            for (int64_t j = k; j < k + m; j++) dev[j] = job->dev_ids[order[start + j]];
            int64_t h = job->host_ids[order[start + k]];
            uint64_t record = (uint64_t)p->host_base + (uint64_t)h * (uint64_t)p->host_stride;
            uint64_t row = base + (uint64_t)(k * p->pitch);
            if (m >= min_rows && strided) {
                for (int64_t q = 0; q < p->runs; q++)
                    append_strided(is, &nstrided, store, record + (uint64_t)p->run_offset[q], p->host_stride,
                                   row + (uint64_t)(p->run_offset[q] - p->run_offset[0]), p->pitch,
                                   p->run_size[q], m);
                k += m;
                continue;
            }
            for (int64_t j = k; j < k + m && !r; j++, record += (uint64_t)p->host_stride, row += (uint64_t)p->pitch) {
                int64_t area = (h + (j - k)) / p->chunk_records;
                for (int64_t q = 0; q < p->runs && !r; q++) {
                    uint64_t host = record + (uint64_t)p->run_offset[q];
                    uint64_t in_slot = row + (uint64_t)(p->run_offset[q] - p->run_offset[0]);
                    int ok = store ? append_copy(is, &count, &last_area, host, in_slot, (uint64_t)p->run_size[q], area, 1)
                                   : append_copy(is, &count, &last_area, in_slot, host, (uint64_t)p->run_size[q], area, 1);
                    if (!ok) r = KVO_NO_MEMORY;
                }
            }
            k += m;
        }
        if (r) {
            *call = "malloc";
            break;
        }
        int reuse_wait = !(is->c.controls & CONTROL_SKIP_SLOT_WAIT);
        if (store) {
            *call = "cuStreamWaitEvent";
            if (reuse_wait && (r = chunk_wait(is, kernel, is->drained[slot]))) break;
            if ((r = launch_rows(is, p->cseg, p->cseg_rows, dev, 0, 1, rows, base, p->pitch, 1,
                                 is->c.staged_ctas, kernel, call))) break;
            *call = "cuEventRecord";
            if ((r = record_on(is, is->filled[slot], kernel))) break;
            *call = "cuStreamWaitEvent";
            if ((r = chunk_wait(is, copy, is->filled[slot]))) break;
            if ((r = issue_copies(is, count, copy, call))) break;
            if ((r = issue_strided(is, nstrided, copy, call))) break;
            *call = "cuEventRecord";
            if ((r = record_on(is, is->drained[slot], copy))) break;
        } else {
            *call = "cuStreamWaitEvent";
            if (reuse_wait && (r = chunk_wait(is, copy, is->drained[slot]))) break;
            if ((r = issue_copies(is, count, copy, call))) break;
            if ((r = issue_strided(is, nstrided, copy, call))) break;
            *call = "cuEventRecord";
            if ((r = record_on(is, is->filled[slot], copy))) break;
            *call = "cuStreamWaitEvent";
            if ((r = chunk_wait(is, kernel, is->filled[slot]))) break;
            if ((r = launch_rows(is, p->cseg, p->cseg_rows, dev, 0, 1, rows, base, p->pitch, 0,
                                 is->c.staged_ctas, kernel, call))) break;
            *call = "cuEventRecord";
            if ((r = record_on(is, is->drained[slot], kernel))) break;
        }
    }
    free(dev);
    return r;
}

/* ------------------------------------------------------------------------------------- issuing */

static CUstream own_stream(const struct kvo_issuer *is, int64_t path) {
    return path == PATH_DMA ? is->c.copy_stream : is->c.kernel_stream;
}

/* The stream a job of `path` ends on. */
static CUstream end_stream(const struct kvo_issuer *is, int64_t path) {
    if (path == PATH_STAGED) return is->c.store ? is->c.copy_stream : is->c.kernel_stream;
    return own_stream(is, path);
}

static CUresult record_mark(struct kvo_issuer *is, struct kvo_job *job, int64_t layer,
                            CUstream stream) {
    CUevent ev;
    CUresult r = take_recorded(is, stream, &ev);
    pthread_mutex_lock(&is->mu);
    if (!r) { job->marks[layer] = ev; job->marked = layer + 1; }
    pthread_cond_broadcast(&is->done);
    pthread_mutex_unlock(&is->mu);
    return r;
}

/* A job's issue, in three steps: issue_begin (its events, the fence's wait, the start's record),
 * issue_plans (its plans, layer after layer, each layered one marked) and issue_end (the end's
 * record). The thread runs them one after the other (issue_job); a caller that issues a layered
 * job's first layer (caller_issue) runs the first two for that layer and the thread the rest. On
 * return of the last, the job's `fail` says what happened: FAIL_NOTHING (nothing enqueued: it
 * completes at once), FAIL_PARTLY (part enqueued: its end follows it), or FAIL_NONE. */

/* 0 when the job's issue began; else the job failed with nothing enqueued (FAIL_NOTHING set). */
static int issue_begin(struct kvo_issuer *is, struct kvo_job *job) {
    const char *call = "cuEventRecord";
    CUresult r = 0;
    int64_t path = job->path;
    CUstream own = own_stream(is, path), other = path == PATH_DMA ? is->c.kernel_stream : is->c.copy_stream;
    int store = (int)is->c.store;
    if (is->ctx_error) { job->error = is->ctx_error; job->error_call = "cuCtxSetCurrent"; job->fail = FAIL_NOTHING; return 1; }
    r = take_event(is, &is->timing, &job->start);
    if (!r) r = take_event(is, &is->timing, &job->end);
    if (r) { job->error = r; job->error_call = "cuEventCreate"; job->fail = FAIL_NOTHING; return 1; }
    /* Jobs of one direction finish in submission order: a job on one stream first waits for the
     * other when the previous job ended there. */
    if (path != PATH_STAGED && other && is->last_end == other) {
        if ((r = mark_wait(is, own, other))) { job->error = r; job->error_call = "cuStreamWaitEvent"; job->fail = FAIL_NOTHING; return 1; }
    }
    /* The fence: rules 1 and 2 (the kernel or DMA reads/writes pages compute may still use). */
    CUstream fenced = path == PATH_DMA ? is->c.copy_stream : is->c.kernel_stream;
    CUstream started = (path == PATH_STAGED && !store) ? is->c.copy_stream : fenced;
    call = "cuStreamWaitEvent";
    r = wait_on(is, fenced, job->fence->event);
    if (!r) { call = "cuEventRecord"; r = record_on(is, job->start, started); }
    pthread_mutex_lock(&is->mu);
    fence_unref(is, job->fence); /* the wait was enqueued: it captured the record */
    job->fence = 0;
    pthread_mutex_unlock(&is->mu);
    if (r) { job->error = r; job->error_call = call; job->fail = FAIL_NOTHING; return 1; }
    is->last_end = path == PATH_STAGED ? end_stream(is, path) : own;
    job->begun = 1;
    return 0;
}

/* Enqueue the job's plans from job->next_plan up to `until`, a layered job's each marked as its last
 * copy is enqueued; 0, or the failed call's code with *call naming it. `order`: a staged job's
 * order (staged_order) when its issuer already has it, else 0. */
static CUresult issue_plans(struct kvo_issuer *is, struct kvo_job *job, int64_t until,
                            const int64_t *order, const char **call) {
    int64_t path = job->path;
    CUstream own = own_stream(is, path);
    int store = (int)is->c.store;
    CUresult r = 0;
    if (path == PATH_STAGED && !order) {
        order = staged_order(is, job);
        if (!order) { *call = "malloc"; return KVO_NO_MEMORY; }
    }
    for (; job->next_plan < until && !r; job->next_plan++) {
        const struct kvo_plan *p = job->plans[job->next_plan];
        if (path == PATH_DMA) r = dma_plan(is, p, job, own, call);
        else if (path == PATH_SM)
            r = launch_rows(is, p->kseg, p->kseg_rows, job->dev_ids, job->host_ids, 0, job->n,
                            (uint64_t)p->host_base, p->host_stride, store, is->c.sm_ctas, own, call);
        else r = staged_plan(is, p, job, order, at_edge(is, job, job->next_plan), call);
        if (!r && job->layered) {
            CUstream at = path == PATH_DMA ? own : is->c.kernel_stream;
            if ((r = record_mark(is, job, job->first + job->next_plan, at))) *call = "cuEventRecord";
        }
    }
    return r;
}

/* Record the job's end after what was enqueued (`issue_error`: the plans' failure, named by
 * `issue_call`, or 0). */
static void issue_end(struct kvo_issuer *is, struct kvo_job *job, CUresult issue_error,
                      const char *issue_call) {
    int64_t path = job->path;
    CUstream stream_end = end_stream(is, path);
    /* The staged path's end stream waits for its other stream: a load's kernel stream for its DMA
     * (no DMA of a failed chunk after the end), a failed store's copy stream for its kernel stream
     * (no gather of a failed chunk, which reads the job's device blocks, after the end; a store
     * that issued every chunk ends after its last gather through its last DMA). Where that wait
     * cannot be made the end is still recorded, and the job fails: a load's end follows every
     * scatter, so no device block is written after it (a failed chunk's DMA may still fill its
     * staging slot, which the next DMA into that slot follows on the same stream); a store's
     * gather left running only fills a slot that its next gather follows on the same stream. */
    CUresult wait_error = 0;
    if (path == PATH_STAGED && (!is->c.store || issue_error))
        wait_error = is->c.store ? mark_wait(is, is->c.copy_stream, is->c.kernel_stream)
                                 : mark_wait(is, is->c.kernel_stream, is->c.copy_stream);
    if (wait_error && !issue_error) { issue_error = wait_error; issue_call = "cuStreamWaitEvent"; }
    CUresult end_error = record_on(is, job->end, stream_end);
    if (end_error) {
        /* Once more, with another event: the job's copies may be in flight, and only a recorded
         * end tells when they are done (rule 5: a failed job ends only once none of its copies
         * touches its buffers). The job fails either way. */
        CUevent fresh;
        if (!take_event(is, &is->timing, &fresh)) {
            if (!record_on(is, fresh, stream_end)) {
                ((fn_event_destroy)is->c.event_destroy)(job->end);
                job->end = fresh;
                if (!issue_error) { issue_error = end_error; issue_call = "cuEventRecord"; }
                end_error = 0;
            } else {
                pthread_mutex_lock(&is->mu);
                pool_give(is, &is->timing, fresh);
                pthread_mutex_unlock(&is->mu);
            }
        }
    }
    if (end_error && !issue_error) { issue_error = end_error; issue_call = "cuEventRecord"; }
    if (issue_error) { job->error = issue_error; job->error_call = issue_call; }
    /* The end refused twice: taken as the context's failure, after which none of its work runs.
     * Nothing to wait for: done at once. */
    if (end_error) { job->fail = FAIL_NOTHING; return; }
    job->fail = issue_error ? FAIL_PARTLY : FAIL_NONE;
    if (job->layered && issue_error) { /* the layers left unmarked follow what was enqueued */
        pthread_mutex_lock(&is->mu); /* and did not land: kvo_wait_layer says so from here on */
        job->failed_from = job->marked;
        pthread_cond_broadcast(&is->done);
        pthread_mutex_unlock(&is->mu);
        for (int64_t l = job->marked; l < job->first + job->nplans; l++)
            if (record_mark(is, job, l, stream_end)) break;
    }
}

/* Issue one job, or the rest of one whose caller issued its first layer. */
static void issue_job(struct kvo_issuer *is, struct kvo_job *job) {
    if (!job->begun && issue_begin(is, job)) return;
    const char *call = "";
    CUresult r = issue_plans(is, job, job->nplans, 0, &call);
    issue_end(is, job, r, call);
}

/* ----------------------------------------------------------------------------------- the thread */

static void finish(struct kvo_issuer *is, struct kvo_job *job) { /* caller holds the mutex */
    job->times[3] = now_ns();
    __atomic_store_n(&job->state, JOB_DONE, __ATOMIC_RELEASE); /* read without the lock by a spin */
    if (job->layered) job->marked = job->first + job->nplans;
    pthread_cond_broadcast(&is->done);
    job_unref(job); /* the thread's reference */
}

static void predict_end(struct kvo_issuer *is, struct kvo_job *job);
static void rebase_flight(struct kvo_issuer *is, int64_t now);
static void learn_rate(struct kvo_issuer *is, const struct kvo_job *job, float ms);

/* Query the end event of the flight's head `job` (the caller, the thread or its waiter, holds
 * `querying`, not the mutex): the query's answer, and *ms the job's device time once complete (0
 * otherwise, and for a job whose issue failed part-way). */
static CUresult query_end(struct kvo_issuer *is, const struct kvo_job *job, float *ms) {
    CUresult q = ((fn_event_query)is->c.event_query)(job->end);
    *ms = 0.0f;
    if (q == 0 && job->fail == FAIL_NONE && is->c.event_elapsed &&
        ((fn_event_elapsed)is->c.event_elapsed)(ms, job->start, job->end))
        *ms = 0.0f;
    return q;
}

/* The flight's head `job` was found complete (by the thread or its waiter) after `ms` of device
 * time, or its query failed with `q`: it leaves the flight and is done. Caller holds the mutex. */
static void found(struct kvo_issuer *is, struct kvo_job *job, CUresult q, float ms) {
    if (q != 0) { job->error = q; job->error_call = "cuEventQuery"; job->fail = FAIL_COMPLETION; }
    __atomic_store_n(&is->flight_head, job->next, __ATOMIC_RELEASE); /* a waiter looks without mu */
    if (!is->flight_head) is->flight_tail = 0;
    job->seconds = ms / 1e3;
    learn_rate(is, job, ms);
    rebase_flight(is, now_ns());
    finish(is, job); /* broadcasts: the waiters of the jobs re-predicted look again */
}

/* A job was issued (by the thread, or by its caller): its fence goes, and it is done at once (nothing
 * enqueued) or put in flight for the thread (or a waiter spinning for it) to poll. Caller holds the
 * mutex. 1 when in flight. */
static int issued(struct kvo_issuer *is, struct kvo_job *job) {
    if (job->fence) { fence_unref(is, job->fence); job->fence = 0; }
    if (job->layered && job->marked < job->first + job->nplans && job->fail == FAIL_NOTHING)
        job->marked = job->first + job->nplans; /* nothing to wait for */
    if (job->fail == FAIL_NOTHING) { finish(is, job); return 0; }
    __atomic_store_n(&job->state, JOB_ISSUED, __ATOMIC_RELEASE); /* read by a spinning waiter */
    job->polled_ns = now_ns();
    predict_end(is, job);
    if (is->flight_tail) is->flight_tail->next = job;
    else __atomic_store_n(&is->flight_head, job, __ATOMIC_RELEASE); /* a waiter looks without mu */
    is->flight_tail = job;
    pthread_cond_broadcast(&is->done);
    return 1;
}

/* Predict when a job just put in flight ends (the thread, holding the mutex): from when its issue
 * began (its first copies run while the rest is enqueued) or the predicted end of the jobs in
 * flight before it, whichever is later, at the fastest device time per byte a completed job of this
 * issuer had. The thread polls the job without sleeps around that time (end_lead_ns either side):
 * a poll that sleeps poll_max_ns between queries (plus its wake-up) finds a long job's end tens of
 * microseconds late. Erring early costs some polls; erring late finds the end as the sleeps do.
 * A job predicted to run less than 8 * poll_max_ns gets no prediction: its polls never sleep that
 * long (an eighth of its age), and a thread polling without sleeps beside a short job slowed the
 * caller's own code around it (docs/design.md §16). */
static void predict_end(struct kvo_issuer *is, struct kvo_job *job) {
    job->expected_end = 0;
    job->runs = 0;
    if (is->c.end_lead_ns <= 0 || is->fastest_ns_per_byte == 0.0 || job->bytes <= 0) return;
    double predicted = (double)job->bytes * is->fastest_ns_per_byte;
    if (!(predicted < 1e15)) return; /* over 11 days: nothing to predict */
    int64_t runs = (int64_t)predicted;
    int64_t began = job->times[1];
    int64_t start = is->flight_head && is->last_expected_end > began ? is->last_expected_end : began;
    job->runs = runs;
    is->last_expected_end = start + runs;
    if (runs / 8 >= is->c.poll_max_ns) job->expected_end = start + runs; /* (no 8 * poll_max_ns: it may overflow) */
}

/* The flight's head was found done at `now` (caller holds the mutex): the jobs still in flight are
 * predicted again from then, one after the other (each from its issue's start at the earliest). A
 * chain of predictions made as the jobs were put in flight drifts early by the fastest rate's error
 * on every job ahead: a waiter deep in the flight would wake, and spin, that much before its job's
 * end. */
static void rebase_flight(struct kvo_issuer *is, int64_t now) {
    int64_t start = now;
    for (struct kvo_job *j = is->flight_head; j; j = j->next) {
        if (j->runs <= 0) continue; /* nothing predicted (no rate yet, or nothing to copy) */
        if (j->times[1] > start) start = j->times[1];
        int64_t end = start + j->runs;
        if (j->expected_end) j->expected_end = end;
        start = end;
    }
    is->last_expected_end = start;
}

/* A job completed in `ms` of device time: the fastest rate so far predicts the next jobs' ends. Only
 * jobs of at least 8 * poll_max_ns teach it (the jobs that are predicted): a short job's device time
 * is mostly its launch, and one too fast a reading would move every later window early. */
static void learn_rate(struct kvo_issuer *is, const struct kvo_job *job, float ms) {
    if (ms <= 0.0f || (double)ms * 1e6 < 8.0 * (double)is->c.poll_max_ns || job->bytes <= 0 ||
        job->fail != FAIL_NONE)
        return;
    double rate = (double)ms * 1e6 / (double)job->bytes;
    if (is->fastest_ns_per_byte == 0.0 || rate < is->fastest_ns_per_byte) is->fastest_ns_per_byte = rate;
}

/* Out of work, the thread (holding mu) looks for a hand-off without the lock for up to the config's
 * idle_spin_ns, or until the end of a spin kvo_issuer_expect announced, before it blocks: a job
 * handed over meanwhile starts without a wake-up (which costs microseconds on the caller's side and
 * the thread's), and its hand-off signals nothing. 1 when a job or the stop came (mu held again
 * either way). The hand-off signals only a thread that `sleeping` says is blocked, and the thread
 * sets it under mu after it looked at the queue there, so no hand-off is missed. */
static int idle_spin(struct kvo_issuer *is) {
    int64_t now = now_ns(), until = is->c.idle_spin_ns > 0 ? now + is->c.idle_spin_ns : 0;
    if (is->expect_until > until) until = is->expect_until;
    is->expect_until = 0;
    if (until <= now) return 0;
    pthread_mutex_unlock(&is->mu);
    while (!__atomic_load_n(&is->queue_head, __ATOMIC_ACQUIRE) && !__atomic_load_n(&is->stop, __ATOMIC_ACQUIRE)
           && now_ns() < until) {
        for (int i = 0; i < 8; i++) cpu_relax();
        give_cpu(is, &is->caller_cpu, &is->spin_yields); /* the caller's hand-off, on this CPU, can come */
    }
    pthread_mutex_lock(&is->mu);
    return is->queue_head || is->stop;
}

/* The thread (holding mu) blocks for up to `ns`, or until a hand-off, the stop or a caller's
 * issue signals it (`sleeping` tells them to). */
static void nap(struct kvo_issuer *is, int64_t ns) {
    struct timespec until;
    deadline_after(&until, ns);
    is->sleeping = 1;
    pthread_cond_timedwait(&is->work, &is->mu, &until);
    is->sleeping = 0;
}

static void *run(void *arg) {
    struct kvo_issuer *is = arg;
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* short polling sleeps wake on time */
    /* The context and the slots' events are made before the thread takes the mutex (driver calls:
     * kvo_issuer_new's start wait, which holds it, keeps its deadline; no one else has the issuer). */
    CUresult made = ((fn_ctx_set)is->c.ctx_set_current)(is->c.context);
    for (int64_t s = 0; s < is->c.slots && !made; s++) {
        made = create_event(is, &is->plain, &is->filled[s]);
        if (!made) made = create_event(is, &is->plain, &is->drained[s]);
    }
    pthread_mutex_lock(&is->mu);
    if (is->orphaned) { /* its creator gave up on the start and returned: nobody else has the issuer */
        pthread_mutex_unlock(&is->mu);
        for (int64_t s = 0; s < is->c.slots; s++) {
            if (is->filled[s]) ((fn_event_destroy)is->c.event_destroy)(is->filled[s]);
            if (is->drained[s]) ((fn_event_destroy)is->c.event_destroy)(is->drained[s]);
        }
        pthread_mutex_lock(&is->mu);
        issuer_unref(is); /* the creator's reference, handed over: frees and unlocks */
        return 0;
    }
    is->ctx_error = made;
    is->started = 1;
    pthread_cond_broadcast(&is->done);
    int64_t sleep_ns = is->c.poll_min_ns;
    int64_t idle_since = 0; /* when the thread last ran out of work (0: it has work) */
    for (;;) {
        seen_on_cpu(is, &is->thread_cpu); /* woken, or back from work: where a waiter looks */
        if (is->issuing) { /* a caller issues a job: nothing else is issued meanwhile */
            is->sleeping = 1;
            pthread_cond_wait(&is->work, &is->mu);
            is->sleeping = 0;
            continue;
        }
        if (is->queue_head || is->flight_head) idle_since = 0;
        if (is->queue_head) {
            struct kvo_job *job = is->queue_head;
            is->expect_until = 0; /* the job an early wake announced came (or another did) */
            is->queue_head = job->next;
            if (!is->queue_head) is->queue_tail = 0;
            job->next = 0;
            if (!job->begun) job->alone = !is->queue_head && !is->flight_head;
            if (is->stop && !job->begun) { /* a job its caller began is issued: its work is enqueued */
                job->error = KVO_RELEASED; job->error_call = "release"; job->fail = FAIL_NOTHING;
                if (job->fence) { fence_unref(is, job->fence); job->fence = 0; }
                finish(is, job);
                continue;
            }
            is->thread_issues = 1;
            pthread_mutex_unlock(&is->mu);
            yield_to_caller(is, job);
            if (!job->begun) __atomic_store_n(&job->times[1], now_ns(), __ATOMIC_RELAXED); /* kvo_job_times may read */
            issue_job(is, job);
            __atomic_store_n(&job->times[2], now_ns(), __ATOMIC_RELAXED);
            pthread_mutex_lock(&is->mu);
            is->thread_issues = 0;
            if (issued(is, job)) sleep_ns = is->c.poll_min_ns;
            continue;
        }
        if (is->flight_head) {
            struct kvo_job *job = is->flight_head;
            if (is->stop) { /* the owner gave up on it: wake its waiters */
                __atomic_store_n(&is->flight_head, job->next, __ATOMIC_RELEASE);
                if (!is->flight_head) is->flight_tail = 0;
                job->error = KVO_ABANDONED; job->error_call = "release"; job->fail = FAIL_COMPLETION;
                finish(is, job);
                continue;
            }
            if (is->querying) { /* its waiter queries it (waiter_query): the thread polls later */
                nap(is, sleep_ns);
                continue;
            }
            is->querying = 1; /* no waiter queries or finishes the job meanwhile (waiter_query) */
            pthread_mutex_unlock(&is->mu);
            give_way(is);
            float ms;
            int64_t began = issue_call_begin(is, CALL_QUERY);
            CUresult q = query_end(is, job, &ms);
            issue_call_end(is, CALL_QUERY, began);
            pthread_mutex_lock(&is->mu);
            is->querying = 0;
            if (q == KVO_NOT_READY) {
                int64_t now = now_ns(), end = job->expected_end, lead = is->c.end_lead_ns;
                if (end && now >= end - lead && now < end + lead) { /* near its end: poll again soon */
                    pthread_mutex_unlock(&is->mu);
                    for (int i = 0; i < 16; i++) cpu_relax();
                    pthread_mutex_lock(&is->mu);
                    continue;
                }
                if (is->queue_head || is->stop) continue; /* came during the query: it woke no one */
                int64_t until_lead = end && now < end - lead && end - lead - now < sleep_ns ? end - lead - now : sleep_ns;
                int64_t polled = job->polled_ns; /* a waiter may find the job done (and free it) meanwhile */
                nap(is, until_lead);
                /* sleep about an eighth of the time in flight so far, within the bounds */
                int64_t age = (now_ns() - polled) / 8;
                sleep_ns = age < is->c.poll_min_ns ? is->c.poll_min_ns
                         : age > is->c.poll_max_ns ? is->c.poll_max_ns : age;
                continue;
            }
            found(is, job, q, ms);
            sleep_ns = is->c.poll_min_ns;
            continue;
        }
        if (is->stop) break;
        if (idle_spin(is)) continue;
        int64_t now = now_ns();
        if (!idle_since) idle_since = now;
        if (is->c.idle_nap_ns > 0 && now - idle_since < is->c.idle_light_ns) {
            /* a short timed sleep: the core is not let into a deep idle state, whose wake-up took
             * 20-45 us on the H200 hosts after a millisecond idle (5 us after tens of us) */
            nap(is, is->c.idle_nap_ns);
            is->naps++;
        } else {
            is->sleeping = 1;
            pthread_cond_wait(&is->work, &is->mu);
            is->sleeping = 0;
        }
    }
    for (int64_t s = 0; s < is->c.slots; s++) {
        pool_give(is, &is->plain, is->filled[s]);
        pool_give(is, &is->plain, is->drained[s]);
    }
    /* The pools close (no event is taken from or given back to them from here on) and their events
     * are destroyed without the mutex: a driver call that does not return then holds no stop or
     * waiter past its deadline (the stop times out waiting for `exited`, set after it). */
    is->pools_closed = 1;
    struct pool plain = is->plain, timing = is->timing;
    pthread_mutex_unlock(&is->mu);
    pool_destroy(is, &plain);
    pool_destroy(is, &timing);
    pthread_mutex_lock(&is->mu);
    is->plain.count = is->timing.count = 0;
    is->exited = 1;
    pthread_cond_broadcast(&is->done);
    pthread_mutex_unlock(&is->mu);
    return 0;
}

/* ----------------------------------------------------------------------------------- the API */

/* A new issuer with its thread started, or NULL (no memory, no thread, or a thread that did not start
 * within start_timeout_ns: *error says which; that thread frees the issuer when its driver call
 * returns, and the caller keeps whatever `config` points into until the process ends). */
struct kvo_issuer *kvo_issuer_new(const struct kvo_config *config, int64_t *error) {
    struct kvo_issuer *is = calloc(1, sizeof(*is));
    *error = KVO_NO_MEMORY;
    if (!is) return 0;
    is->c = *config;
    if (is->c.nfunctions > MAX_FUNCTIONS) is->c.nfunctions = MAX_FUNCTIONS;
    int64_t slots = is->c.slots > 0 ? is->c.slots : 0;
    is->slot_bases = calloc((size_t)slots + 1, sizeof(uint64_t));
    is->filled = calloc((size_t)slots + 1, sizeof(CUevent));
    is->drained = calloc((size_t)slots + 1, sizeof(CUevent));
    if (!is->slot_bases || !is->filled || !is->drained) {
        free(is->slot_bases); free(is->filled); free(is->drained); free(is);
        return 0;
    }
    for (int64_t s = 0; s < slots; s++) is->slot_bases[s] = config->slot_bases[s];
    is->c.slot_bases = is->slot_bases;
    is->timing.flags = 0;
    is->plain.flags = 2; /* CU_EVENT_DISABLE_TIMING */
    is->refs = 1;
    struct launch_params *p = &is->params;
    for (int i = 0; i < 5; i++) p->pointers[i] = &p->scalars[i];
    p->pointers[5] = &p->to_host;
    p->pointers[6] = &p->ids;
    is->thread_cpu = is->caller_cpu = -1;
    pthread_mutex_init(&is->mu, 0);
    cond_init(&is->work);
    cond_init(&is->done);
    int rc = pthread_create(&is->thread, 0, run, is);
    if (rc) {
        *error = rc;
        free(is->slot_bases); free(is->filled); free(is->drained); free(is);
        return 0;
    }
    struct timespec until;
    deadline_after(&until, is->c.start_timeout_ns);
    pthread_mutex_lock(&is->mu);
    while (!is->started)
        if (pthread_cond_timedwait(&is->done, &is->mu, &until) == ETIMEDOUT) break;
    if (!is->started) { /* still inside a driver call: the thread frees the issuer when it returns */
        is->orphaned = 1;
        pthread_detach(is->thread);
        pthread_mutex_unlock(&is->mu);
        *error = KVO_TIMEOUT;
        return 0;
    }
    *error = is->ctx_error;
    pthread_mutex_unlock(&is->mu);
    return is;
}

static void issuer_unref(struct kvo_issuer *is) { /* caller holds the mutex */
    if (--is->refs > 0) return;
    pthread_mutex_unlock(&is->mu);
    pthread_mutex_destroy(&is->mu);
    pthread_cond_destroy(&is->work);
    pthread_cond_destroy(&is->done);
    free(is->timing.free); free(is->plain.free);
    free(is->slot_bases); free(is->filled); free(is->drained);
    free(is->d_dst); free(is->d_src); free(is->d_size); free(is->strided); free(is->order); free(is->radix);
    free(is);
}

/* Stop the thread: jobs not yet issued fail, jobs in flight are given up; join it within
 * timeout_ns. 0: joined (the streams, ring and tables may go); 1: the thread is still in a driver
 * call (leave them to the process). Called again after a 1 (timeout 0: a look that never waits),
 * it joins the thread once it left its loop; after a 0 it returns 0 and joins nothing. */
int64_t kvo_issuer_stop(struct kvo_issuer *is, int64_t timeout_ns) {
    pthread_mutex_lock(&is->mu);
    __atomic_store_n(&is->stop, 1, __ATOMIC_RELEASE); /* read without the lock by an idle spin */
    pthread_cond_broadcast(&is->work);
    struct timespec until;
    deadline_after(&until, timeout_ns);
    while (!is->exited)
        if (pthread_cond_timedwait(&is->done, &is->mu, &until) == ETIMEDOUT) break;
    int64_t exited = is->exited, join = exited && !is->joined;
    if (join) is->joined = 1;
    pthread_mutex_unlock(&is->mu);
    if (!exited) return 1;
    if (join) pthread_join(is->thread, 0); /* it has left its loop: returns at once */
    return 0;
}

static void book_clear(struct kvo_issuer *is); /* caller holds the mutex */

/* The owner lets go (after kvo_issuer_stop returned 0); the memory goes with the last job. */
void kvo_issuer_free(struct kvo_issuer *is) {
    pthread_mutex_lock(&is->mu);
    book_clear(is); /* results never taken: the owner lets go of them too */
    int64_t last = is->refs == 1;
    issuer_unref(is); /* unlocks when it frees */
    if (!last) pthread_mutex_unlock(&is->mu);
}

struct kvo_plan *kvo_plan_new(const struct kvo_plan_spec *s) {
    struct kvo_plan *p = calloc(1, sizeof(*p));
    if (!p) return 0;
    p->pages = s->pages;
    p->dev_base = copy_i64(s->dev_base, s->pages);
    p->dev_stride = copy_i64(s->dev_stride, s->pages);
    p->nbytes = copy_i64(s->nbytes, s->pages);
    p->host_offset = copy_i64(s->host_offset, s->pages);
    p->segment = copy_i64(s->segment, s->pages);
    p->run_offset = copy_i64(s->run_offset, s->runs);
    p->run_size = copy_i64(s->run_size, s->runs);
    p->record_bytes = s->record_bytes; p->host_base = s->host_base; p->host_stride = s->host_stride;
    p->chunk_records = s->chunk_records > 0 ? s->chunk_records : 1; p->merge = s->merge;
    p->kseg = s->kseg; p->kseg_rows = s->kseg_rows; p->cseg = s->cseg; p->cseg_rows = s->cseg_rows;
    p->pitch = s->pitch; p->runs = s->runs;
    for (int64_t q = 0; q < s->pages && p->nbytes; q++) p->bytes += p->nbytes[q];
    if (!p->dev_base || !p->dev_stride || !p->nbytes || !p->host_offset || !p->segment ||
        !p->run_offset || !p->run_size) {
        free(p->dev_base); free(p->dev_stride); free(p->nbytes); free(p->host_offset);
        free(p->segment); free(p->run_offset); free(p->run_size); free(p);
        return 0;
    }
    return p;
}

/* Free a plan no job in the issuer's queue uses any more (after kvo_issuer_stop). */
void kvo_plan_free(struct kvo_plan *p) {
    if (!p) return;
    free(p->dev_base); free(p->dev_stride); free(p->nbytes); free(p->host_offset);
    free(p->segment); free(p->run_offset); free(p->run_size); free(p);
}

/* A fence: an event recorded on `stream` now (the caller's thread). NULL with *error set. */
struct kvo_fence *kvo_fence_take(struct kvo_issuer *is, void *stream, int64_t *error) {
    struct kvo_fence *fence = calloc(1, sizeof(*fence));
    *error = KVO_NO_MEMORY;
    if (!fence) return 0;
    CUresult r = take_event(is, &is->plain, &fence->event); /* KVO_RELEASED once the thread exits */
    if (!r) {
        caller_call(is, 1);
        r = CALLER_CALL(is, ((fn_event_record)is->c.event_record)(fence->event, stream));
        if (context_restored(is, r)) r = ((fn_event_record)is->c.event_record)(fence->event, stream);
        __atomic_store_n(&is->coming_until, 0, __ATOMIC_RELEASE); /* the announced caller came */
        __atomic_store_n(&is->coming_lapsed, 0, __ATOMIC_RELEASE); /* announcements count again */
        caller_call(is, -1);
        if (r) { pthread_mutex_lock(&is->mu); pool_give(is, &is->plain, fence->event); pthread_mutex_unlock(&is->mu); }
    }
    *error = r;
    if (r) { free(fence); return 0; }
    fence->refs = 1;
    return fence;
}

/* The taker's reference goes; the event returns once no job still has to wait for it. */
void kvo_fence_release(struct kvo_issuer *is, struct kvo_fence *fence) {
    pthread_mutex_lock(&is->mu);
    fence_unref(is, fence);
    pthread_mutex_unlock(&is->mu);
}

/* Whether dma_plan moves plan `p` of `job` in at most CALLER_LAYER_STRIDED strided copies and
 * CALLER_LAYER_COPIES descriptors (before merges, each page's pieces counted): the same runs and
 * spans (dma_run, dma_span), counted with an early end. */
static int dma_is_cheap(const struct kvo_issuer *is, const struct kvo_plan *p, const struct kvo_job *job) {
    int64_t copies = 0, strided = 0, piece = is->c.piece_bytes;
    int grouped;
    for (int64_t i = 0, m = 1; i < job->n; i += m) {
        m = dma_run(is, p, job, i, &grouped);
        for (int64_t q = 0, end, width; q < p->pages; q = end) {
            int64_t rows = dma_span(is, p, q, m, grouped, &end, &width);
            if (rows > 0) {
                strided += (m + rows - 1) / rows;
                continue;
            }
            for (int64_t g = q; g < end; g++) /* a page's pieces (append_copy) */
                copies += m * (piece > 0 ? p->nbytes[g] / piece + (p->nbytes[g] % piece != 0) : 1);
        }
        if (copies > CALLER_LAYER_COPIES || strided > CALLER_LAYER_STRIDED) return 0;
    }
    return 1;
}

/* Whether a layered job's first layer costs its caller few driver calls: one kernel launch (sm),
 * staged chunks (at most CALLER_LAYER_CHUNKS) whose rows go as strided copies but for at most
 * CALLER_LAYER_COPIES descriptors, or a dma layer of direct strided copies as few (dma_is_cheap). A
 * layer of batched descriptors (dma, or records that do not follow each other) would hold the
 * caller for hundreds of microseconds. Caller holds the mutex,
 * the thread is out of work (so the issuer's order buffer is free); a staged job's order, computed
 * here, goes to *order for the issue. */
static int first_layer_is_cheap(struct kvo_issuer *is, struct kvo_job *job, const int64_t **order_out) {
    const struct kvo_plan *p = job->plans[0];
    if (job->path == PATH_SM) return job->n <= MAX_ROWS;
    if (job->path == PATH_DMA) return dma_is_cheap(is, p, job);
    int64_t piece_rows = strided_rows(is, p), min_rows = plan_min_rows(is, p);
    if (job->path != PATH_STAGED || piece_rows <= 0) return 0;
    int64_t rows_per_slot = is->c.slot_bytes / p->pitch;
    if (rows_per_slot <= 0) return 0;
    struct chunks chunks;
    staged_chunks(&chunks, job->n, rows_per_slot, at_edge(is, job, 0) ? edge_rows(is, p->pitch) : 0,
                  (int)is->c.store);
    if (chunks.count > CALLER_LAYER_CHUNKS) return 0;
    const int64_t *order = staged_order(is, job);
    if (!order) return 0;
    *order_out = order;
    int64_t copies = 0, strided = 0, rows = 0;
    for (int64_t c = 0, start = 0; c < chunks.count; c++, start += rows) {
        rows = chunk_rows(&chunks, c);
        for (int64_t k = 0; k < rows;) {
            int64_t m = consecutive_rows(p, job, order + start, k, rows);
            if (m > piece_rows) m = piece_rows; /* as staged_plan cuts a run */
            if (m < min_rows) copies += m * p->runs;
            else strided += p->runs;
            k += m;
        }
    }
    /* A strided copy per run of records (more where pieces cut a run): host records in many short
     * runs make many calls, each a few microseconds of the caller's. */
    return copies <= CALLER_LAYER_COPIES && strided <= CALLER_LAYER_STRIDED;
}

/* Put `job` at the head of the issue queue (caller holds the mutex): a job its caller was to issue,
 * which goes before any job handed over meanwhile. */
static void queue_first(struct kvo_issuer *is, struct kvo_job *job) {
    job->next = is->queue_head;
    __atomic_store_n(&is->queue_head, job, __ATOMIC_RELEASE);
    if (!is->queue_tail) is->queue_tail = job;
}

/* The caller's thread issues a small job handed to a thread that is out of work and blocked (its
 * wake-up, 5-45 us on the H200 hosts, would come before the job's first copy), or the first layer of
 * a layered job when that layer is cheap to issue (first_layer_is_cheap): under the mutex, with
 * nothing queued or in flight, `issuing` keeps the thread from issuing, and the job (or its first
 * layer) is issued here with the mutex released, the issuer's context made current for the calls
 * (and the caller's put back). A job issued whole is then put in flight for the thread, which is
 * woken to poll it; a layered job's rest is queued first for the thread, which issues it from its
 * second layer on (the caller's layer is marked: a wait for it needs no thread). Jobs stay issued
 * one at a time in hand-off order: a hand-off meanwhile queues behind it. 1 when the caller issued
 * (the mutex released), 0 (the mutex held) when the thread is to issue all of it. */
static int caller_issue(struct kvo_issuer *is, struct kvo_job *job) {
    if (is->c.caller_issue_max <= 0 || !is->c.ctx_get_current || !is->started ||
        is->ctx_error || !is->sleeping || is->queue_head || is->flight_head || is->issuing)
        return 0; /* off, or the thread is not idle: nothing counted under the lock */
    int64_t until = job->nplans;
    const int64_t *order = 0; /* a staged layered job's, from first_layer_is_cheap */
    job->alone = 1; /* nothing queued or in flight, by the conditions above */
    if (job->layered) {
        if (job->nplans < 1 || !first_layer_is_cheap(is, job, &order)) return 0;
        until = 1;
    } else {
        int64_t pages = 0;
        for (int64_t k = 0; k < job->nplans && pages <= is->c.caller_issue_max; k++)
            pages += job->n * job->plans[k]->pages;
        if (pages > is->c.caller_issue_max) return 0;
    }
    is->issuing = 1;
    pthread_mutex_unlock(&is->mu);
    void *saved = 0;
    CUresult r = ((fn_ctx_get)is->c.ctx_get_current)(&saved);
    int switched = !r && saved != is->c.context;
    if (switched) r = ((fn_ctx_set)is->c.ctx_set_current)(is->c.context);
    if (r) { /* the calls could not run in the issuer's context: the thread issues the job */
        pthread_mutex_lock(&is->mu);
        queue_first(is, job); /* it was handed over before any job queued meanwhile */
        is->issuing = 0;
        pthread_cond_broadcast(&is->work);
        pthread_mutex_unlock(&is->mu);
        return 1;
    }
    __atomic_store_n(&job->times[1], now_ns(), __ATOMIC_RELAXED);
    int whole = 1; /* issued to its end here (or failed) */
    if (!issue_begin(is, job)) {
        const char *call = "";
        CUresult failed = issue_plans(is, job, until, order, &call);
        if (failed || job->next_plan >= job->nplans) issue_end(is, job, failed, call);
        else whole = 0;
    }
    if (whole) __atomic_store_n(&job->times[2], now_ns(), __ATOMIC_RELAXED);
    if (switched) ((fn_ctx_set)is->c.ctx_set_current)(saved);
    pthread_mutex_lock(&is->mu);
    if (whole) {
        issued(is, job);
    } else { /* the rest is the thread's, before any job handed over meanwhile */
        queue_first(is, job);
    }
    is->caller_issued++;
    is->issuing = 0;
    pthread_cond_broadcast(&is->work); /* the thread polls it, and issues what came meanwhile */
    pthread_mutex_unlock(&is->mu);
    return 1;
}

/* Append `job` to the issuer's book (caller holds the mutex); the book takes a reference. */
static void book_append(struct kvo_issuer *is, struct kvo_job *job, int64_t id) {
    job->id = id;
    job->book_next = 0;
    job->refs++;
    if (is->book_tail) is->book_tail->book_next = job;
    else is->book_head = job;
    is->book_tail = job;
    is->book_count++;
    is->book_total++;
}

/* Book `job` (of `refs` references) as done and failed with `code` in `call` before anything was
 * enqueued: in order among the booked jobs, for kvo_book_take to report. 0, or KVO_RELEASED (the
 * job freed) once the issuer stopped. Caller does not hold the mutex. */
static int64_t book_failed(struct kvo_issuer *is, struct kvo_job *job, int64_t id, int64_t refs,
                           int64_t code, const char *call) {
    job->issuer = is;
    job->tag = -1; /* never handed over: no path took it */
    job->state = JOB_DONE;
    job->fail = FAIL_NOTHING;
    job->error = code;
    job->error_call = call;
    job->marked = job->first + job->nplans; /* a layered job's layers: nothing to wait for */
    job->failed_from = job->first;
    job->times[0] = job->times[3] = now_ns();
    pthread_mutex_lock(&is->mu);
    if (is->stop || is->exited) {
        pthread_mutex_unlock(&is->mu);
        job_free(job);
        return KVO_RELEASED;
    }
    job->refs = refs - 1; /* book_append adds the book's */
    is->refs++;
    book_append(is, job, id);
    pthread_mutex_unlock(&is->mu);
    return 0;
}

/* kvo_hand_off and kvo_hand_off_booked (`booked`: the job goes into the book as `id`, which holds
 * the reference the caller would get; a fence the call fails to record books the job as failed). */
static struct kvo_job *hand_off(struct kvo_issuer *is, void *stream, struct kvo_fence *fence,
                                int64_t path, int64_t n, const int64_t *dev_ids,
                                const int64_t *host_ids, int64_t nplans,
                                struct kvo_plan *const *plans, int64_t first, int64_t layered,
                                int64_t booked, int64_t id, int64_t tag, int64_t *error) {
    struct kvo_job *job = calloc(1, sizeof(*job));
    *error = KVO_NO_MEMORY;
    if (!job) return 0;
    job->dev_ids = copy_i64(dev_ids, n);
    job->host_ids = copy_i64(host_ids, n);
    job->plans = malloc((size_t)(nplans > 0 ? nplans : 1) * sizeof(*job->plans));
    job->marks = layered ? calloc((size_t)(first + nplans + 1), sizeof(CUevent)) : 0;
    if (!job->dev_ids || !job->host_ids || !job->plans || (layered && !job->marks)) {
        job_free(job);
        return 0;
    }
    memcpy(job->plans, plans, (size_t)nplans * sizeof(*plans));
    for (int64_t k = 0; k < nplans; k++) job->bytes += n * plans[k]->bytes;
    job->issuer = is;
    job->path = path; job->n = n; job->nplans = nplans; job->first = first; job->layered = layered;
    job->marked = first; /* layers before `first` belong to another part: nothing to wait for */
    job->failed_from = first + nplans;
    job->refs = layered ? 3 : 2;
    job->tag = tag;
    int own = fence == 0;
    if (own && !(fence = kvo_fence_take(is, stream, error))) {
        if (!booked || *error == KVO_NO_MEMORY || *error == KVO_RELEASED) {
            job_free(job);
            return 0;
        }
        int64_t recorded = *error; /* the record's CUresult: the job is booked as failed with it */
        *error = book_failed(is, job, id, layered ? 2 : 1, recorded, "cuEventRecord");
        return *error ? 0 : job;
    }
    job->fence = fence;
    job->times[0] = now_ns();
    job->caller_cpu = is->c.share_cpu ? sched_getcpu() : -1;
    pthread_mutex_lock(&is->mu);
    if (is->stop || is->exited) {
        if (own) fence_unref(is, fence);
        pthread_mutex_unlock(&is->mu);
        *error = KVO_RELEASED;
        job_free(job);
        return 0;
    }
    if (!own) fence->refs++; /* a taken fence keeps its taker's reference; an own one is the job's */
    is->refs++;
    if (booked) { /* in hand-off order, before the issue: the book's reference is the caller's */
        job->refs--;
        book_append(is, job, id);
    }
    if (caller_issue(is, job)) {
        *error = 0;
        return job;
    }
    if (is->queue_tail) is->queue_tail->next = job;
    else __atomic_store_n(&is->queue_head, job, __ATOMIC_RELEASE); /* read by an idle spin */
    is->queue_tail = job;
    int wake = is->sleeping && !(is->c.controls & CONTROL_NEVER_SIGNAL);
    is->signals += wake;
    pthread_mutex_unlock(&is->mu);
    /* Signalled after the unlock: the woken thread does not wait for the caller's mutex. The issuer
     * outlives the call (its owner holds a reference). A spinning thread needs no signal. */
    if (wake) pthread_cond_signal(&is->work);
    *error = 0;
    return job;
}

/* Hand a job to the thread, in one call from the caller's thread: behind `fence` (a fence of
 * kvo_fence_take, which keeps its taker's reference), or, when `fence` is NULL, behind a fence
 * recorded on `stream` here (its only taker is the job). dev_ids/host_ids (n each) are copied;
 * plans (nplans) must outlive the thread. Returns the job (two references: the thread's and the
 * caller's, plus one for the layer marks when layered) or NULL with *error set: no memory
 * (KVO_NO_MEMORY), a stopped issuer (KVO_RELEASED) or the fence's record failed (its CUresult). */
struct kvo_job *kvo_hand_off(struct kvo_issuer *is, void *stream, struct kvo_fence *fence, int64_t path,
                             int64_t n, const int64_t *dev_ids, const int64_t *host_ids, int64_t nplans,
                             struct kvo_plan *const *plans, int64_t first, int64_t layered,
                             int64_t *error) {
    return hand_off(is, stream, fence, path, n, dev_ids, host_ids, nplans, plans, first, layered, 0, 0,
                    0, error);
}

/* ------------------------------------------------------------------------------------ the book */

int64_t kvo_job_wait(struct kvo_job *job, int64_t timeout_ns);
static void release_and_unlock(struct kvo_job *job);

/* The issuer's book: the jobs handed over with kvo_hand_off_booked (and those booked failed with
 * kvo_book_fail), in hand-off order, until kvo_book_take takes their results in that order. Its
 * owner needs no object per job: it hands a job over, waits for one by id and takes every finished
 * result in one call (docs/design.md §16, the job table). */

/* kvo_hand_off for a booked job `id`, tagged `tag` (kvo_book_take reports it: the owner's name of
 * the path it chose, say): 0 when the job is in the book, where its result comes, the
 * job possibly booked as failed (its fence's record failed: that CUresult is its error); else the
 * job is not booked and failed with the returned code (KVO_NO_MEMORY, or KVO_RELEASED once the
 * issuer stopped). A layered job's marks get the job in *marks_job (their reference; set only when
 * booked, else NULL). */
int64_t kvo_hand_off_booked(struct kvo_issuer *is, int64_t id, int64_t tag, void *stream,
                            struct kvo_fence *fence,
                            int64_t path, int64_t n, const int64_t *dev_ids, const int64_t *host_ids,
                            int64_t nplans, struct kvo_plan *const *plans, int64_t first,
                            int64_t layered, struct kvo_job **marks_job) {
    int64_t error = 0;
    struct kvo_job *job = hand_off(is, stream, fence, path, n, dev_ids, host_ids, nplans, plans, first,
                                   layered, 1, id, tag, &error);
    if (marks_job) *marks_job = job && layered ? job : 0;
    return job ? 0 : error;
}

/* Book job `id` of `n` pairs as failed with `code` before it was handed over (in order among the
 * booked jobs): 0, KVO_NO_MEMORY or KVO_RELEASED (not booked). */
int64_t kvo_book_fail(struct kvo_issuer *is, int64_t id, int64_t n, int64_t code) {
    struct kvo_job *job = calloc(1, sizeof(*job));
    if (!job) return KVO_NO_MEMORY;
    job->n = n;
    return book_failed(is, job, id, 1, code, "");
}

/* Take the results of the finished jobs at the head of the book, in hand-off order, up to `max`
 * of them (stops at the first not done): for the k-th, out[k * BOOK_FIELDS ...] its id, its error
 * code (0: none), its kind of failure, its pairs, its tag (-1: booked failed before it was handed
 * over) and its times (as kvo_job_times; 0 for what did not happen), seconds[k] its
 * device time, calls[k] the failed call's name ("" for none; a static string). The book's reference
 * to each goes. Returns how many. Not after kvo_issuer_free. */
int64_t kvo_book_take(struct kvo_issuer *is, int64_t max, int64_t *out, double *seconds, const char **calls) {
    int64_t k = 0;
    pthread_mutex_lock(&is->mu);
    struct kvo_job *job, **at = &is->book_head, *before = 0;
    while (k < max && (job = *at)) {
        if (job->state != JOB_DONE) { /* CONTROL_BOOK_ANY_ORDER: looks past it, out of order */
            if (!(is->c.controls & CONTROL_BOOK_ANY_ORDER)) break;
            before = job;
            at = &job->book_next;
            continue;
        }
        *at = job->book_next;
        if (is->book_tail == job) is->book_tail = before;
        is->book_count--;
        int64_t *o = out + k * BOOK_FIELDS;
        o[0] = job->id; o[1] = job->error; o[2] = job->fail; o[3] = job->n; o[4] = job->tag;
        for (int t = 0; t < 4; t++) o[5 + t] = __atomic_load_n(&job->times[t], __ATOMIC_RELAXED);
        seconds[k] = job->seconds;
        calls[k] = job->error_call ? job->error_call : "";
        job_unref(job); /* never the issuer's last reference: its owner holds one */
        k++;
    }
    pthread_mutex_unlock(&is->mu);
    return k;
}

/* Wait up to timeout_ns (without the GIL) for booked job `id` (with `last`, the last job booked,
 * whatever its id) and the jobs booked before it to be done: waits, as kvo_job_wait waits, for the
 * first of them not done (a job booked failed is done at once, before the jobs ahead of it). 1 when
 * that one is done (all of them, if it was the job itself; else call again), 0 when it is not yet,
 * -1 when no such job is in the book (never booked, or its result taken; with `last`, the book is
 * empty). */
int64_t kvo_book_wait(struct kvo_issuer *is, int64_t id, int64_t last, int64_t timeout_ns) {
    pthread_mutex_lock(&is->mu);
    struct kvo_job *job = is->book_head, *first = 0; /* the first job not done up to it */
    for (; job; job = job->book_next) {
        if (!first && job->state != JOB_DONE) first = job;
        if (last ? !job->book_next : job->id == id) break;
    }
    if (job && (is->c.controls & CONTROL_BOOK_WAIT_ITSELF)) first = job->state != JOB_DONE ? job : 0;
    if (!job || !first) {
        pthread_mutex_unlock(&is->mu);
        return job ? 1 : -1;
    }
    first->refs++; /* kept while this call waits: a take meanwhile drops only the book's */
    pthread_mutex_unlock(&is->mu);
    int64_t done = kvo_job_wait(first, timeout_ns);
    pthread_mutex_lock(&is->mu);
    release_and_unlock(first); /* (the issuer's last reference, were its owner gone) */
    return done;
}

/* The jobs in the book (handed over or booked failed, their results not taken); out[0] the first's
 * id, when there is one, and out[1] how many jobs were ever booked. */
int64_t kvo_book_count(struct kvo_issuer *is, int64_t *out) {
    pthread_mutex_lock(&is->mu);
    int64_t count = is->book_count;
    if (is->book_head) out[0] = is->book_head->id;
    out[1] = is->book_total;
    pthread_mutex_unlock(&is->mu);
    return count;
}

/* Booked job `id`'s timeline so far (as kvo_job_times) in out[0..3]: 1, or 0 when it is not in the
 * book (a profile's view of a job in flight). */
int64_t kvo_book_times(struct kvo_issuer *is, int64_t id, int64_t *out) {
    pthread_mutex_lock(&is->mu);
    struct kvo_job *job = is->book_head;
    while (job && job->id != id) job = job->book_next;
    if (job)
        for (int k = 0; k < 4; k++) out[k] = __atomic_load_n(&job->times[k], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&is->mu);
    return job != 0;
}

/* The book's references go (caller holds the mutex; the owner's reference keeps the issuer). */
static void book_clear(struct kvo_issuer *is) {
    struct kvo_job *job = is->book_head;
    is->book_head = is->book_tail = 0;
    is->book_count = 0;
    while (job) {
        struct kvo_job *next = job->book_next;
        job_unref(job);
        job = next;
    }
}

/* A waiter spinning for `job` looks at its end itself (the thread's polls sleep between queries:
 * 4-20 us, plus their wake-ups). When the job heads the flight, its issue succeeded and no one
 * queries it (`querying`, which the thread also takes for its queries, so one of them queries at a
 * time and the job leaves the flight once, in order: only the head), the waiter queries its end
 * event without the mutex and finds a completed job done here, as the thread would, or failed with
 * the query's error, as the thread would report it. A query the caller's thread cannot make (no
 * context current there) is left to the thread, and the waiter stops querying. The query is not
 * counted as a caller's driver call: the thread does not give way to it (it would hold back the
 * issue of the jobs queued behind at every query). 1 when the job is done, -1 when the waiter is to
 * stop querying, else 0. The job's events stay its own while the waiter holds its reference. */
static int waiter_query(struct kvo_issuer *is, struct kvo_job *job) {
    if (__atomic_load_n(&is->flight_head, __ATOMIC_ACQUIRE) != job) return 0; /* not yet the head */
    pthread_mutex_lock(&is->mu);
    int stop_querying = 0;
    if (job->state == JOB_ISSUED && is->flight_head == job && !is->querying && !is->stop &&
        job->fail == FAIL_NONE) {
        is->querying = 1;
        pthread_mutex_unlock(&is->mu);
        float ms;
        CUresult q = query_end(is, job, &ms);
        pthread_mutex_lock(&is->mu);
        is->querying = 0;
        stop_querying = q == KVO_INVALID_CONTEXT;
        if (q != KVO_NOT_READY && !stop_querying && job->state == JOB_ISSUED && is->flight_head == job) {
            found(is, job, q, ms);
            is->waiter_found++;
        }
    }
    int done = job->state == JOB_DONE;
    pthread_mutex_unlock(&is->mu);
    return done ? 1 : stop_querying ? -1 : 0;
}

/* Spin, reading the job's state without the lock, until it is done or CLOCK_MONOTONIC `until`;
 * while *query, query its end itself every wait_query_ns (waiter_query; *query drops when the
 * caller's thread cannot). 1 when the job is done. */
static int wait_spinning(struct kvo_issuer *is, struct kvo_job *job, int64_t until, int64_t *query) {
    int64_t now = now_ns(), next_query = now;
    while (now < until) {
        if (__atomic_load_n(&job->state, __ATOMIC_ACQUIRE) == JOB_DONE) return 1;
        if (*query && now >= next_query && __atomic_load_n(&job->state, __ATOMIC_ACQUIRE) == JOB_ISSUED) {
            int r = waiter_query(is, job);
            if (r > 0) return 1;
            *query = r == 0;
            next_query = now_ns() + is->c.wait_query_ns;
        }
        for (int i = 0; i < 32; i++) cpu_relax();
        if (__atomic_load_n(&job->state, __ATOMIC_ACQUIRE) == JOB_QUEUED)
            give_cpu(is, &is->thread_cpu, &is->waiter_yields); /* not issued: the thread may need it */
        now = now_ns();
    }
    return __atomic_load_n(&job->state, __ATOMIC_ACQUIRE) == JOB_DONE;
}

/* Wait up to timeout_ns for the job to be done; 1 when it is. The GIL is not held. Spins first
 * (reading the state without the lock) for up to the config's wait_spin_ns, since waking a thread
 * blocked on a condition variable costs tens of microseconds on some hosts, querying the job's end
 * itself every wait_query_ns while it spins (waiter_query); then blocks. A blocked waiter whose job
 * has a predicted end (predict_end: a long job in flight) wakes wait_lead_ns before it and spins
 * to wait_lead_ns plus an eighth of the job's predicted device time after it (the prediction is
 * the fastest rate seen: a job ends late more often than early; the jobs ahead of it in flight were
 * predicted again as each was found done: rebase_flight), so that a core the long block
 * let sleep deeply is awake when the job ends (on an H100 host a waiter woken at the end returned
 * 96-186 us after the job was found done; docs/design.md §16); past that window it blocks until
 * woken. A job still queued has no prediction yet: the thread broadcasts `done` as it puts a job
 * in flight, so the waiter looks again then. A query in a spin may wait behind another thread's
 * driver call: the wait can end that much past timeout_ns. */
int64_t kvo_job_wait(struct kvo_job *job, int64_t timeout_ns) {
    struct kvo_issuer *is = job->issuer;
    int64_t start = now_ns(), left = timeout_ns > 0 ? timeout_ns : 0;
    int64_t deadline = left > INT64_MAX - start ? INT64_MAX : start + left;
    int64_t spin = is->c.wait_spin_ns < timeout_ns ? is->c.wait_spin_ns : timeout_ns;
    int64_t query = is->c.wait_query_ns > 0, lead = is->c.wait_lead_ns, spun_to = 0;
    wait_spinning(is, job, start + spin, &query);
    struct timespec until;
    pthread_mutex_lock(&is->mu);
    while (job->state != JOB_DONE) {
        int64_t now = now_ns();
        if (now >= deadline) break;
        int64_t end = job->expected_end, wake = deadline;
        /* the window's tail grows with the job: one up to an eighth slower than the fastest
         * rate seen still ends inside it (its own time: the jobs ahead were predicted again as
         * each was found done) */
        int64_t tail = end > 0 ? lead + job->runs / 8 : 0;
        if (lead > 0 && end > 0 && end + tail > now && end + tail > spun_to) {
            if (now >= end - lead) { /* near its predicted end: spin through it */
                spun_to = end + tail < deadline ? end + tail : deadline;
                pthread_mutex_unlock(&is->mu);
                wait_spinning(is, job, spun_to, &query);
                pthread_mutex_lock(&is->mu);
                continue;
            }
            if (end - lead < wake) wake = end - lead;
        }
        deadline_after(&until, wake - now);
        pthread_cond_timedwait(&is->done, &is->mu, &until);
    }
    int64_t done = job->state == JOB_DONE;
    pthread_mutex_unlock(&is->mu);
    return done;
}

/* The caller's reference to the job goes (the caller holds the mutex), and the mutex is unlocked,
 * unless it went with the issuer (its last reference was the job's). */
static void release_and_unlock(struct kvo_job *job) {
    struct kvo_issuer *is = job->issuer;
    int64_t last_issuer_ref = is->refs == 1 && job->refs == 1;
    job_unref(job);
    if (!last_issuer_ref) pthread_mutex_unlock(&is->mu);
}

/* The job's state (0 queued, 1 issued, 2 done) and, once it is done, its outcome: out[0] the error
 * code (0: none), out[1] the kind of failure, out[2..5] its times (as kvo_job_times), *seconds the
 * device time between its start and end events, *call the failed call's name ("" for none); with
 * `release`, the caller's reference to a done job goes in the same call (as kvo_job_release). */
int64_t kvo_job_take(struct kvo_job *job, int64_t release, int64_t *out, double *seconds,
                     const char **call) {
    struct kvo_issuer *is = job->issuer;
    pthread_mutex_lock(&is->mu);
    int64_t state = job->state;
    if (state == JOB_DONE) {
        out[0] = job->error;
        out[1] = job->fail;
        memcpy(out + 2, job->times, sizeof(job->times));
        *seconds = job->seconds;
        *call = job->error_call ? job->error_call : "";
        if (release) {
            release_and_unlock(job);
            return state;
        }
    }
    pthread_mutex_unlock(&is->mu);
    return state;
}

/* out[0]: how many hand-offs found the thread blocked and signalled it (the idle spin's measure);
 * out[1]: how many idle naps it took; out[2]: how many jobs their callers issued; out[3]: how
 * many jobs their waiters found done (waiter_query); out[4]: how many kvo_issuer_expect calls woke
 * the thread; out[5]: how many told it a caller was coming. */
void kvo_issuer_counts(struct kvo_issuer *is, int64_t *out) {
    pthread_mutex_lock(&is->mu);
    out[0] = is->signals;
    out[1] = is->naps;
    out[2] = is->caller_issued;
    out[3] = is->waiter_found;
    out[4] = is->expects;
    out[5] = is->comings;
    pthread_mutex_unlock(&is->mu);
}

/* The strided copies dma plans made so far (dma_plan: runs of pairs that follow each other on both
 * sides, a copy per page group). */
int64_t kvo_issuer_direct_copies(struct kvo_issuer *is) {
    return __atomic_load_n(&is->direct_copies, __ATOMIC_RELAXED);
}

/* How often a side gave a CPU it may share (give_cpu, yield_to_caller): out[0] the thread to the
 * caller of a job it took up, out[1] waiters spinning for a job not yet issued, out[2] the thread
 * spinning for a caller (an announced hand-off, or a caller's driver call). */
void kvo_issuer_yields(struct kvo_issuer *is, int64_t *out) {
    out[0] = __atomic_load_n(&is->thread_yields, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&is->waiter_yields, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&is->spin_yields, __ATOMIC_RELAXED);
}

/* Diagnostics of the driver's serialisation of the callers' calls behind the issuing side's (docs/
 * design.md §16), 2 * CALL_KINDS + 2 values: out[k] the issuing side's longest driver call of kind k
 * so far (ns; CALL_RECORD, CALL_WAIT, CALL_COPY, CALL_LAUNCH, CALL_QUERY; out[0] unused), out[
 * CALL_KINDS + k] the callers' driver calls (a fence's record, a layer's stream wait) longer than
 * SLOW_CALLER_CALL_NS that began while the issuing side was in a call of kind k (k = 0: in none),
 * out[2 * CALL_KINDS] the callers' calls made, out[2 * CALL_KINDS + 1] the longest of them (ns). */
void kvo_issuer_call_stats(struct kvo_issuer *is, int64_t *out) {
    for (int k = 0; k < CALL_KINDS; k++) {
        out[k] = __atomic_load_n(&is->issue_call_max_ns[k], __ATOMIC_RELAXED);
        out[CALL_KINDS + k] = __atomic_load_n(&is->slow_caller_calls[k], __ATOMIC_RELAXED);
    }
    out[2 * CALL_KINDS] = __atomic_load_n(&is->caller_calls, __ATOMIC_RELAXED);
    out[2 * CALL_KINDS + 1] = __atomic_load_n(&is->caller_call_max_ns, __ATOMIC_RELAXED);
}

/* A hand-off of a job its caller will not issue (larger than caller_issue_max) is coming: a thread
 * that is out of work and blocked is woken now, and looks for the hand-off for expect_spin_ns
 * before it blocks again, so that its wake-up (tens of microseconds on the H200 hosts after a
 * millisecond blocked) overlaps the caller's work before the hand-off instead of following it.
 * A thread with work (issuing or polling jobs) is told instead that the caller is coming: it gives
 * way before each of its driver calls until the caller's record (kvo_fence_take) or for
 * caller_coming_ns at most, so that the caller's record, the hand-off's one driver call, does not
 * wait behind a call the thread is in (see give_way). An announcement in force is not extended by
 * another, and one that lapsed with no record makes the thread ignore further ones until the next
 * record: a caller announcing again and again without recording holds the thread for one
 * caller_coming_ns between two records at most. 1 when it woke the thread, 2 when it
 * told it; 0 (nothing done) when that is off, or the thread is stopping, a caller issues, it is
 * out of work and not blocked, or an announcement lapsed since the last record. */
int64_t kvo_issuer_expect(struct kvo_issuer *is) {
    if (is->c.expect_spin_ns <= 0 && is->c.caller_coming_ns <= 0) return 0;
    seen_on_cpu(is, &is->caller_cpu); /* where the thread's spin for the hand-off looks (give_cpu) */
    pthread_mutex_lock(&is->mu);
    int busy = !is->stop && !is->issuing && (is->thread_issues || is->queue_head || is->flight_head);
    int wake = is->c.expect_spin_ns > 0 && is->sleeping && !is->queue_head && !is->flight_head &&
               !is->issuing && !is->stop && !(is->c.controls & CONTROL_NEVER_SIGNAL);
    int told = busy && is->c.caller_coming_ns > 0 && !__atomic_load_n(&is->coming_lapsed, __ATOMIC_ACQUIRE);
    if (wake) {
        is->expect_until = now_ns() + is->c.expect_spin_ns;
        is->expects++;
    } else if (told) {
        /* An announcement in force is not extended (CONTROL_COMING_ALWAYS: it is): so one lapses
         * caller_coming_ns after it was made, however often callers announce meanwhile. */
        int64_t none = 0, until = now_ns() + is->c.caller_coming_ns;
        if (is->c.controls & CONTROL_COMING_ALWAYS)
            __atomic_store_n(&is->coming_until, until, __ATOMIC_RELEASE);
        else
            __atomic_compare_exchange_n(&is->coming_until, &none, until, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE);
        is->comings++;
    }
    pthread_mutex_unlock(&is->mu);
    if (wake) pthread_cond_signal(&is->work);
    return wake ? 1 : told ? 2 : 0;
}

/* The job's predicted end (CLOCK_MONOTONIC ns; 0 until it is in flight, or with nothing to predict
 * from): see predict_end. */
int64_t kvo_job_expected_end(struct kvo_job *job) {
    struct kvo_issuer *is = job->issuer;
    pthread_mutex_lock(&is->mu);
    int64_t end = job->expected_end;
    pthread_mutex_unlock(&is->mu);
    return end;
}

/* A done job's timeline (CLOCK_MONOTONIC ns): handed over, issue began, issued, found done. */
void kvo_job_times(struct kvo_job *job, int64_t *out) {
    struct kvo_issuer *is = job->issuer;
    pthread_mutex_lock(&is->mu);
    for (int k = 0; k < 4; k++) out[k] = __atomic_load_n(&job->times[k], __ATOMIC_RELAXED);
    pthread_mutex_unlock(&is->mu);
}

/* The ticket's reference goes (the job's result was read, or the job was abandoned). */
void kvo_job_release(struct kvo_job *job) {
    pthread_mutex_lock(&job->issuer->mu);
    release_and_unlock(job);
}

/* Make `stream` wait for layer `layer`'s mark (KVO_BAD_ARGUMENT: not a layered job, or no such
 * layer; KVO_JOB_FAILED: the job ended with an error, nothing to wait for): wait (up to
 * timeout_ns, without the GIL) until the thread recorded it, then enqueue the stream wait, without
 * the lock (a driver call). The event cannot go back to the pool meanwhile: the marks hold a
 * reference to the job, and the caller's side releases them (kvo_marks_release) only once no
 * waiter is inside this call. 0, KVO_TIMEOUT, or the driver's code. */
int64_t kvo_wait_layer(struct kvo_job *job, int64_t layer, void *stream, int64_t timeout_ns) {
    struct kvo_issuer *is = job->issuer;
    if (!job->layered || layer < 0 || layer >= job->first + job->nplans) return KVO_BAD_ARGUMENT;
    struct timespec until;
    deadline_after(&until, timeout_ns);
    pthread_mutex_lock(&is->mu);
    int64_t code = 0;
    /* A layer at or past failed_from was never enqueued (set under the mutex as a partly failed
     * issue ends, before the rest of the marks are recorded): it did not land, whenever asked. */
    while (job->marked <= layer && layer < job->failed_from && !job->marks_released)
        if (pthread_cond_timedwait(&is->done, &is->mu, &until) == ETIMEDOUT) break;
    CUevent ev = 0;
    if (!job->marks_released && layer >= job->first && layer >= job->failed_from)
        code = KVO_JOB_FAILED;
    else if (job->marked <= layer && !job->marks_released) code = KVO_TIMEOUT;
    else if (!job->marks_released && job->state == JOB_DONE && job->error && layer >= job->first &&
             job->fail != FAIL_PARTLY)
        code = KVO_JOB_FAILED; /* a layer its failed issue enqueued landed; after a failed
                                * completion or a given-up job none is known to have */
    else if (!job->marks_released && job->marks[layer] && job->state != JOB_DONE) ev = job->marks[layer];
    pthread_mutex_unlock(&is->mu);
    /* The stream wait, a driver call, is made without the mutex: the event stays the job's, since
     * its marks are released (kvo_marks_release) only once no waiter is inside this call (the
     * caller's side counts them: NativeLayerMarks). */
    if (ev) {
        caller_call(is, 1);
        code = CALLER_CALL(is, ((fn_stream_wait)is->c.stream_wait_event)(stream, ev, 0));
        if (context_restored(is, code)) code = ((fn_stream_wait)is->c.stream_wait_event)(stream, ev, 0);
        caller_call(is, -1);
    }
    return code;
}

/* The layer marks' reference goes (the job's result was published: every layer landed). */
void kvo_marks_release(struct kvo_job *job) {
    struct kvo_issuer *is = job->issuer;
    pthread_mutex_lock(&is->mu);
    int64_t last_issuer_ref = is->refs == 1 && job->refs == 1;
    if (!job->marks_released) {
        for (int64_t i = 0; i < job->first + job->nplans; i++) {
            pool_give(is, &is->plain, job->marks[i]);
            job->marks[i] = 0;
        }
        job->marks_released = 1;
        pthread_cond_broadcast(&is->done);
    }
    job_unref(job);
    if (!last_issuer_ref) pthread_mutex_unlock(&is->mu);
}

/* ------------------------------------------------------------------- the worker's admission check */

/* Admit one job (the worker holds its lock): every source id in [0, src_limit) and every
 * destination id in [0, dst_limit), the destinations distinct, no source block written by a job in
 * flight and no destination block read or written by one; then count the job's blocks in flight
 * (each id once per occurrence, as kvo_unadmit uncounts them). Returns -1 when admitted, else the
 * check that failed first (0 range, 1 duplicate, 2 conflict) with nothing counted: the caller names
 * the failure with its own checks. `stamp` (dst_limit int32, zero at first) and `*token` are the
 * duplicate check's scratch, kept by the caller for the destination memory. */
int64_t kvo_admit(const int64_t *src, const int64_t *dst, int64_t n, int64_t src_limit,
                  int64_t dst_limit, const int32_t *src_writes, int32_t *src_reads,
                  const int32_t *dst_reads, int32_t *dst_writes, int32_t *stamp, int64_t *token) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)src[i] >= (uint64_t)src_limit || (uint64_t)dst[i] >= (uint64_t)dst_limit)
            return 0;
    if (*token >= INT32_MAX) { memset(stamp, 0, (size_t)dst_limit * sizeof(int32_t)); *token = 0; }
    int32_t t = (int32_t)++*token;
    for (int64_t i = 0; i < n; i++) {
        if (stamp[dst[i]] == t) return 1;
        stamp[dst[i]] = t;
    }
    for (int64_t i = 0; i < n; i++) if (src_writes[src[i]]) return 2;
    for (int64_t i = 0; i < n; i++) if (dst_reads[dst[i]] || dst_writes[dst[i]]) return 2;
    for (int64_t i = 0; i < n; i++) src_reads[src[i]]++;
    for (int64_t i = 0; i < n; i++) dst_writes[dst[i]]++;
    return -1;
}

/* Uncount a job kvo_admit admitted (its result was returned, or its submit failed). */
void kvo_unadmit(const int64_t *src, const int64_t *dst, int64_t n, int32_t *src_reads,
                 int32_t *dst_writes) {
    for (int64_t i = 0; i < n; i++) src_reads[src[i]]--;
    for (int64_t i = 0; i < n; i++) dst_writes[dst[i]]--;
}
