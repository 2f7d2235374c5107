/*
 * fakenvml.c: a fake libnvidia-ml.so.1 for testing gpu-supervisor without a GPU.
 *
 * The real pynvml (nvidia-ml-py) loads it through LD_LIBRARY_PATH. Every call answers from the
 * simulated-GPU world directory named by $GPU_SUPERVISOR_SIM_DIR (DESIGN.md section 7), as it
 * is when the call begins; the parsed world is cached and revalidated cheaply by each call
 * (see "The world cache" below):
 *
 *   gpus/<index>   one device, "key value" lines; missing keys take defaults ("hang_ms N":
 *                  every call about the device takes N ms, as with a hung driver; "cpus
 *                  0-7,16-23": the CPUs close to it, for nvmlDeviceGetCpuAffinity; "procs_race
 *                  N": the next N process-list calls with a buffer answer INSUFFICIENT_SIZE,
 *                  as when processes start between the count and the list)
 *   procs/<pid>    "<gpu uuid or index> <used_mib|na> [graphics|mps]" lines (a tag: the line
 *                  is in the graphics, or the MPS clients', process list instead of the
 *                  compute one); dead pids are ignored
 *   events         appended "<gpu index or uuid> <xid>" lines, delivered once each
 *   init_rc        optional: an NVML return code that nvmlInitWithFlags returns
 *   nvml           optional: "key value" lines for system-level state (driver_version,
 *                  nvml_version, cuda_driver_version, rc_<function>)
 *
 * A key "rc_<C symbol> <code>" in gpus/<index> (or in nvml, for calls that take no device)
 * makes that call fail with that code. An exact symbol wins; otherwise a key naming the
 * symbol without its "_vN" suffix applies to every version (rc_nvmlDeviceGetMemoryInfo fails
 * both nvmlDeviceGetMemoryInfo and nvmlDeviceGetMemoryInfo_v2).
 *
 * Struct layouts mirror the ctypes declarations in pynvml.py of nvidia-ml-py 13.615.71; the
 * static assertions below pin their sizes. See README.md next to this file.
 *
 * Compile-time variants (to exercise a backend's fallbacks; symbols cannot be hidden at run
 * time): -DFAKENVML_NO_PROCESSES_V3, -DFAKENVML_NO_MEMORY_V2, -DFAKENVML_NO_TEMPERATURE_V,
 * -DFAKENVML_NO_CLOCKS_EVENT_REASONS.
 *
 * Build: gcc -shared -fPIC -O2 -Wall -Wextra -Wl,-soname,libnvidia-ml.so.1 \
 *            -o <dir>/libnvidia-ml.so.1 fakenvml.c -lpthread
 */

#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------------------------------ */
/* NVML types and constants (values as in pynvml.py / nvml.h)                                  */
/* ------------------------------------------------------------------------------------------ */

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NVML_NO_INSTANCE_ID 0xFFFFFFFFu

#define NVML_TEMPERATURE_GPU 0u
#define NVML_TEMPERATURE_THRESHOLD_SHUTDOWN 0u
#define NVML_TEMPERATURE_THRESHOLD_SLOWDOWN 1u
#define NVML_TEMPERATURE_THRESHOLD_MEM_MAX 2u
#define NVML_TEMPERATURE_THRESHOLD_GPU_MAX 3u
#define NVML_TEMPERATURE_THRESHOLD_COUNT 8u

#define NVML_FI_DEV_TEMPERATURE_SHUTDOWN_TLIMIT 193u
#define NVML_FI_DEV_TEMPERATURE_SLOWDOWN_TLIMIT 194u
#define NVML_FI_DEV_TEMPERATURE_MEM_MAX_TLIMIT 195u
#define NVML_FI_DEV_TEMPERATURE_GPU_MAX_TLIMIT 196u
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230u

#define NVML_VALUE_TYPE_UNSIGNED_INT 1u
#define NVML_VALUE_TYPE_SIGNED_INT 5u

#define NVML_CLOCK_GRAPHICS 0u
#define NVML_CLOCK_SM 1u
#define NVML_CLOCK_MEM 2u
#define NVML_CLOCK_VIDEO 3u

#define nvmlEventTypeSingleBitEccError 0x1ULL
#define nvmlEventTypeDoubleBitEccError 0x2ULL
#define nvmlEventTypeXidCriticalError 0x8ULL
#define FAKE_SUPPORTED_EVENT_TYPES \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeXidCriticalError)

#define NVML_STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((ver) << 24u)))

#define MAX_DEVICES 64
#define MAX_EVENT_SETS 32
#define MAX_PROCS 1024
#define MAX_RC_KEYS 64
#define PATH_BUF 4096
#define MIB (1024ULL * 1024ULL)

/* Opaque handles: pointers into static arrays, so they stay valid and can be checked. */
struct nvmlDevice_st {
    unsigned int index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

struct nvmlEventSet_st {
    int in_use;
    long long cursor;                          /* byte offset in events already consumed */
    unsigned long long mask[MAX_DEVICES];      /* registered event types per device */
    long long registered_at[MAX_DEVICES];      /* events file size at registration */
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;

/* pynvml c_nvmlMemory_t */
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* pynvml c_nvmlMemory_v2_t; nvmlMemory_v2 = 0x02000028 */
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2u)

/* pynvml c_nvmlUtilization_t */
typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* pynvml c_nvmlTemperature_v1_t; nvmlTemperature_v1 = 0x0100000C */
typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_v1_t;
#define nvmlTemperature_v1 NVML_STRUCT_VERSION(nvmlTemperature_v1_t, 1u)

/* pynvml c_nvmlValue_t (a Union) */
typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

/* pynvml c_nvmlFieldValue_t */
typedef struct {
    uint32_t fieldId;
    uint32_t scopeId;
    int64_t timestamp;
    int64_t latencyUsec;
    unsigned int valueType;
    unsigned int nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

/* pynvml c_nvmlProcessInfo_v2_t (c_nvmlProcessInfo_v3_t is the same class) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* pynvml c_nvmlEventData_t */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* pynvml nvmlPciInfo_t (used by nvmlDeviceGetPciInfo_v3) */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(offsetof(nvmlMemory_v2_t, total) == 8, "nvmlMemory_v2_t padding");
_Static_assert(nvmlMemory_v2 == 0x02000028u, "nvmlMemory_v2");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12, "nvmlTemperature_v1_t");
_Static_assert(nvmlTemperature_v1 == 0x0100000Cu, "nvmlTemperature_v1");
_Static_assert(sizeof(nvmlValue_t) == 8, "nvmlValue_t");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t");
_Static_assert(offsetof(nvmlFieldValue_t, value) == 32, "nvmlFieldValue_t.value");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");

/* ------------------------------------------------------------------------------------------ */
/* Global state                                                                                */
/* ------------------------------------------------------------------------------------------ */

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards g_init_refcount */
static pthread_mutex_t g_event_lock = PTHREAD_MUTEX_INITIALIZER;  /* guards g_event_sets */
static pthread_mutex_t g_race_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards g_race */
static unsigned int g_init_refcount;
static struct nvmlDevice_st g_devices[MAX_DEVICES];
static struct nvmlEventSet_st g_event_sets[MAX_EVENT_SETS];

/* Per device: the "procs_race" value last seen, and how many calls it has failed since. */
static struct {
    unsigned int value;
    unsigned int failed;
} g_race[MAX_DEVICES];

static int is_initialized(void)
{
    pthread_mutex_lock(&g_init_lock);
    int initialized = g_init_refcount > 0;
    pthread_mutex_unlock(&g_init_lock);
    return initialized;
}

/* ------------------------------------------------------------------------------------------ */
/* World directory access                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* "<world>/<rel>" into buf; -1 when the world is unset or the path does not fit. */
static int world_path(char *buf, size_t size, const char *rel)
{
    const char *world = getenv("GPU_SUPERVISOR_SIM_DIR");
    if (world == NULL || world[0] == '\0')
        return -1;
    int n = snprintf(buf, size, "%s/%s", world, rel);
    return (n < 0 || (size_t)n >= size) ? -1 : 0;
}

static int world_is_dir(void)
{
    const char *world = getenv("GPU_SUPERVISOR_SIM_DIR");
    struct stat st;
    return world != NULL && world[0] != '\0' && stat(world, &st) == 0 && S_ISDIR(st.st_mode);
}

static long long file_size(const char *rel)
{
    char path[PATH_BUF];
    struct stat st;
    if (world_path(path, sizeof path, rel) != 0 || stat(path, &st) != 0)
        return 0;
    return (long long)st.st_size;
}

static char *trim(char *s)
{
    while (*s != '\0' && isspace((unsigned char)*s))
        s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    return s;
}

static int all_digits(const char *s)
{
    if (*s == '\0')
        return 0;
    for (; *s != '\0'; s++)
        if (!isdigit((unsigned char)*s))
            return 0;
    return 1;
}

/* Decimal, or hexadecimal with a 0x prefix. */
static int parse_u64(const char *s, unsigned long long *out)
{
    int base = 10;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        base = 16;
        s += 2;
    }
    if (*s == '\0' || *s == '-' || *s == '+')
        return -1;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno != 0 || end == s || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

/* A process's memory in MiB as the sim backend reads it (a whole number, hex, or a fraction
 * such as 1536.5), as bytes. -1 for anything else, negative, not finite or absurdly large. */
static int parse_mib_bytes(const char *s, unsigned long long *bytes)
{
    unsigned long long whole;
    if (parse_u64(s, &whole) == 0) {
        if (whole > (1ULL << 40))
            return -1;
        *bytes = whole * MIB;
        return 0;
    }
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !(v >= 0.0) || v > (double)(1ULL << 40))
        return -1;
    *bytes = (unsigned long long)(v * (double)MIB + 0.5);
    return 0;
}

static int parse_i64(const char *s, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

/* A "rc_<function> <code>" fault-injection key. */
struct rc_entry {
    char function[96];
    int code;
};

struct rc_table {
    int count;
    struct rc_entry entries[MAX_RC_KEYS];
};

static void rc_table_add(struct rc_table *table, const char *function, const char *value)
{
    long long code;
    if (table->count >= MAX_RC_KEYS || parse_i64(value, &code) != 0)
        return;
    struct rc_entry *e = &table->entries[table->count++];
    snprintf(e->function, sizeof e->function, "%s", function);
    e->code = (int)code;
}

/* Exact symbol first, then the symbol without its "_vN" suffix; 0 when no fault is set. */
static int rc_lookup(const struct rc_table *table, const char *function)
{
    for (int i = 0; i < table->count; i++)
        if (strcmp(table->entries[i].function, function) == 0)
            return table->entries[i].code;
    const char *suffix = strrchr(function, '_');
    if (suffix == NULL || suffix[1] != 'v' || !all_digits(suffix + 2))
        return 0;
    size_t base_len = (size_t)(suffix - function);
    for (int i = 0; i < table->count; i++)
        if (strlen(table->entries[i].function) == base_len
            && strncmp(table->entries[i].function, function, base_len) == 0)
            return table->entries[i].code;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Key/value files: gpus/<index> and nvml                                                      */
/* ------------------------------------------------------------------------------------------ */

enum kv_type { KV_STR, KV_U32, KV_I32, KV_U64 };

struct kv_field {
    const char *key;
    enum kv_type type;
    size_t offset;
    size_t size;
};

#define KV_FIELD(key, type, st, member) \
    { key, type, offsetof(st, member), sizeof(((st *)0)->member) }

/* Parse the "key value" lines of f into a struct described by fields; "rc_*" keys go to rc. */
static void parse_kv_stream(FILE *f, const struct kv_field *fields, size_t n_fields,
                            void *target, struct rc_table *rc)
{
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) >= 0) {
        char *key = trim(line);
        if (*key == '\0' || *key == '#')
            continue;
        char *value = key;
        while (*value != '\0' && !isspace((unsigned char)*value))
            value++;
        if (*value != '\0')
            *value++ = '\0';
        value = trim(value);
        if (strncmp(key, "rc_", 3) == 0) {
            if (rc != NULL)
                rc_table_add(rc, key + 3, value);
            continue;
        }
        for (size_t i = 0; i < n_fields; i++) {
            if (strcmp(fields[i].key, key) != 0)
                continue;
            char *slot = (char *)target + fields[i].offset;
            unsigned long long u;
            long long s;
            switch (fields[i].type) {
            case KV_STR:
                snprintf(slot, fields[i].size, "%s", value);
                break;
            case KV_U32:
                if (parse_u64(value, &u) == 0 && u <= 0xFFFFFFFFULL)
                    *(unsigned int *)(void *)slot = (unsigned int)u;
                break;
            case KV_I32:
                if (parse_i64(value, &s) == 0 && s >= -2147483647LL && s <= 2147483647LL)
                    *(int *)(void *)slot = (int)s;
                break;
            case KV_U64:
                if (parse_u64(value, &u) == 0)
                    *(unsigned long long *)(void *)slot = u;
                break;
            }
            break;
        }
    }
    free(line);
}

struct device_info {
    unsigned int index;
    char uuid[96];
    char name[96];
    unsigned long long memory_total_mib;
    unsigned long long memory_base_mib;
    unsigned long long memory_reserved_mib;
    int temperature_c;
    unsigned int temperature_slowdown_c;
    unsigned int temperature_shutdown_c;
    unsigned int temperature_gpu_max_c;
    unsigned int utilization_percent;
    unsigned int memory_utilization_percent;
    unsigned int power_mw;
    unsigned int power_limit_mw;
    unsigned long long clocks_event_reasons;
    unsigned int encoder_percent;
    unsigned int decoder_percent;
    unsigned int clock_graphics_mhz;
    unsigned int clock_sm_mhz;
    unsigned int clock_mem_mhz;
    unsigned int clock_video_mhz;
    unsigned long long ecc_corrected;
    unsigned long long ecc_uncorrected;
    unsigned int remapped_rows_correctable;
    unsigned int remapped_rows_uncorrectable;
    unsigned int remapped_rows_pending;
    unsigned int remapped_rows_failure;
    unsigned int recovery_action; /* field 230, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION */
    unsigned int retired_pages_pending;
    unsigned int lost;
    unsigned int hang_ms; /* every call about this device takes this long (a hung driver) */
    /* the process list grows between NVML's two calls: that many calls with a buffer answer
       INSUFFICIENT_SIZE (counted again each time the value changes) */
    unsigned int procs_race;
    char cpus[512];       /* the CPUs close to it, a CPU list ("0-7,16-23"); "": not known */
    struct rc_table rc;
};

static const struct kv_field DEVICE_FIELDS[] = {
    KV_FIELD("uuid", KV_STR, struct device_info, uuid),
    KV_FIELD("name", KV_STR, struct device_info, name),
    KV_FIELD("memory_total_mib", KV_U64, struct device_info, memory_total_mib),
    KV_FIELD("memory_base_mib", KV_U64, struct device_info, memory_base_mib),
    KV_FIELD("memory_reserved_mib", KV_U64, struct device_info, memory_reserved_mib),
    KV_FIELD("temperature_c", KV_I32, struct device_info, temperature_c),
    KV_FIELD("temperature_slowdown_c", KV_U32, struct device_info, temperature_slowdown_c),
    KV_FIELD("temperature_shutdown_c", KV_U32, struct device_info, temperature_shutdown_c),
    KV_FIELD("temperature_gpu_max_c", KV_U32, struct device_info, temperature_gpu_max_c),
    KV_FIELD("utilization_percent", KV_U32, struct device_info, utilization_percent),
    KV_FIELD("memory_utilization_percent", KV_U32, struct device_info,
             memory_utilization_percent),
    KV_FIELD("power_mw", KV_U32, struct device_info, power_mw),
    KV_FIELD("power_limit_mw", KV_U32, struct device_info, power_limit_mw),
    KV_FIELD("clocks_event_reasons", KV_U64, struct device_info, clocks_event_reasons),
    KV_FIELD("encoder_percent", KV_U32, struct device_info, encoder_percent),
    KV_FIELD("decoder_percent", KV_U32, struct device_info, decoder_percent),
    KV_FIELD("clock_graphics_mhz", KV_U32, struct device_info, clock_graphics_mhz),
    KV_FIELD("clock_sm_mhz", KV_U32, struct device_info, clock_sm_mhz),
    KV_FIELD("clock_mem_mhz", KV_U32, struct device_info, clock_mem_mhz),
    KV_FIELD("clock_video_mhz", KV_U32, struct device_info, clock_video_mhz),
    KV_FIELD("ecc_corrected", KV_U64, struct device_info, ecc_corrected),
    KV_FIELD("ecc_uncorrected", KV_U64, struct device_info, ecc_uncorrected),
    KV_FIELD("remapped_rows_correctable", KV_U32, struct device_info, remapped_rows_correctable),
    KV_FIELD("remapped_rows_uncorrectable", KV_U32, struct device_info,
             remapped_rows_uncorrectable),
    KV_FIELD("remapped_rows_pending", KV_U32, struct device_info, remapped_rows_pending),
    KV_FIELD("remapped_rows_failure", KV_U32, struct device_info, remapped_rows_failure),
    KV_FIELD("recovery_action", KV_U32, struct device_info, recovery_action),
    KV_FIELD("retired_pages_pending", KV_U32, struct device_info, retired_pages_pending),
    KV_FIELD("lost", KV_U32, struct device_info, lost),
    KV_FIELD("hang_ms", KV_U32, struct device_info, hang_ms),
    KV_FIELD("procs_race", KV_U32, struct device_info, procs_race),
    KV_FIELD("cpus", KV_STR, struct device_info, cpus),
};

static void device_defaults(struct device_info *d, unsigned int index)
{
    memset(d, 0, sizeof *d);
    d->index = index;
    snprintf(d->uuid, sizeof d->uuid, "GPU-00000000-0000-0000-0000-%012u", index);
    snprintf(d->name, sizeof d->name, "Simulated GPU");
    d->memory_total_mib = 81920;
    d->temperature_c = 40;
    d->temperature_slowdown_c = 87;
    d->temperature_shutdown_c = 92;
    d->temperature_gpu_max_c = 85;
    d->power_mw = 60000;
    d->power_limit_mw = 700000;
    d->clock_graphics_mhz = 1980;
    d->clock_sm_mhz = 1980;
    d->clock_mem_mhz = 2619;
    d->clock_video_mhz = 1755;
}

struct system_info {
    char driver_version[80];
    char nvml_version[80];
    int cuda_driver_version;
    struct rc_table rc;
};

static const struct kv_field SYSTEM_FIELDS[] = {
    KV_FIELD("driver_version", KV_STR, struct system_info, driver_version),
    KV_FIELD("nvml_version", KV_STR, struct system_info, nvml_version),
    KV_FIELD("cuda_driver_version", KV_I32, struct system_info, cuda_driver_version),
};

/* ------------------------------------------------------------------------------------------ */
/* Processes: procs/<pid>                                                                      */
/* ------------------------------------------------------------------------------------------ */

enum proc_kind { PROC_COMPUTE = 0, PROC_GRAPHICS = 1, PROC_MPS = 2, PROC_ANY = 3 };

struct proc_entry {
    unsigned int pid;
    unsigned long long used_bytes;
    int known;                                  /* some line gave a number (not "na") */
};

/*
 * The slow liveness test, used where pidfds are not available: kill(pid, 0) does not say ESRCH
 * and /proc/<pid>/stat does not show a zombie (Z) or a dead (X) task.
 */
static int pid_alive_slow(unsigned long long pid)
{
    if (pid == 0 || pid > 0x7FFFFFFFULL)
        return 0;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/%llu/stat", pid);
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 1;
    char buf[512];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');
    if (paren != NULL && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'))
        return 0;
    return 1;
}

static int compare_pid(const void *a, const void *b)
{
    unsigned int x = ((const struct proc_entry *)a)->pid;
    unsigned int y = ((const struct proc_entry *)b)->pid;
    return (x > y) - (x < y);
}

/* ------------------------------------------------------------------------------------------ */
/* The world cache                                                                             */
/* ------------------------------------------------------------------------------------------ */

/*
 * The parsed world is cached here, under g_world_lock, and revalidated by every call, so that
 * a call never answers from a stale cache (README.md, "How the world is read"):
 *
 * - An inotify instance watches the world directory, gpus/ and procs/. Each call first drains
 *   it; an event on gpus/, procs/ or nvml starts a new epoch (without inotify, every call is a
 *   new epoch). The kernel queues an event inside the writer's own system call, so a change
 *   whose write, rename or unlink returned before a call began is always seen by that call.
 * - Each cached item (the gpus/ device count, the procs/ listing, one file's parsed content) is
 *   checked at most once per epoch: stat() its path and compare device, inode, mode, size,
 *   mtime and ctime with those of the read the cache holds. It is read again when they differ,
 *   or when that read was "racy": its mtime or ctime was not older than RACY_WINDOW_NS when the
 *   call began (timestamps come from a coarse clock, so a change in the same tick as the read
 *   could leave them unchanged). Git's index uses the same rule.
 * - A file reached through a symlink or with more than one hard link is checked at every
 *   access: a change made through another path raises no event in the watched directories.
 * - The liveness of the pids in procs/ is evaluated at every call (procs_liveness).
 */

#define RACY_WINDOW_NS (20LL * 1000000LL)
#define RACY_WINDOW_COARSE_NS (2LL * 1000000000LL) /* whole-second timestamps (FAT, ext3) */
#define PIDFD_MAX 1024
#define WATCH_MASK                                                                           \
    (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_CREATE | IN_DELETE | IN_MOVED_FROM          \
     | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
#define WATCH_GONE (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_UNMOUNT)

#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL /* Linux 6.9: the pidfd reports the exit of that thread itself */
#endif

enum slot_state { SLOT_UNREAD = 0, SLOT_MISSING, SLOT_PRESENT };

/* What the cache knows about one file or directory it has read. */
struct slot {
    enum slot_state state;
    int racy;                    /* its timestamps were too recent to trust: re-read */
    int always_check;            /* symlink or hard link: check at every access */
    unsigned long long checked;  /* epoch of the last check */
    dev_t dev;
    ino_t ino;
    mode_t mode;
    off_t size;
    struct timespec mtime, ctime;
};

struct cached_device {
    struct slot slot;
    struct device_info info;     /* valid when slot.state == SLOT_PRESENT */
};

/* One valid line of a procs/<pid> file. */
struct proc_line {
    char *ref;                   /* the device as written: UUID or index */
    int ref_is_index;
    unsigned long long ref_index;
    enum proc_kind kind;
    int known;                   /* a number of MiB, not "na" */
    unsigned long long bytes;    /* that number (fractions allowed), in bytes */
};

struct cached_proc {
    char *name;                  /* file name in procs/: all digits */
    unsigned long long pid;
    struct slot slot;
    struct proc_line *lines;
    size_t n_lines;
    int pidfd;                   /* -1, or a pidfd of the process that had pid when opened */
    int alive;                   /* liveness in the current call; -1 while undecided */
    int taken;                   /* scratch for procs_check */
};

enum pidfd_mode { PIDFD_ON = 0, PIDFD_OFF };

static pthread_mutex_t g_world_lock = PTHREAD_MUTEX_INITIALIZER; /* guards g_world */

static struct {
    int reset_needed;            /* first use, after the last shutdown, in a forked child */
    char root[PATH_BUF];         /* the $GPU_SUPERVISOR_SIM_DIR the cache holds */
    int have_root;
    unsigned long long epoch;
    long long t0_ns;             /* CLOCK_REALTIME when the current call began reading */
    int inotify_fd;              /* -1: no watches; every call is then a new epoch */
    int wd_root, wd_gpus, wd_procs;
    struct slot gpus_dir;
    unsigned int gpus_count;
    struct cached_device devices[MAX_DEVICES];
    struct slot system_slot;
    struct system_info system;
    struct slot procs_dir;
    struct cached_proc *procs;   /* sorted by name */
    size_t n_procs;
    struct pollfd *pollfds;
    size_t *poll_index;
    size_t poll_cap;
    enum pidfd_mode pidfd_mode;
    unsigned int pidfd_flags;
    size_t n_pidfds, pidfd_cap;
} g_world = {.reset_needed = 1, .inotify_fd = -1, .wd_root = -1, .wd_gpus = -1, .wd_procs = -1};

static long long ts_ns(const struct timespec *ts)
{
    return (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec;
}

static int env_set(const char *name)
{
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0';
}

/* Record the identity of what a (re-)read of the slot's file or directory found. */
static void slot_record(struct slot *s, const struct stat *st)
{
    long long window = (st->st_mtim.tv_nsec == 0 && st->st_ctim.tv_nsec == 0)
                           ? RACY_WINDOW_COARSE_NS
                           : RACY_WINDOW_NS;
    s->state = SLOT_PRESENT;
    s->dev = st->st_dev;
    s->ino = st->st_ino;
    s->mode = st->st_mode;
    s->size = st->st_size;
    s->mtime = st->st_mtim;
    s->ctime = st->st_ctim;
    s->racy = ts_ns(&st->st_mtim) >= g_world.t0_ns - window
              || ts_ns(&st->st_ctim) >= g_world.t0_ns - window;
    s->always_check = 0;
    s->checked = g_world.epoch;
}

static void slot_missing(struct slot *s)
{
    memset(s, 0, sizeof *s);
    s->state = SLOT_MISSING;
    s->checked = g_world.epoch;
}

static int slot_matches(const struct slot *s, const struct stat *st)
{
    return s->dev == st->st_dev && s->ino == st->st_ino && s->mode == st->st_mode
           && s->size == st->st_size && s->mtime.tv_sec == st->st_mtim.tv_sec
           && s->mtime.tv_nsec == st->st_mtim.tv_nsec && s->ctime.tv_sec == st->st_ctim.tv_sec
           && s->ctime.tv_nsec == st->st_ctim.tv_nsec;
}

/* Whether the slot must be checked by this call. */
static int slot_due(const struct slot *s)
{
    return s->state == SLOT_UNREAD || s->checked != g_world.epoch || s->always_check;
}

/* 1 when the slot's file must be read again; 0 when what the cache holds is still current. */
static int slot_stale(struct slot *s, const char *path)
{
    if (!slot_due(s))
        return 0;
    struct stat st;
    if (stat(path, &st) != 0) {
        if (s->state != SLOT_MISSING)
            return 1;
        s->checked = g_world.epoch;  /* still missing */
        return 0;
    }
    if (s->state != SLOT_PRESENT || s->racy || !slot_matches(s, &st))
        return 1;
    s->checked = g_world.epoch;
    return 0;
}

/* Open the slot's file for a re-read and record what was opened; NULL when it is missing. */
static FILE *slot_open(struct slot *s, const char *path)
{
    FILE *f = fopen(path, "re");
    if (f == NULL) {
        slot_missing(s);
        return NULL;
    }
    struct stat st, lst;
    if (fstat(fileno(f), &st) == 0) {
        slot_record(s, &st);
    } else {
        memset(&st, 0, sizeof st);
        slot_record(s, &st);
        s->racy = 1;
    }
    s->always_check = st.st_nlink != 1 || lstat(path, &lst) != 0 || S_ISLNK(lst.st_mode);
    return f;
}

/* ----- inotify ----- */

static void watch_close(void)
{
    if (g_world.inotify_fd >= 0)
        close(g_world.inotify_fd);
    g_world.inotify_fd = -1;
    g_world.wd_root = g_world.wd_gpus = g_world.wd_procs = -1;
}

/* Watch <root>/<name> if it is a directory; 0 on an error that makes watching unreliable. */
static int watch_subdir(int fd, const char *name, int *wd)
{
    char path[PATH_BUF];
    int n = snprintf(path, sizeof path, "%s/%s", g_world.root, name);
    if (n < 0 || (size_t)n >= sizeof path)
        return 0;
    *wd = inotify_add_watch(fd, path, WATCH_MASK);
    return *wd >= 0 || errno == ENOENT || errno == ENOTDIR;
}

/* (Re)create the watches; on any failure the cache runs without them. */
static void watch_open(void)
{
    watch_close();
    if (!g_world.have_root || env_set("FAKENVML_NO_INOTIFY"))
        return;
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0)
        return;
    int wd_root = inotify_add_watch(fd, g_world.root, WATCH_MASK);
    int wd_gpus = -1, wd_procs = -1;
    if (wd_root < 0 || !watch_subdir(fd, "gpus", &wd_gpus)
        || !watch_subdir(fd, "procs", &wd_procs)) {
        close(fd);
        return;
    }
    g_world.inotify_fd = fd;
    g_world.wd_root = wd_root;
    g_world.wd_gpus = wd_gpus;
    g_world.wd_procs = wd_procs;
}

/* Consume the queued events: any event starts a new epoch; some need new watches. */
static void watch_drain(void)
{
    if (g_world.inotify_fd < 0) {
        g_world.epoch++;
        return;
    }
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    int changed = 0, rewatch = 0;
    for (;;) {
        ssize_t n = read(g_world.inotify_fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        if (n <= 0) {
            rewatch = 1;
            break;
        }
        for (char *p = buf; p < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)(void *)p;
            p += sizeof *ev + ev->len;
            if ((ev->mask & IN_Q_OVERFLOW) || ev->wd < 0) {
                changed = 1;  /* events were lost: the new epoch re-checks everything */
            } else if (ev->wd == g_world.wd_root) {
                /* In the world directory itself only gpus, procs and nvml are cached */
                if ((ev->mask & WATCH_GONE) || ev->len == 0)
                    rewatch = 1;
                else if (strcmp(ev->name, "gpus") == 0 || strcmp(ev->name, "procs") == 0)
                    rewatch = 1;
                else if (strcmp(ev->name, "nvml") == 0)
                    changed = 1;
            } else {
                changed = 1;
                if ((ev->wd == g_world.wd_gpus || ev->wd == g_world.wd_procs)
                    && (ev->mask & WATCH_GONE))
                    rewatch = 1;
            }
        }
    }
    if (rewatch)
        watch_open();
    if (changed || rewatch)
        g_world.epoch++;
}

/* ----- reset, call bracket, fork ----- */

static void proc_free_lines(struct cached_proc *p)
{
    for (size_t i = 0; i < p->n_lines; i++)
        free(p->lines[i].ref);
    free(p->lines);
    p->lines = NULL;
    p->n_lines = 0;
}

static void proc_free(struct cached_proc *p)
{
    if (p->pidfd >= 0) {
        close(p->pidfd);
        g_world.n_pidfds--;
    }
    p->pidfd = -1;
    proc_free_lines(p);
    free(p->name);
    p->name = NULL;
}

static void procs_clear(void)
{
    for (size_t i = 0; i < g_world.n_procs; i++)
        proc_free(&g_world.procs[i]);
    free(g_world.procs);
    g_world.procs = NULL;
    g_world.n_procs = 0;
}

/* Drop everything cached and close the cache's descriptors. Call with g_world_lock held. */
static void world_reset(void)
{
    watch_close();
    procs_clear();
    free(g_world.pollfds);
    free(g_world.poll_index);
    g_world.pollfds = NULL;
    g_world.poll_index = NULL;
    g_world.poll_cap = 0;
    g_world.n_pidfds = 0;
    memset(&g_world.gpus_dir, 0, sizeof g_world.gpus_dir);
    memset(&g_world.procs_dir, 0, sizeof g_world.procs_dir);
    memset(&g_world.system_slot, 0, sizeof g_world.system_slot);
    for (int i = 0; i < MAX_DEVICES; i++)
        memset(&g_world.devices[i].slot, 0, sizeof g_world.devices[i].slot);
    g_world.gpus_count = 0;
    g_world.have_root = 0;
    g_world.root[0] = '\0';
}

/* Start of a call that reads the world: lock, follow the environment, drain the watches. */
static void world_begin(void)
{
    pthread_mutex_lock(&g_world_lock);
    const char *env = getenv("GPU_SUPERVISOR_SIM_DIR");
    if (env == NULL)
        env = "";
    if (g_world.reset_needed || !g_world.have_root || strcmp(env, g_world.root) != 0) {
        world_reset();
        g_world.reset_needed = 0;
        size_t len = strlen(env);
        if (len > 0 && len < sizeof g_world.root) {
            memcpy(g_world.root, env, len + 1);
            g_world.have_root = 1;
        }
        g_world.pidfd_mode = env_set("FAKENVML_NO_PIDFD") ? PIDFD_OFF : PIDFD_ON;
        g_world.pidfd_flags = PIDFD_THREAD;
        g_world.pidfd_cap = PIDFD_MAX;
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
            && rl.rlim_cur / 4 < (rlim_t)g_world.pidfd_cap)
            g_world.pidfd_cap = (size_t)(rl.rlim_cur / 4);
        watch_open();
        g_world.epoch++;
    } else {
        watch_drain();
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    g_world.t0_ns = ts_ns(&ts);
}

static void world_end(void)
{
    pthread_mutex_unlock(&g_world_lock);
}

/*
 * fork(): the child must not drain the parent's inotify queue (they would share it), so it
 * starts afresh. The lock is held across fork so that the child's copy is consistent.
 */
static void world_atfork_prepare(void)
{
    pthread_mutex_lock(&g_world_lock);
}

static void world_atfork_parent(void)
{
    pthread_mutex_unlock(&g_world_lock);
}

static void world_atfork_child(void)
{
    g_world.reset_needed = 1;  /* its first call closes the inherited descriptors */
    pthread_mutex_unlock(&g_world_lock);
}

__attribute__((constructor)) static void fakenvml_constructor(void)
{
    pthread_atfork(world_atfork_prepare, world_atfork_parent, world_atfork_child);
}

/* ----- devices and the nvml file ----- */

/* Devices are gpus/0, gpus/1, ... up to the first missing index (each a regular file). */
static unsigned int world_device_count(void)
{
    struct slot *s = &g_world.gpus_dir;
    if (!slot_due(s))
        return g_world.gpus_count;
    char path[PATH_BUF];
    struct stat st;
    int n = snprintf(path, sizeof path, "%s/gpus", g_world.root);
    if (!g_world.have_root || n < 0 || (size_t)n >= sizeof path || stat(path, &st) != 0) {
        slot_missing(s);
        g_world.gpus_count = 0;
        return 0;
    }
    if (s->state == SLOT_PRESENT && !s->racy && slot_matches(s, &st)) {
        s->checked = g_world.epoch;
        return g_world.gpus_count;
    }
    slot_record(s, &st);
    unsigned int count = 0;
    while (count < MAX_DEVICES) {
        char file[PATH_BUF];
        struct stat fst;
        n = snprintf(file, sizeof file, "%s/gpus/%u", g_world.root, count);
        if (n < 0 || (size_t)n >= sizeof file || lstat(file, &fst) != 0)
            break;
        if (S_ISLNK(fst.st_mode)) {
            s->always_check = 1;  /* its target may change with no event in gpus/ */
            if (stat(file, &fst) != 0)
                break;
        }
        if (!S_ISREG(fst.st_mode))
            break;
        count++;
    }
    g_world.gpus_count = count;
    return count;
}

/* Device index's parsed gpus/<index>, or NULL when it is not a present device. */
static const struct device_info *world_device(unsigned int index)
{
    if (index >= world_device_count())
        return NULL;
    struct cached_device *d = &g_world.devices[index];
    if (slot_due(&d->slot)) {
        char path[PATH_BUF];
        int n = snprintf(path, sizeof path, "%s/gpus/%u", g_world.root, index);
        if (n < 0 || (size_t)n >= sizeof path)
            return NULL;
        if (slot_stale(&d->slot, path)) {
            device_defaults(&d->info, index);
            FILE *f = slot_open(&d->slot, path);
            if (f != NULL) {
                parse_kv_stream(f, DEVICE_FIELDS, sizeof DEVICE_FIELDS / sizeof DEVICE_FIELDS[0],
                                &d->info, &d->info.rc);
                fclose(f);
            }
        }
    }
    return d->slot.state == SLOT_PRESENT ? &d->info : NULL;
}

static void system_defaults(struct system_info *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->driver_version, sizeof out->driver_version, "580.65.06");
    snprintf(out->nvml_version, sizeof out->nvml_version, "13.580.65.06");
    out->cuda_driver_version = 13000;
}

/* The optional world file "nvml" (system-level state and faults), defaults when missing. */
static const struct system_info *world_system(void)
{
    struct slot *s = &g_world.system_slot;
    char path[PATH_BUF];
    int n = snprintf(path, sizeof path, "%s/nvml", g_world.root);
    if (!g_world.have_root || n < 0 || (size_t)n >= sizeof path) {
        system_defaults(&g_world.system);
        slot_missing(s);
    } else if (slot_stale(s, path)) {
        system_defaults(&g_world.system);
        FILE *f = slot_open(s, path);
        if (f != NULL) {
            parse_kv_stream(f, SYSTEM_FIELDS, sizeof SYSTEM_FIELDS / sizeof SYSTEM_FIELDS[0],
                            &g_world.system, &g_world.system.rc);
            fclose(f);
        }
    }
    return &g_world.system;
}

static void read_system(struct system_info *out)
{
    world_begin();
    *out = *world_system();
    world_end();
}

static int system_rc(const char *function)
{
    world_begin();
    int rc = rc_lookup(&world_system()->rc, function);
    world_end();
    return rc;
}

/* ----- procs/ ----- */

static int compare_proc_name(const void *a, const void *b)
{
    return strcmp(((const struct cached_proc *)a)->name, ((const struct cached_proc *)b)->name);
}

/* The procs/ listing: re-read (keeping the entries of names still there) when it changed. */
static void procs_check(void)
{
    struct slot *s = &g_world.procs_dir;
    if (!slot_due(s))
        return;
    char path[PATH_BUF];
    struct stat st;
    int n = snprintf(path, sizeof path, "%s/procs", g_world.root);
    if (!g_world.have_root || n < 0 || (size_t)n >= sizeof path) {
        procs_clear();
        slot_missing(s);
        return;
    }
    if (stat(path, &st) == 0 && s->state == SLOT_PRESENT && !s->racy && slot_matches(s, &st)) {
        s->checked = g_world.epoch;
        return;
    }
    DIR *dir = opendir(path);
    if (dir == NULL) {
        procs_clear();
        slot_missing(s);
        return;
    }
    if (fstat(dirfd(dir), &st) == 0) {
        slot_record(s, &st);
    } else {
        memset(&st, 0, sizeof st);
        slot_record(s, &st);
        s->racy = 1;
    }
    struct cached_proc *fresh = NULL;
    size_t count = 0, cap = 0;
    for (size_t i = 0; i < g_world.n_procs; i++)
        g_world.procs[i].taken = 0;
    struct dirent *ent;
    while ((ent = readdir(dir)) != NULL) {
        unsigned long long pid;
        if (!all_digits(ent->d_name) || parse_u64(ent->d_name, &pid) != 0 || pid > 0xFFFFFFFFULL)
            continue;
        if (count == cap) {
            size_t grown = cap == 0 ? 64 : cap * 2;
            struct cached_proc *bigger = realloc(fresh, grown * sizeof *fresh);
            if (bigger == NULL) {
                s->racy = 1;  /* incomplete: list again next time */
                break;
            }
            fresh = bigger;
            cap = grown;
        }
        struct cached_proc key;
        key.name = ent->d_name;
        struct cached_proc *old =
            g_world.n_procs == 0 ? NULL
                                 : bsearch(&key, g_world.procs, g_world.n_procs,
                                           sizeof *g_world.procs, compare_proc_name);
        if (old != NULL) {
            old->taken = 1;
            fresh[count++] = *old;
            continue;
        }
        struct cached_proc *p = &fresh[count];
        memset(p, 0, sizeof *p);
        p->name = strdup(ent->d_name);
        if (p->name == NULL) {
            s->racy = 1;
            break;
        }
        p->pid = pid;
        p->pidfd = -1;
        count++;
    }
    closedir(dir);
    for (size_t i = 0; i < g_world.n_procs; i++)
        if (!g_world.procs[i].taken)
            proc_free(&g_world.procs[i]);
    free(g_world.procs);
    g_world.procs = fresh;
    g_world.n_procs = count;
    if (count > 1)
        qsort(fresh, count, sizeof *fresh, compare_proc_name);
}

static int pidfd_open_syscall(pid_t pid, unsigned int flags)
{
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, flags);
#else
    (void)pid;
    (void)flags;
    errno = ENOSYS;
    return -1;
#endif
}

/*
 * Liveness of an entry that holds no pidfd: 1 alive, 0 dead (gone, or a zombie). Keeps a pidfd
 * of a live process, so that later calls test it with one poll() for all entries.
 */
static int proc_probe(struct cached_proc *p)
{
    if (p->pid == 0 || p->pid > 0x7FFFFFFFULL)
        return 0;
    pid_t pid = (pid_t)p->pid;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    if (g_world.pidfd_mode == PIDFD_ON && g_world.n_pidfds < g_world.pidfd_cap) {
        int fd = pidfd_open_syscall(pid, g_world.pidfd_flags);
        if (fd < 0 && errno == EINVAL && g_world.pidfd_flags != 0) {
            g_world.pidfd_flags = 0;  /* a kernel before 6.9, without PIDFD_THREAD */
            fd = pidfd_open_syscall(pid, 0);
        }
        if (fd >= 0) {
            struct pollfd pfd = {fd, POLLIN, 0};
            int r;
            do
                r = poll(&pfd, 1, 0);
            while (r < 0 && errno == EINTR);
            if (r == 0) {
                p->pidfd = fd;
                g_world.n_pidfds++;
                return 1;
            }
            close(fd);
            if (r > 0)
                return 0;  /* it has exited: a zombie not yet reaped */
        } else if (errno == ESRCH) {
            return 0;
        } else if (errno == ENOSYS || errno == EPERM || errno == EACCES) {
            g_world.pidfd_mode = PIDFD_OFF;  /* no pidfds here (old kernel, seccomp) */
        }
    }
    return pid_alive_slow(p->pid);
}

/*
 * Decide every entry's liveness for this call. Entries holding a pidfd are tested together by
 * one poll(): a pidfd becomes readable when its process exits, and while it has not, that
 * process still holds the pid. A readable one is closed and the pid probed afresh (it may be a
 * zombie, gone, or another process by now).
 */
static void procs_liveness(void)
{
    size_t n = g_world.n_procs, k = 0;
    if (n > g_world.poll_cap) {
        struct pollfd *fds = realloc(g_world.pollfds, n * sizeof *fds);
        if (fds != NULL)
            g_world.pollfds = fds;
        size_t *index = realloc(g_world.poll_index, n * sizeof *index);
        if (index != NULL)
            g_world.poll_index = index;
        if (fds != NULL && index != NULL)
            g_world.poll_cap = n;
    }
    for (size_t i = 0; i < n; i++) {
        struct cached_proc *p = &g_world.procs[i];
        p->alive = -1;
        if (p->pidfd < 0)
            continue;
        if (k < g_world.poll_cap) {
            g_world.pollfds[k].fd = p->pidfd;
            g_world.pollfds[k].events = POLLIN;
            g_world.pollfds[k].revents = 0;
            g_world.poll_index[k++] = i;
        } else {
            p->alive = pid_alive_slow(p->pid);
        }
    }
    if (k > 0) {
        int r;
        do
            r = poll(g_world.pollfds, (nfds_t)k, 0);
        while (r < 0 && errno == EINTR);
        for (size_t j = 0; j < k; j++) {
            struct cached_proc *p = &g_world.procs[g_world.poll_index[j]];
            if (r < 0) {
                p->alive = pid_alive_slow(p->pid);
            } else if (g_world.pollfds[j].revents == 0) {
                p->alive = 1;
            } else {
                close(p->pidfd);
                p->pidfd = -1;
                g_world.n_pidfds--;
            }
        }
    }
    for (size_t i = 0; i < n; i++)
        if (g_world.procs[i].alive < 0)
            g_world.procs[i].alive = proc_probe(&g_world.procs[i]);
}

/* Re-read one procs/<pid> file, keeping its valid lines. */
static void proc_reread(struct cached_proc *p, const char *path)
{
    proc_free_lines(p);
    FILE *f = slot_open(&p->slot, path);
    if (f == NULL)
        return;
    size_t cap = 0;
    char *line = NULL;
    size_t line_cap = 0;
    while (getline(&line, &line_cap, f) >= 0) {
        char *save = NULL;
        char *ref = strtok_r(line, " \t\r\n", &save);
        char *mem = strtok_r(NULL, " \t\r\n", &save);
        char *tag = strtok_r(NULL, " \t\r\n", &save);
        unsigned long long bytes = 0;
        int known;
        if (ref == NULL || ref[0] == '#' || mem == NULL)
            continue;
        if (strcmp(mem, "na") == 0)
            known = 0;
        else if (parse_mib_bytes(mem, &bytes) == 0)
            known = 1;
        else
            continue;
        if (p->n_lines == cap) {
            size_t grown = cap == 0 ? 4 : cap * 2;
            struct proc_line *bigger = realloc(p->lines, grown * sizeof *bigger);
            if (bigger == NULL) {
                p->slot.racy = 1;  /* incomplete: read again next time */
                break;
            }
            p->lines = bigger;
            cap = grown;
        }
        struct proc_line *l = &p->lines[p->n_lines];
        l->ref = strdup(ref);
        if (l->ref == NULL) {
            p->slot.racy = 1;
            break;
        }
        l->ref_is_index = all_digits(ref) && parse_u64(ref, &l->ref_index) == 0;
        l->kind = PROC_COMPUTE;
        if (tag != NULL && strcmp(tag, "graphics") == 0)
            l->kind = PROC_GRAPHICS;
        else if (tag != NULL && strcmp(tag, "mps") == 0)
            l->kind = PROC_MPS;
        l->known = known;
        l->bytes = bytes;
        p->n_lines++;
    }
    free(line);
    fclose(f);
}

/*
 * Live processes holding memory on dev, sorted by pid, at most max of them into out (which may
 * be NULL). Returns how many there are; *used_bytes (if not NULL) gets their summed memory.
 * Call between world_begin() and world_end().
 */
static int scan_procs(const struct device_info *dev, enum proc_kind kind, struct proc_entry *out,
                      int max, unsigned long long *used_bytes)
{
    if (used_bytes != NULL)
        *used_bytes = 0;
    procs_check();
    procs_liveness();
    int count = 0;
    for (size_t i = 0; i < g_world.n_procs; i++) {
        struct cached_proc *p = &g_world.procs[i];
        if (!p->alive)
            continue;
        if (slot_due(&p->slot)) {
            char path[PATH_BUF];
            int n = snprintf(path, sizeof path, "%s/procs/%s", g_world.root, p->name);
            if (n < 0 || (size_t)n >= sizeof path)
                continue;
            if (slot_stale(&p->slot, path))
                proc_reread(p, path);
        }
        if (p->slot.state != SLOT_PRESENT)
            continue;
        struct proc_entry entry = {(unsigned int)p->pid, 0, 0};
        int matched = 0;
        /* per kind: a process with compute and graphics contexts (or listed as an MPS
         * client too) has one figure, which NVML gives in each list; the device's memory
         * counts it once (the largest) */
        unsigned long long by_kind[3] = {0, 0, 0};
        for (size_t j = 0; j < p->n_lines; j++) {
            const struct proc_line *l = &p->lines[j];
            if (kind != PROC_ANY && kind != l->kind)
                continue;
            if (strcmp(l->ref, dev->uuid) != 0
                && !(l->ref_is_index && l->ref_index == dev->index))
                continue;
            matched = 1;
            if (l->known) {
                entry.known = 1;
                by_kind[l->kind] += l->bytes;
            }
        }
        if (!matched)
            continue;
        entry.used_bytes = by_kind[0] > by_kind[1] ? by_kind[0] : by_kind[1];
        if (by_kind[2] > entry.used_bytes)
            entry.used_bytes = by_kind[2];
        if (used_bytes != NULL)
            *used_bytes += entry.used_bytes;
        if (out != NULL && count < max)
            out[count] = entry;
        count++;
    }
    if (out != NULL)
        qsort(out, (size_t)(count < max ? count : max), sizeof *out, compare_pid);
    return count;
}

/* ------------------------------------------------------------------------------------------ */
/* Device-call prologue                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* Index of a handle into g_devices, or -1 when it is not one of ours. */
static int handle_index(nvmlDevice_t device)
{
    uintptr_t p = (uintptr_t)device;
    uintptr_t base = (uintptr_t)&g_devices[0];
    if (device == NULL || p < base || p >= base + sizeof g_devices
        || (p - base) % sizeof g_devices[0] != 0)
        return -1;
    return (int)((p - base) / sizeof g_devices[0]);
}

/*
 * Every device call starts here: initialised, a valid handle, the device still present, not
 * lost, no injected fault for this function. Fills *info on success.
 */
static nvmlReturn_t device_begin(nvmlDevice_t device, const char *function,
                                 struct device_info *info)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    int index = handle_index(device);
    if (index < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    world_begin();
    const struct device_info *d = world_device((unsigned int)index);
    int present = d != NULL;
    if (present)
        *info = *d;
    world_end();
    if (present && info->hang_ms > 0) { /* outside the world lock, as a driver call blocks */
        struct timespec ts = {info->hang_ms / 1000, (long)(info->hang_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    if (!present || info->lost)
        return NVML_ERROR_GPU_IS_LOST;
    int rc = rc_lookup(&info->rc, function);
    return rc != 0 ? (nvmlReturn_t)rc : NVML_SUCCESS;
}

/* The same checks for handle lookups (by index or UUID), which hand out &g_devices[index]. */
static nvmlReturn_t handle_for(const struct device_info *info, const char *function,
                               nvmlDevice_t *device)
{
    if (info->lost)
        return NVML_ERROR_GPU_IS_LOST;
    int rc = rc_lookup(&info->rc, function);
    if (rc != 0)
        return (nvmlReturn_t)rc;
    g_devices[info->index].index = info->index;
    *device = &g_devices[info->index];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Init, shutdown, errors, system                                                              */
/* ------------------------------------------------------------------------------------------ */

/* Non-zero code from the world file "init_rc", if present. */
static int init_rc_from_world(void)
{
    char path[PATH_BUF];
    if (world_path(path, sizeof path, "init_rc") != 0)
        return 0;
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 0;
    char buf[64] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    long long code;
    return parse_i64(trim(buf), &code) == 0 ? (int)code : 0;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    if (!world_is_dir())
        return NVML_ERROR_DRIVER_NOT_LOADED;
    int rc = init_rc_from_world();
    if (rc != 0)
        return (nvmlReturn_t)rc;
    pthread_mutex_lock(&g_init_lock);
    g_init_refcount++;
    pthread_mutex_unlock(&g_init_lock);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&g_init_lock);
    if (g_init_refcount == 0)
        ret = NVML_ERROR_UNINITIALIZED;
    else
        g_init_refcount--;
    int last = ret == NVML_SUCCESS && g_init_refcount == 0;
    pthread_mutex_unlock(&g_init_lock);
    if (last) {
        /* release the cache's descriptors (inotify, pidfds); a later init starts afresh */
        pthread_mutex_lock(&g_world_lock);
        world_reset();
        g_world.reset_needed = 1;
        pthread_mutex_unlock(&g_world_lock);
    }
    return ret;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "vGPU ECC not supported";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    }
    return "Unknown Error";
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    struct system_info sys;
    read_system(&sys);
    int rc = rc_lookup(&sys.rc, __func__);
    return rc != 0 ? (nvmlReturn_t)rc : copy_string(version, length, sys.driver_version);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    struct system_info sys;
    read_system(&sys);
    int rc = rc_lookup(&sys.rc, __func__);
    return rc != 0 ? (nvmlReturn_t)rc : copy_string(version, length, sys.nvml_version);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (cudaDriverVersion == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct system_info sys;
    read_system(&sys);
    int rc = rc_lookup(&sys.rc, __func__);
    if (rc != 0)
        return (nvmlReturn_t)rc;
    *cudaDriverVersion = sys.cuda_driver_version;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion);
}

/* ------------------------------------------------------------------------------------------ */
/* Device enumeration and identity                                                             */
/* ------------------------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (deviceCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    world_begin();
    int rc = rc_lookup(&world_system()->rc, __func__);
    unsigned int count = world_device_count();
    world_end();
    if (rc != 0)
        return (nvmlReturn_t)rc;
    *deviceCount = count;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct device_info info;
    world_begin();
    const struct device_info *d = world_device(index);
    int found = d != NULL;
    if (found)
        info = *d;
    world_end();
    return found ? handle_for(&info, __func__, device) : NVML_ERROR_INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (uuid == NULL || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct device_info info;
    int found = 0;
    world_begin();
    unsigned int n = world_device_count();
    for (unsigned int i = 0; i < n && !found; i++) {
        const struct device_info *d = world_device(i);
        if (d != NULL && strcmp(d->uuid, uuid) == 0) {
            info = *d;
            found = 1;
        }
    }
    world_end();
    return found ? handle_for(&info, __func__, device) : NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    return ret != NVML_SUCCESS ? ret : copy_string(uuid, length, d.uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    return ret != NVML_SUCCESS ? ret : copy_string(name, length, d.name);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (index == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = d.index;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (pci == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = d.index + 1;
    pci->device = 0;
    pci->pciDeviceId = 0x233010DEu;
    pci->pciSubSystemId = 0;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus & 0xFFu);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus & 0xFFu);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                      */
/* ------------------------------------------------------------------------------------------ */

struct memory_numbers {
    unsigned long long total, reserved, allocated;
};

/* total, reserved and allocated (base + live processes) in bytes, allocated clamped. */
static struct memory_numbers memory_numbers(const struct device_info *d)
{
    struct memory_numbers m;
    unsigned long long procs_bytes = 0;
    world_begin();
    scan_procs(d, PROC_ANY, NULL, 0, &procs_bytes);
    world_end();
    m.total = d->memory_total_mib * MIB;
    m.reserved = d->memory_reserved_mib * MIB;
    if (m.reserved > m.total)
        m.reserved = m.total;
    m.allocated = d->memory_base_mib * MIB + procs_bytes;
    if (m.allocated > m.total - m.reserved)
        m.allocated = m.total - m.reserved;
    return m;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct memory_numbers m = memory_numbers(&d);
    memory->total = m.total;
    memory->used = m.allocated + m.reserved; /* v1: used includes reserved */
    memory->free = m.total - memory->used;
    return NVML_SUCCESS;
}

#ifndef FAKENVML_NO_MEMORY_V2
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (memory == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    struct memory_numbers m = memory_numbers(&d);
    memory->total = m.total;
    memory->reserved = m.reserved;
    memory->used = m.allocated; /* v2: used excludes reserved */
    memory->free = m.total - m.reserved - m.allocated;
    return NVML_SUCCESS;
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* Utilization, temperature, power, clocks, ECC                                                */
/* ------------------------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (util == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = d.utilization_percent;
    util->memory = d.memory_utilization_percent;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensorType,
                                             unsigned int *temp)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (temp == NULL || sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = d.temperature_c < 0 ? 0u : (unsigned int)d.temperature_c;
    return NVML_SUCCESS;
}

#ifndef FAKENVML_NO_TEMPERATURE_V
EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temp)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (temp == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (temp->version != nvmlTemperature_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temp->sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    temp->temperature = d.temperature_c;
    return NVML_SUCCESS;
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device,
                                                      unsigned int thresholdType,
                                                      unsigned int *temp)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (temp == NULL || thresholdType >= NVML_TEMPERATURE_THRESHOLD_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    switch (thresholdType) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: *temp = d.temperature_shutdown_c; break;
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: *temp = d.temperature_slowdown_c; break;
    case NVML_TEMPERATURE_THRESHOLD_GPU_MAX: *temp = d.temperature_gpu_max_c; break;
    default: return NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}

/* One field value; per-field faults come from keys "rc_field_<id> <code>". */
static void fill_field(const struct device_info *d, nvmlFieldValue_t *v, int64_t now_us)
{
    char key[32];
    snprintf(key, sizeof key, "field_%u", v->fieldId);
    v->timestamp = now_us;
    v->latencyUsec = 0;
    v->valueType = NVML_VALUE_TYPE_SIGNED_INT;
    v->value.sllVal = 0;
    int rc = rc_lookup(&d->rc, key);
    if (rc != 0) {
        v->nvmlReturn = (unsigned int)rc;
        return;
    }
    v->nvmlReturn = NVML_SUCCESS;
    switch (v->fieldId) {
    case NVML_FI_DEV_TEMPERATURE_SHUTDOWN_TLIMIT:
        v->value.siVal = (int)d->temperature_shutdown_c;
        break;
    case NVML_FI_DEV_TEMPERATURE_SLOWDOWN_TLIMIT:
        v->value.siVal = (int)d->temperature_slowdown_c;
        break;
    case NVML_FI_DEV_TEMPERATURE_GPU_MAX_TLIMIT:
        v->value.siVal = (int)d->temperature_gpu_max_c;
        break;
    case NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v->value.uiVal = d->recovery_action;
        break;
    default:
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        break;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                             nvmlFieldValue_t *values)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (valuesCount < 0 || (valuesCount > 0 && values == NULL))
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t now_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    for (int i = 0; i < valuesCount; i++)
        fill_field(&d, &values[i], now_us);
    return NVML_SUCCESS;
}

/* Shared body of the calls that report one unsigned int of the device. */
static nvmlReturn_t get_uint(nvmlDevice_t device, const char *function, unsigned int *out,
                             size_t offset)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, function, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    memcpy(out, (const char *)&d + offset, sizeof *out);
    return NVML_SUCCESS;
}

/* The CPUs close to the GPU, from "cpus" (a CPU list), as a mask of cpuSetSize words; CPUs
 * past the words given are left out, as NVML does. NOT_SUPPORTED when the world names none
 * (a machine where the driver cannot tell), UNKNOWN for a list it cannot read. */
EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                             unsigned long *cpuSet)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (cpuSet == NULL || cpuSetSize == 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d.cpus[0] == '\0')
        return NVML_ERROR_NOT_SUPPORTED;
    const unsigned long bits = 8 * sizeof *cpuSet;
    memset(cpuSet, 0, cpuSetSize * sizeof *cpuSet);
    char *save = NULL;
    for (char *part = strtok_r(d.cpus, ",", &save); part != NULL;
         part = strtok_r(NULL, ",", &save)) {
        char *dash = strchr(part, '-');
        unsigned long long lo, hi;
        if (dash != NULL)
            *dash = '\0';
        if (parse_u64(trim(part), &lo) != 0)
            return NVML_ERROR_UNKNOWN;
        hi = lo;
        if (dash != NULL && parse_u64(trim(dash + 1), &hi) != 0)
            return NVML_ERROR_UNKNOWN;
        if (hi < lo)
            return NVML_ERROR_UNKNOWN;
        for (unsigned long long cpu = lo; cpu <= hi && cpu < cpuSetSize * bits; cpu++)
            cpuSet[cpu / bits] |= 1UL << (cpu % bits);
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    return get_uint(device, __func__, power, offsetof(struct device_info, power_mw));
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    return get_uint(device, __func__, limit, offsetof(struct device_info, power_limit_mw));
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit)
{
    return get_uint(device, __func__, limit, offsetof(struct device_info, power_limit_mw));
}

static nvmlReturn_t codec_utilization(nvmlDevice_t device, const char *function,
                                      unsigned int *utilization, unsigned int *samplingPeriodUs,
                                      size_t offset)
{
    nvmlReturn_t ret = get_uint(device, function, utilization, offset);
    if (ret != NVML_SUCCESS)
        return ret;
    if (samplingPeriodUs == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *samplingPeriodUs = 1000000;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs)
{
    return codec_utilization(device, __func__, utilization, samplingPeriodUs,
                             offsetof(struct device_info, encoder_percent));
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *utilization,
                                                    unsigned int *samplingPeriodUs)
{
    return codec_utilization(device, __func__, utilization, samplingPeriodUs,
                             offsetof(struct device_info, decoder_percent));
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, unsigned int type,
                                           unsigned int *clock)
{
    static const size_t offsets[] = {
        offsetof(struct device_info, clock_graphics_mhz),
        offsetof(struct device_info, clock_sm_mhz),
        offsetof(struct device_info, clock_mem_mhz),
        offsetof(struct device_info, clock_video_mhz),
    };
    if (type > NVML_CLOCK_VIDEO)
        return is_initialized() ? NVML_ERROR_INVALID_ARGUMENT : NVML_ERROR_UNINITIALIZED;
    return get_uint(device, __func__, clock, offsets[type]);
}

static nvmlReturn_t clocks_reasons(nvmlDevice_t device, const char *function,
                                   unsigned long long *reasons)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, function, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (reasons == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = d.clocks_event_reasons;
    return NVML_SUCCESS;
}

#ifndef FAKENVML_NO_CLOCKS_EVENT_REASONS
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons)
{
    return clocks_reasons(device, __func__, reasons);
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                              unsigned long long *reasons)
{
    return clocks_reasons(device, __func__, reasons);
}

/* errorType 0 corrected / 1 uncorrected; counterType 0 volatile / 1 aggregate (same value). */
EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                                unsigned int counterType,
                                                unsigned long long *eccCounts)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (eccCounts == NULL || errorType > 1 || counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eccCounts = errorType == 0 ? d.ecc_corrected : d.ecc_uncorrected;
    return NVML_SUCCESS;
}

/* Page retirement (before Ampere): retired pages wait for a reset or a driver reload (0/1). */
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                           unsigned int *isPending)
{
    return get_uint(device, __func__, isPending, offsetof(struct device_info, retired_pages_pending));
}

/* The row remapper (Ampere and later): rows remapped for correctable and uncorrectable
 * errors, a remap pending until the next reset, and whether a remap failed (0/1). */
EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                              unsigned int *uncRows, unsigned int *isPending,
                                              unsigned int *failureOccurred)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (corrRows == NULL || uncRows == NULL || isPending == NULL || failureOccurred == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *corrRows = d.remapped_rows_correctable;
    *uncRows = d.remapped_rows_uncorrectable;
    *isPending = d.remapped_rows_pending != 0;
    *failureOccurred = d.remapped_rows_failure != 0;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Running processes (two-call protocol)                                                       */
/* ------------------------------------------------------------------------------------------ */

/* Whether this process-list call (one with a buffer large enough) is one that "procs_race"
   makes fail: the first <value> such calls on the device after the value changed. */
static int race_now(const struct device_info *d)
{
    int fail = 0;
    pthread_mutex_lock(&g_race_lock);
    if (g_race[d->index].value != d->procs_race) {
        g_race[d->index].value = d->procs_race;
        g_race[d->index].failed = 0;
    }
    if (g_race[d->index].failed < d->procs_race) {
        g_race[d->index].failed++;
        fail = 1;
    }
    pthread_mutex_unlock(&g_race_lock);
    return fail;
}

static nvmlReturn_t running_processes(nvmlDevice_t device, const char *function,
                                      enum proc_kind kind, unsigned int *infoCount,
                                      nvmlProcessInfo_t *infos)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, function, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (infoCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct proc_entry *entries = calloc(MAX_PROCS, sizeof *entries);
    if (entries == NULL)
        return NVML_ERROR_MEMORY;
    world_begin();
    int n = scan_procs(&d, kind, entries, MAX_PROCS, NULL);
    world_end();
    if (n > MAX_PROCS)
        n = MAX_PROCS;
    if (infos == NULL || *infoCount < (unsigned int)n) {
        free(entries);
        *infoCount = (unsigned int)n;
        return n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && race_now(&d)) { /* as if more processes started after the count was taken */
        free(entries);
        *infoCount = *infoCount + 1;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        infos[i].pid = entries[i].pid;
        infos[i].usedGpuMemory = entries[i].known ? entries[i].used_bytes
                                                  : NVML_VALUE_NOT_AVAILABLE_ULL;
        infos[i].gpuInstanceId = NVML_NO_INSTANCE_ID;
        infos[i].computeInstanceId = NVML_NO_INSTANCE_ID;
    }
    free(entries);
    *infoCount = (unsigned int)n;
    return NVML_SUCCESS;
}

#ifndef FAKENVML_NO_PROCESSES_V3
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    return running_processes(device, __func__, PROC_COMPUTE, infoCount, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                             unsigned int *infoCount,
                                                             nvmlProcessInfo_t *infos)
{
    return running_processes(device, __func__, PROC_GRAPHICS, infoCount, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                               unsigned int *infoCount,
                                                               nvmlProcessInfo_t *infos)
{
    return running_processes(device, __func__, PROC_MPS, infoCount, infos);
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    return running_processes(device, __func__, PROC_COMPUTE, infoCount, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device,
                                                             unsigned int *infoCount,
                                                             nvmlProcessInfo_t *infos)
{
    return running_processes(device, __func__, PROC_GRAPHICS, infoCount, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device,
                                                               unsigned int *infoCount,
                                                               nvmlProcessInfo_t *infos)
{
    return running_processes(device, __func__, PROC_MPS, infoCount, infos);
}

/* ------------------------------------------------------------------------------------------ */
/* Events                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* The event set behind a handle, or NULL; call with g_event_lock held. */
static struct nvmlEventSet_st *event_set_locked(nvmlEventSet_t set)
{
    uintptr_t p = (uintptr_t)set;
    uintptr_t base = (uintptr_t)&g_event_sets[0];
    if (set == NULL || p < base || p >= base + sizeof g_event_sets
        || (p - base) % sizeof g_event_sets[0] != 0 || !set->in_use)
        return NULL;
    return set;
}

/* Device index named by an events line (index or UUID), or -1. */
static int event_device_index(const char *ref)
{
    unsigned long long index;
    int found = -1;
    world_begin();
    unsigned int n = world_device_count();
    if (all_digits(ref)) {
        if (parse_u64(ref, &index) == 0 && index < n)
            found = (int)index;
    } else {
        for (unsigned int i = 0; i < n && found < 0; i++) {
            const struct device_info *d = world_device(i);
            if (d != NULL && strcmp(d->uuid, ref) == 0)
                found = (int)i;
        }
    }
    world_end();
    return found;
}

/*
 * Consume complete lines of the events file after set->cursor until one is deliverable to the
 * set; fill *data and return 1 then, else 0. Call with g_event_lock held.
 */
static int next_event_locked(struct nvmlEventSet_st *set, nvmlEventData_t *data)
{
    char path[PATH_BUF];
    if (world_path(path, sizeof path, "events") != 0)
        return 0;
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return 0;
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && (long long)st.st_size < set->cursor) {
        /* The file was truncated or replaced by a shorter one: all of it is new. */
        set->cursor = 0;
        for (int i = 0; i < MAX_DEVICES; i++)
            set->registered_at[i] = 0;
    }
    int found = 0;
    if (fseeko(f, (off_t)set->cursor, SEEK_SET) == 0) {
        char *line = NULL;
        size_t cap = 0;
        ssize_t len;
        while (!found && (len = getline(&line, &cap, f)) > 0) {
            if (line[len - 1] != '\n')
                break; /* a line still being written; read it next time */
            long long line_start = set->cursor;
            set->cursor += len;
            char *save = NULL;
            char *ref = strtok_r(line, " \t\r\n", &save);
            char *xid_text = strtok_r(NULL, " \t\r\n", &save);
            unsigned long long xid;
            if (ref == NULL || xid_text == NULL || parse_u64(xid_text, &xid) != 0)
                continue;
            int index = event_device_index(ref);
            if (index < 0 || !(set->mask[index] & nvmlEventTypeXidCriticalError)
                || line_start < set->registered_at[index])
                continue;
            g_devices[index].index = (unsigned int)index;
            data->device = &g_devices[index];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = xid;
            data->gpuInstanceId = NVML_NO_INSTANCE_ID;
            data->computeInstanceId = NVML_NO_INSTANCE_ID;
            found = 1;
        }
        free(line);
    }
    fclose(f);
    return found;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (set == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    int rc = system_rc(__func__);
    if (rc != 0)
        return (nvmlReturn_t)rc;
    long long size = file_size("events");
    nvmlReturn_t ret = NVML_ERROR_INSUFFICIENT_RESOURCES;
    pthread_mutex_lock(&g_event_lock);
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (g_event_sets[i].in_use)
            continue;
        memset(&g_event_sets[i], 0, sizeof g_event_sets[i]);
        g_event_sets[i].in_use = 1;
        g_event_sets[i].cursor = size;
        *set = &g_event_sets[i];
        ret = NVML_SUCCESS;
        break;
    }
    pthread_mutex_unlock(&g_event_lock);
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *eventTypes)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (eventTypes == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = FAKE_SUPPORTED_EVENT_TYPES;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                             nvmlEventSet_t set)
{
    struct device_info d;
    nvmlReturn_t ret = device_begin(device, __func__, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (eventTypes & ~FAKE_SUPPORTED_EVENT_TYPES)
        return NVML_ERROR_NOT_SUPPORTED;
    long long size = file_size("events");
    pthread_mutex_lock(&g_event_lock);
    struct nvmlEventSet_st *s = event_set_locked(set);
    if (s == NULL) {
        ret = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        if (s->mask[d.index] == 0)
            s->registered_at[d.index] = size;
        s->mask[d.index] |= eventTypes;
    }
    pthread_mutex_unlock(&g_event_lock);
    return ret;
}

static long long monotonic_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Polls the events file every 10 ms until an event arrives or timeoutms pass. */
EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeoutms)
{
    if (data == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = monotonic_ms() + (long long)timeoutms;
    for (;;) {
        if (!is_initialized())
            return NVML_ERROR_UNINITIALIZED;
        int rc = system_rc(__func__);
        if (rc != 0)
            return (nvmlReturn_t)rc;
        pthread_mutex_lock(&g_event_lock);
        struct nvmlEventSet_st *s = event_set_locked(set);
        int found = s != NULL && next_event_locked(s, data);
        pthread_mutex_unlock(&g_event_lock);
        if (s == NULL)
            return NVML_ERROR_INVALID_ARGUMENT;
        if (found)
            return NVML_SUCCESS;
        long long left = deadline - monotonic_ms();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        struct timespec pause = {0, (left < 10 ? left : 10) * 1000000L};
        nanosleep(&pause, NULL);
    }
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!is_initialized())
        return NVML_ERROR_UNINITIALIZED;
    int rc = system_rc(__func__);
    if (rc != 0)
        return (nvmlReturn_t)rc;
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&g_event_lock);
    struct nvmlEventSet_st *s = event_set_locked(set);
    if (s == NULL)
        ret = NVML_ERROR_INVALID_ARGUMENT;
    else
        s->in_use = 0;
    pthread_mutex_unlock(&g_event_lock);
    return ret;
}
