/*
 * libmusa_stub.c - a TEST DOUBLE of the MUSA driver library (libmusa.so).
 *
 * This is NOT a MUSA driver and talks to no GPU. graphslot's tests compile it with
 * gcc at test time and point GRAPHSLOT_LIBMUSA at the result, so the ctypes layer in
 * graphslot/backends/musa/driver.py can be driven through every call and every error
 * path on any Linux machine.
 *
 * It exports the driver entry points graphslot calls, with the signatures and struct
 * layouts graphslot assumes (CUDA's, renamed), implemented over host memory:
 *
 *   muMemAddressReserve  mmap(PROT_NONE) of an aligned range
 *   muMemCreate          memfd_create + ftruncate; the handle indexes a table
 *   muMemMap             mmap(MAP_SHARED | MAP_FIXED) of the memfd, still PROT_NONE
 *   muMemSetAccess       mprotect (READWRITE -> PROT_READ | PROT_WRITE)
 *   muMemUnmap           mmap(PROT_NONE, MAP_ANONYMOUS | MAP_FIXED) over the range
 *   muMemRelease         close of the memfd (existing mappings keep their pages)
 *   muMemAddressFree     munmap
 *
 * Errors are returned the way a driver would: MUSA_ERROR_NOT_INITIALIZED before
 * muInit, MUSA_ERROR_INVALID_CONTEXT on a thread with no current context,
 * MUSA_ERROR_INVALID_VALUE for sizes that are zero or not granular, double releases,
 * unmapping what is not mapped, and so on. Error codes use CUDA's numbers.
 *
 * Test-only controls are all prefixed stub_: stub_reset, stub_fail_next (make the
 * next call of a named function return a chosen code), stub_set_* (device count, VMM
 * support, granularity, memory size), counters, and stub_layout (the C compiler's
 * sizes and offsets of the structures, for the ctypes layout cross-check).
 *
 * Build variants: -DOMIT_VMM drops every VMM entry point (a driver too old for VMM),
 * -DOMIT_<symbol> drops one (e.g. -DOMIT_muMemCreate), -DOMIT_ERROR_NAME drops
 * muGetErrorName and muGetErrorString.
 */

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(OMIT_VMM)
#define OMIT_muMemAddressReserve
#define OMIT_muMemAddressFree
#define OMIT_muMemCreate
#define OMIT_muMemRelease
#define OMIT_muMemMap
#define OMIT_muMemUnmap
#define OMIT_muMemSetAccess
#define OMIT_muMemGetAllocationGranularity
#endif

#define EXPORT __attribute__((visibility("default")))
/* helpers stay quiet in builds that omit the entry points using them */
#define HELPER static __attribute__((unused))

/* ------------------------------------------------------------------ driver types */

typedef int MUresult;
typedef int MUdevice;
typedef void *MUcontext;
typedef unsigned long long MUdeviceptr;
typedef unsigned long long MUmemGenericAllocationHandle;

typedef struct {
    int type;
    int id;
} MUmemLocation;

typedef struct {
    int type;
    int requestedHandleTypes;
    MUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} MUmemAllocationProp;

typedef struct {
    MUmemLocation location;
    int flags;
} MUmemAccessDesc;

enum {
    MUSA_SUCCESS = 0,
    MUSA_ERROR_INVALID_VALUE = 1,
    MUSA_ERROR_OUT_OF_MEMORY = 2,
    MUSA_ERROR_NOT_INITIALIZED = 3,
    MUSA_ERROR_NO_DEVICE = 100,
    MUSA_ERROR_INVALID_DEVICE = 101,
    MUSA_ERROR_INVALID_CONTEXT = 201,
    MUSA_ERROR_ALREADY_MAPPED = 208,
    MUSA_ERROR_INVALID_HANDLE = 400,
    MUSA_ERROR_NOT_SUPPORTED = 801,
    MUSA_ERROR_UNKNOWN = 999,
};

enum {
    ALLOCATION_TYPE_PINNED = 1,
    LOCATION_TYPE_DEVICE = 1,
    HANDLE_TYPE_POSIX_FD = 1,
    ACCESS_NONE = 0,
    ACCESS_READ = 1,
    ACCESS_READWRITE = 3,
    GRANULARITY_MINIMUM = 0,
    GRANULARITY_RECOMMENDED = 1,
    ATTR_CLOCK_RATE = 13,
    ATTR_UNIFIED_ADDRESSING = 41,
    ATTR_VMM_SUPPORTED = 102,
};

/* ------------------------------------------------------------------ state */

#define MAX_DEVICES 8
#define MAX_RESERVATIONS 256
#define MAX_HANDLES 1024
#define MAX_MAPPINGS 1024
#define MAX_FAILS 32
#define MAX_COUNTERS 64
#define HANDLE_BASE 0x5100u /* handles are opaque; never 0 */

struct context { int device; int refs; };
struct reservation { uintptr_t va; size_t size; int live; };
struct handle { int fd; size_t size; int live; };
struct mapping { uintptr_t va; size_t size; int live; };
struct fail { char name[64]; int code; };
struct counter { char name[64]; int calls; };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_initialized;
static int g_device_count = 1;
static int g_vmm_supported = 1;
static size_t g_granularity = 64 * 1024;
static size_t g_total = 256u * 1024 * 1024;
static size_t g_used;
static struct context g_ctx[MAX_DEVICES];
static __thread struct context *t_current;
static struct reservation g_res[MAX_RESERVATIONS];
static struct handle g_handles[MAX_HANDLES];
static struct mapping g_maps[MAX_MAPPINGS];
static struct fail g_fails[MAX_FAILS];
static struct counter g_counters[MAX_COUNTERS];
static int g_dlpack_deletes;

static void count_call(const char *name) {
    for (int i = 0; i < MAX_COUNTERS; i++) {
        if (g_counters[i].name[0] == 0) {
            strncpy(g_counters[i].name, name, sizeof g_counters[i].name - 1);
            g_counters[i].calls = 1;
            return;
        }
        if (strcmp(g_counters[i].name, name) == 0) {
            g_counters[i].calls++;
            return;
        }
    }
}

static int take_fail(const char *name) {
    for (int i = 0; i < MAX_FAILS; i++) {
        if (g_fails[i].name[0] && strcmp(g_fails[i].name, name) == 0) {
            int code = g_fails[i].code;
            g_fails[i].name[0] = 0;
            return code;
        }
    }
    return 0;
}

/* Every entry point: take the lock, count the call, honour a planted failure. */
#define API_BEGIN(name)                          \
    MUresult rc = MUSA_SUCCESS;                  \
    pthread_mutex_lock(&g_lock);                 \
    count_call(name);                            \
    if ((rc = take_fail(name)) != MUSA_SUCCESS)  \
        goto out
#define API_END              \
    out:                     \
    pthread_mutex_unlock(&g_lock); \
    return rc
#define FAIL(code)      \
    do {                \
        rc = (code);    \
        goto out;       \
    } while (0)
#define REQUIRE_INIT() \
    if (!g_initialized) FAIL(MUSA_ERROR_NOT_INITIALIZED)
#define REQUIRE_CTX()                                     \
    REQUIRE_INIT();                                       \
    if (t_current == NULL || t_current->refs == 0) FAIL(MUSA_ERROR_INVALID_CONTEXT)

static int valid_device(int dev) { return dev >= 0 && dev < g_device_count; }

HELPER struct reservation *reservation_holding(uintptr_t va, size_t size) {
    for (int i = 0; i < MAX_RESERVATIONS; i++) {
        struct reservation *r = &g_res[i];
        if (r->live && r->va <= va && va + size <= r->va + r->size && va + size > va) return r;
    }
    return NULL;
}

HELPER struct handle *lookup_handle(MUmemGenericAllocationHandle h) {
    if (h < HANDLE_BASE || h >= HANDLE_BASE + MAX_HANDLES) return NULL;
    struct handle *p = &g_handles[h - HANDLE_BASE];
    return p->live ? p : NULL;
}

HELPER struct mapping *mapping_at(uintptr_t va) {
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (g_maps[i].live && g_maps[i].va == va) return &g_maps[i];
    return NULL;
}

HELPER struct mapping *mapping_containing(uintptr_t va) {
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (g_maps[i].live && g_maps[i].va <= va && va < g_maps[i].va + g_maps[i].size) return &g_maps[i];
    return NULL;
}

HELPER int overlaps_mapping(uintptr_t va, size_t size) {
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (g_maps[i].live && g_maps[i].va < va + size && va < g_maps[i].va + g_maps[i].size) return 1;
    return 0;
}

HELPER MUresult check_prop(const MUmemAllocationProp *p) {
    if (p == NULL) return MUSA_ERROR_INVALID_VALUE;
    if (p->type != ALLOCATION_TYPE_PINNED) return MUSA_ERROR_INVALID_VALUE;
    if (p->location.type != LOCATION_TYPE_DEVICE) return MUSA_ERROR_INVALID_VALUE;
    if (!valid_device(p->location.id)) return MUSA_ERROR_INVALID_DEVICE;
    if (p->requestedHandleTypes != 0 && p->requestedHandleTypes != HANDLE_TYPE_POSIX_FD)
        return MUSA_ERROR_INVALID_VALUE;
    if (p->win32HandleMetaData != NULL) return MUSA_ERROR_INVALID_VALUE;
    for (int i = 0; i < 4; i++)
        if (p->allocFlags.reserved[i]) return MUSA_ERROR_INVALID_VALUE;
    return MUSA_SUCCESS;
}

HELPER int granular(size_t n) { return n != 0 && n % g_granularity == 0; }

/* ------------------------------------------------------------------ init, device, context */

EXPORT MUresult muInit(unsigned int flags) {
    API_BEGIN("muInit");
    if (flags != 0) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (g_device_count == 0) FAIL(MUSA_ERROR_NO_DEVICE);
    g_initialized = 1;
    API_END;
}

EXPORT MUresult muDriverGetVersion(int *version) {
    API_BEGIN("muDriverGetVersion");
    if (version == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    *version = 4030;
    API_END;
}

EXPORT MUresult muDeviceGet(MUdevice *device, int ordinal) {
    API_BEGIN("muDeviceGet");
    REQUIRE_INIT();
    if (device == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (!valid_device(ordinal)) FAIL(MUSA_ERROR_INVALID_DEVICE);
    *device = ordinal;
    API_END;
}

EXPORT MUresult muDeviceGetAttribute(int *value, int attrib, MUdevice dev) {
    API_BEGIN("muDeviceGetAttribute");
    REQUIRE_INIT();
    if (value == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (!valid_device(dev)) FAIL(MUSA_ERROR_INVALID_DEVICE);
    switch (attrib) {
    case ATTR_VMM_SUPPORTED: *value = g_vmm_supported; break;
    case ATTR_CLOCK_RATE: *value = 1500000; break; /* kHz */
    case ATTR_UNIFIED_ADDRESSING: *value = 1; break;
    default: FAIL(MUSA_ERROR_INVALID_VALUE);
    }
    API_END;
}

EXPORT MUresult muDevicePrimaryCtxRetain(MUcontext *ctx, MUdevice dev) {
    API_BEGIN("muDevicePrimaryCtxRetain");
    REQUIRE_INIT();
    if (ctx == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (!valid_device(dev)) FAIL(MUSA_ERROR_INVALID_DEVICE);
    g_ctx[dev].device = dev;
    g_ctx[dev].refs++;
    *ctx = &g_ctx[dev];
    API_END;
}

EXPORT MUresult muDevicePrimaryCtxRelease_v2(MUdevice dev) {
    API_BEGIN("muDevicePrimaryCtxRelease_v2");
    REQUIRE_INIT();
    if (!valid_device(dev)) FAIL(MUSA_ERROR_INVALID_DEVICE);
    if (g_ctx[dev].refs == 0) FAIL(MUSA_ERROR_INVALID_CONTEXT);
    g_ctx[dev].refs--;
    API_END;
}

EXPORT MUresult muCtxSetCurrent(MUcontext ctx) {
    API_BEGIN("muCtxSetCurrent");
    REQUIRE_INIT();
    if (ctx != NULL) {
        struct context *c = (struct context *)ctx;
        if (c < g_ctx || c >= g_ctx + MAX_DEVICES || c->refs == 0) FAIL(MUSA_ERROR_INVALID_CONTEXT);
    }
    t_current = (struct context *)ctx;
    API_END;
}

/* ------------------------------------------------------------------ errors */

HELPER const char *error_name(MUresult e) {
    switch (e) {
    case MUSA_SUCCESS: return "MUSA_SUCCESS";
    case MUSA_ERROR_INVALID_VALUE: return "MUSA_ERROR_INVALID_VALUE";
    case MUSA_ERROR_OUT_OF_MEMORY: return "MUSA_ERROR_OUT_OF_MEMORY";
    case MUSA_ERROR_NOT_INITIALIZED: return "MUSA_ERROR_NOT_INITIALIZED";
    case MUSA_ERROR_NO_DEVICE: return "MUSA_ERROR_NO_DEVICE";
    case MUSA_ERROR_INVALID_DEVICE: return "MUSA_ERROR_INVALID_DEVICE";
    case MUSA_ERROR_INVALID_CONTEXT: return "MUSA_ERROR_INVALID_CONTEXT";
    case MUSA_ERROR_ALREADY_MAPPED: return "MUSA_ERROR_ALREADY_MAPPED";
    case MUSA_ERROR_INVALID_HANDLE: return "MUSA_ERROR_INVALID_HANDLE";
    case MUSA_ERROR_NOT_SUPPORTED: return "MUSA_ERROR_NOT_SUPPORTED";
    case MUSA_ERROR_UNKNOWN: return "MUSA_ERROR_UNKNOWN";
    default: return NULL; /* like a real driver, some codes it does not name */
    }
}

#ifndef OMIT_ERROR_NAME
EXPORT MUresult muGetErrorName(MUresult error, const char **str) {
    if (str == NULL) return MUSA_ERROR_INVALID_VALUE;
    *str = error_name(error);
    return *str ? MUSA_SUCCESS : MUSA_ERROR_INVALID_VALUE;
}

EXPORT MUresult muGetErrorString(MUresult error, const char **str) {
    if (str == NULL) return MUSA_ERROR_INVALID_VALUE;
    *str = error_name(error) ? "stub: see the error name" : NULL;
    if (error == MUSA_ERROR_OUT_OF_MEMORY) *str = "out of memory (libmusa stub)";
    if (error == MUSA_ERROR_INVALID_CONTEXT) *str = "no current context on this thread (libmusa stub)";
    return *str ? MUSA_SUCCESS : MUSA_ERROR_INVALID_VALUE;
}
#endif

/* ------------------------------------------------------------------ memory info */

EXPORT MUresult muMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    API_BEGIN("muMemGetInfo_v2");
    REQUIRE_CTX();
    if (free_bytes == NULL || total_bytes == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    *free_bytes = g_total - g_used;
    *total_bytes = g_total;
    API_END;
}

/* ------------------------------------------------------------------ VMM */

#ifndef OMIT_muMemGetAllocationGranularity
EXPORT MUresult muMemGetAllocationGranularity(size_t *granularity, const MUmemAllocationProp *prop,
                                              int option) {
    API_BEGIN("muMemGetAllocationGranularity");
    REQUIRE_INIT();
    if (granularity == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    if ((rc = check_prop(prop)) != MUSA_SUCCESS) goto out;
    if (option == GRANULARITY_MINIMUM) *granularity = g_granularity;
    else if (option == GRANULARITY_RECOMMENDED) *granularity = 2 * g_granularity;
    else FAIL(MUSA_ERROR_INVALID_VALUE);
    API_END;
}
#endif

#ifndef OMIT_muMemAddressReserve
EXPORT MUresult muMemAddressReserve(MUdeviceptr *ptr, size_t size, size_t alignment, MUdeviceptr addr,
                                    unsigned long long flags) {
    (void)addr; /* a hint only, as in CUDA */
    API_BEGIN("muMemAddressReserve");
    REQUIRE_CTX();
    if (ptr == NULL || !granular(size) || flags != 0) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (alignment & (alignment - 1)) FAIL(MUSA_ERROR_INVALID_VALUE);
    struct reservation *slot = NULL;
    for (int i = 0; i < MAX_RESERVATIONS && !slot; i++)
        if (!g_res[i].live) slot = &g_res[i];
    if (slot == NULL) FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    size_t align = alignment > g_granularity ? alignment : g_granularity;
    size_t span = size + align;
    void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    uintptr_t base = (uintptr_t)p, start = (base + align - 1) / align * align;
    if (start > base) munmap(p, start - base);
    if (base + span > start + size) munmap((void *)(start + size), base + span - (start + size));
    slot->va = start;
    slot->size = size;
    slot->live = 1;
    *ptr = start;
    API_END;
}
#endif

#ifndef OMIT_muMemAddressFree
EXPORT MUresult muMemAddressFree(MUdeviceptr ptr, size_t size) {
    API_BEGIN("muMemAddressFree");
    REQUIRE_CTX();
    struct reservation *r = NULL;
    for (int i = 0; i < MAX_RESERVATIONS && !r; i++)
        if (g_res[i].live && g_res[i].va == ptr) r = &g_res[i];
    if (r == NULL || r->size != size) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (overlaps_mapping(r->va, r->size)) FAIL(MUSA_ERROR_INVALID_VALUE); /* still mapped */
    munmap((void *)r->va, r->size);
    r->live = 0;
    API_END;
}
#endif

#ifndef OMIT_muMemCreate
EXPORT MUresult muMemCreate(MUmemGenericAllocationHandle *handle, size_t size,
                            const MUmemAllocationProp *prop, unsigned long long flags) {
    API_BEGIN("muMemCreate");
    REQUIRE_CTX();
    if (handle == NULL || !granular(size) || flags != 0) FAIL(MUSA_ERROR_INVALID_VALUE);
    if ((rc = check_prop(prop)) != MUSA_SUCCESS) goto out;
    if (size > g_total - g_used) FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    int idx = -1;
    for (int i = 0; i < MAX_HANDLES && idx < 0; i++)
        if (!g_handles[i].live) idx = i;
    if (idx < 0) FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    int fd = (int)syscall(SYS_memfd_create, "libmusa_stub", 1u /* MFD_CLOEXEC */);
    if (fd < 0) FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    }
    g_handles[idx].fd = fd;
    g_handles[idx].size = size;
    g_handles[idx].live = 1;
    g_used += size;
    *handle = HANDLE_BASE + (MUmemGenericAllocationHandle)idx;
    API_END;
}
#endif

#ifndef OMIT_muMemRelease
EXPORT MUresult muMemRelease(MUmemGenericAllocationHandle handle) {
    API_BEGIN("muMemRelease");
    REQUIRE_CTX();
    struct handle *h = lookup_handle(handle);
    if (h == NULL) FAIL(MUSA_ERROR_INVALID_VALUE); /* unknown, or released already */
    close(h->fd); /* pages mapped elsewhere stay until unmapped, as on a device */
    g_used -= h->size;
    h->live = 0;
    API_END;
}
#endif

#ifndef OMIT_muMemMap
EXPORT MUresult muMemMap(MUdeviceptr ptr, size_t size, size_t offset, MUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
    API_BEGIN("muMemMap");
    REQUIRE_CTX();
    struct handle *h = lookup_handle(handle);
    if (h == NULL) FAIL(MUSA_ERROR_INVALID_HANDLE);
    if (flags != 0 || offset != 0 || !granular(size) || ptr % g_granularity) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (size > h->size) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (reservation_holding(ptr, size) == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (overlaps_mapping(ptr, size)) FAIL(MUSA_ERROR_ALREADY_MAPPED);
    struct mapping *m = NULL;
    for (int i = 0; i < MAX_MAPPINGS && !m; i++)
        if (!g_maps[i].live) m = &g_maps[i];
    if (m == NULL) FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    void *p = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0);
    if (p == MAP_FAILED) FAIL(MUSA_ERROR_OUT_OF_MEMORY);
    m->va = ptr;
    m->size = size;
    m->live = 1;
    API_END;
}
#endif

#ifndef OMIT_muMemUnmap
EXPORT MUresult muMemUnmap(MUdeviceptr ptr, size_t size) {
    API_BEGIN("muMemUnmap");
    REQUIRE_CTX();
    if (!granular(size) || ptr % g_granularity) FAIL(MUSA_ERROR_INVALID_VALUE);
    if (reservation_holding(ptr, size) == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
    /* The range must be exactly whole mappings: nothing unmapped, nothing cut. */
    for (uintptr_t pos = ptr; pos < ptr + size;) {
        struct mapping *m = mapping_at(pos);
        if (m == NULL || m->va + m->size > ptr + size) FAIL(MUSA_ERROR_INVALID_VALUE);
        pos += m->size;
    }
    void *p = mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) FAIL(MUSA_ERROR_UNKNOWN);
    for (uintptr_t pos = ptr; pos < ptr + size;) {
        struct mapping *m = mapping_at(pos);
        pos += m->size;
        m->live = 0;
    }
    API_END;
}
#endif

#ifndef OMIT_muMemSetAccess
EXPORT MUresult muMemSetAccess(MUdeviceptr ptr, size_t size, const MUmemAccessDesc *desc, size_t count) {
    API_BEGIN("muMemSetAccess");
    REQUIRE_CTX();
    if (desc == NULL || count == 0 || !granular(size) || ptr % g_granularity) FAIL(MUSA_ERROR_INVALID_VALUE);
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != LOCATION_TYPE_DEVICE) FAIL(MUSA_ERROR_INVALID_VALUE);
        if (!valid_device(desc[i].location.id)) FAIL(MUSA_ERROR_INVALID_DEVICE);
        if (desc[i].flags == ACCESS_READWRITE) prot |= PROT_READ | PROT_WRITE;
        else if (desc[i].flags == ACCESS_READ) prot |= PROT_READ;
        else if (desc[i].flags != ACCESS_NONE) FAIL(MUSA_ERROR_INVALID_VALUE);
    }
    for (uintptr_t pos = ptr; pos < ptr + size;) { /* every byte must be mapped */
        struct mapping *m = mapping_containing(pos);
        if (m == NULL) FAIL(MUSA_ERROR_INVALID_VALUE);
        pos = m->va + m->size;
    }
    if (mprotect((void *)ptr, size, prot) != 0) FAIL(MUSA_ERROR_UNKNOWN);
    API_END;
}
#endif

/* ------------------------------------------------------------------ test-only controls */

EXPORT void stub_reset(void) {
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_MAPPINGS; i++) g_maps[i].live = 0;
    for (int i = 0; i < MAX_RESERVATIONS; i++) {
        if (g_res[i].live) munmap((void *)g_res[i].va, g_res[i].size);
        g_res[i].live = 0;
    }
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (g_handles[i].live) close(g_handles[i].fd);
        g_handles[i].live = 0;
    }
    memset(g_ctx, 0, sizeof g_ctx);
    memset(g_fails, 0, sizeof g_fails);
    memset(g_counters, 0, sizeof g_counters);
    g_initialized = 0;
    g_device_count = 1;
    g_vmm_supported = 1;
    g_granularity = 64 * 1024;
    g_total = 256u * 1024 * 1024;
    g_used = 0;
    g_dlpack_deletes = 0;
    t_current = NULL;
    pthread_mutex_unlock(&g_lock);
}

/* The next call of function `name` returns `code` and does nothing else. */
EXPORT int stub_fail_next(const char *name, int code) {
    int ok = -1;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_FAILS && ok < 0; i++) {
        if (g_fails[i].name[0] == 0) {
            strncpy(g_fails[i].name, name, sizeof g_fails[i].name - 1);
            g_fails[i].code = code;
            ok = 0;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return ok;
}

EXPORT int stub_calls(const char *name) {
    int n = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < MAX_COUNTERS; i++)
        if (g_counters[i].name[0] && strcmp(g_counters[i].name, name) == 0) n = g_counters[i].calls;
    pthread_mutex_unlock(&g_lock);
    return n;
}

EXPORT void stub_set_device_count(int n) { g_device_count = n; }
EXPORT void stub_set_vmm_supported(int v) { g_vmm_supported = v; }
EXPORT void stub_set_granularity(size_t g) { g_granularity = g; }
EXPORT void stub_set_total_memory(size_t n) { g_total = n; }

static int count_live(const void *base, size_t n, size_t stride, size_t live_offset) {
    int c = 0;
    for (size_t i = 0; i < n; i++) c += *(const int *)((const char *)base + i * stride + live_offset);
    return c;
}

EXPORT int stub_live_reservations(void) {
    return count_live(g_res, MAX_RESERVATIONS, sizeof g_res[0], offsetof(struct reservation, live));
}
EXPORT int stub_live_handles(void) {
    return count_live(g_handles, MAX_HANDLES, sizeof g_handles[0], offsetof(struct handle, live));
}
EXPORT int stub_live_mappings(void) {
    return count_live(g_maps, MAX_MAPPINGS, sizeof g_maps[0], offsetof(struct mapping, live));
}
EXPORT int stub_ctx_refs(int dev) { return valid_device(dev) ? g_ctx[dev].refs : -1; }
EXPORT int stub_thread_has_context(void) { return t_current != NULL; }

/* The C compiler's view of the structures, in a fixed order the tests know. */
EXPORT int stub_layout(long *out, int n) {
    long v[] = {
        (long)sizeof(MUmemLocation),
        (long)offsetof(MUmemLocation, type),
        (long)offsetof(MUmemLocation, id),
        (long)sizeof(MUmemAllocationProp),
        (long)offsetof(MUmemAllocationProp, type),
        (long)offsetof(MUmemAllocationProp, requestedHandleTypes),
        (long)offsetof(MUmemAllocationProp, location),
        (long)offsetof(MUmemAllocationProp, win32HandleMetaData),
        (long)offsetof(MUmemAllocationProp, allocFlags),
        (long)offsetof(MUmemAllocationProp, allocFlags.compressionType),
        (long)offsetof(MUmemAllocationProp, allocFlags.gpuDirectRDMACapable),
        (long)offsetof(MUmemAllocationProp, allocFlags.usage),
        (long)offsetof(MUmemAllocationProp, allocFlags.reserved),
        (long)sizeof(MUmemAccessDesc),
        (long)offsetof(MUmemAccessDesc, location),
        (long)offsetof(MUmemAccessDesc, flags),
        (long)sizeof(MUdeviceptr),
        (long)sizeof(MUmemGenericAllocationHandle),
    };
    int count = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < count; i++) out[i] = v[i];
    return count;
}

/* A DLPack deleter that counts, so tests can see torch hand the descriptor back. */
EXPORT void stub_dlpack_deleter(void *managed) {
    pthread_mutex_lock(&g_lock);
    g_dlpack_deletes++;
    pthread_mutex_unlock(&g_lock);
    free(managed);
}
EXPORT int stub_dlpack_deletes(void) { return g_dlpack_deletes; }
